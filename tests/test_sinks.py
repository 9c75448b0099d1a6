"""W&B and MLflow get the scalars TensorBoard gets (`dloco.sinks`), in their offline/local modes:
W&B offline files under the run dir, an MLflow file store read back through its client."""

import sys

import pytest
from conftest import wait_for

from dloco import config
from dloco.tensorboard import TensorBoardSink

EVENTS = [
    {"event": "eval", "time": 100.0, "t": 0.0, "loss": 5.5, "tokens": 0},
    {"event": "eval", "time": 110.0, "t": 10.0, "loss": 4.25, "tokens": 2048},
    {"event": "goodput", "time": 111.0, "t": 11.0, "goodput": 0.75, "uptime": 1.0},
]


def test_mlflow_gets_every_scalar_with_its_step_and_the_run_config(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    cfg = config.load(overrides=(f"metrics.mlflow={uri}", "learners.count=3")).to_dict()
    with TensorBoardSink(tmp_path / "run-a", fragments=2, config=cfg) as sink:
        assert sum(sink.write(e) for e in EVENTS) == sink._written > 0
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dloco").experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.params["learners.count"] == "3" and run.data.params["metrics.mlflow"] == uri
    loss = [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, "eval/loss")]
    assert loss == [(0, 5.5, 100_000), (2048, 4.25, 110_000)]  # steps: tokens trained; wall times in ms
    assert [m.value for m in client.get_metric_history(run.info.run_id, "goodput/goodput")] == [0.75]


def test_wandb_offline_writes_the_run_under_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config.load(overrides=("metrics.wandb=dloco-test", "metrics.wandb_mode=offline")).to_dict()
    with TensorBoardSink(tmp_path, fragments=2, config=cfg) as sink:
        for e in EVENTS:
            sink.write(e)

    # finish() waits for the exit record, but tells wandb-core to close the run's file without waiting
    # (ServerInformFinishRequest is publish-only): on a loaded machine the records land a moment later.
    def records():
        (record,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
        return record.read_bytes()

    wait_for(lambda: b"goodput/goodput" in records(), timeout=60, every=0.2, fail=False)
    data = records()
    assert b"eval/loss" in data and b"goodput/goodput" in data and b"t_s" in data and b"dloco-test" in data


def test_a_tracker_that_is_not_installed_is_one_line_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    cfg = config.load(overrides=("metrics.mlflow=file:/tmp/x",)).to_dict()
    with pytest.raises(
        ValueError, match=r"^metrics.mlflow is set but mlflow is not installed: pip install 'dloco\[mlflow\]'$"
    ):
        TensorBoardSink(tmp_path, fragments=2, config=cfg)
    with pytest.raises(config.ConfigError, match="metrics.wandb_mode='sometimes' is invalid"):
        config.load(overrides=("metrics.wandb_mode=sometimes",))
