"""Optional experiment trackers beside TensorBoard: Weights & Biases and MLflow, off by default.

Each receives exactly the scalars `dloco.tensorboard.TensorBoardSink` writes (same tags, same
steps; see its docstring), plus the run's config as parameters:

- ``metrics.wandb=PROJECT`` logs to that W&B project (``pip install dloco[wandb]``); the run is
  named after the run directory and its files go under ``RUN_DIR/wandb``. ``metrics.wandb_mode``:
  ``online`` (needs ``wandb login`` or WANDB_API_KEY) or ``offline`` (files only; ``wandb sync``
  them later). W&B wants one increasing step per run: every scalar is logged with the run's
  seconds, ``t_s``, as its x-axis and its own step as ``TAG/step``.
- ``metrics.mlflow=TRACKING_URI`` logs to MLflow (``pip install dloco[mlflow]``): ``file:PATH`` for a
  local store (MLflow 3 keeps it in "maintenance mode": this sets MLFLOW_ALLOW_FILE_STORE),
  ``sqlite:///PATH`` (with the full ``mlflow``) or ``http(s)://HOST`` for a server; experiment
  ``dloco``, run named after the run directory, each scalar with its own step and wall time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, int | float | str | bool) or v is None else str(v)
    return out


class WandbSink:
    def __init__(self, run_dir: Path, project: str, mode: str, config: Mapping[str, Any]) -> None:
        import wandb

        self._start: float | None = None
        self._run = wandb.init(
            project=project,
            name=run_dir.name,
            dir=str(run_dir),
            mode=cast(Any, mode),
            config=_flat(config),
            reinit="create_new",
        )

    def scalar(self, tag: str, value: float, step: int, wall: float | None) -> None:
        if wall is not None and self._start is None:
            self._start = wall
        t = 0.0 if wall is None or self._start is None else wall - self._start
        self._run.log({tag: value, f"{tag}/step": step, "t_s": t})

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    def __init__(self, run_dir: Path, uri: str, config: Mapping[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch ("maintenance mode")
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name("dloco")
        experiment = found.experiment_id if found else self._client.create_experiment("dloco")
        self._run_id = self._client.create_run(experiment, run_name=run_dir.name).info.run_id
        for k, v in _flat(config).items():
            self._client.log_param(self._run_id, k, str(v)[:500])

    def scalar(self, tag: str, value: float, step: int, wall: float | None) -> None:
        ts = int(1000 * wall) if wall is not None else None
        self._client.log_metric(self._run_id, tag, float(value), timestamp=ts, step=int(step))

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def open_sinks(run_dir: str | os.PathLike, config: Mapping[str, Any]) -> list[WandbSink | MlflowSink]:
    """The trackers `config` (a `RunConfig.to_dict()`) turns on, opened for `run_dir`."""
    m, run_dir = config.get("metrics", {}), Path(run_dir)
    out: list[WandbSink | MlflowSink] = []
    try:
        if m.get("wandb"):
            out.append(WandbSink(run_dir, m["wandb"], m.get("wandb_mode", "online"), config))
        if m.get("mlflow"):
            out.append(MlflowSink(run_dir, m["mlflow"], config))
    except ImportError as e:
        for sink in out:
            sink.close()
        which = "wandb" if "wandb" in str(e) else "mlflow"
        raise ValueError(f"metrics.{which} is set but {which} is not installed: pip install 'dloco[{which}]'") from None
    return out
