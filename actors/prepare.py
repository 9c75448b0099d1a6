"""``dloco prepare SOURCE --out URI``: `dloco.data.prepare` with Ray Data as its engine.

`ray_engine` reads the source's files with ``ray.data.read_binary_files`` (``text:``, ``stdlib``,
``shakespeare``: a file is one document, as `dloco.data.read_documents` has it),
``ray.data.read_json`` (``jsonl:``, one document per line) or ``ray.data.read_parquet`` (``parquet:``,
the text column), each row with its file's path, then ``map_batches`` with the batch function
(`dloco.data.encode.Encoder`: an actor pool, each actor building its tokenizer once), and yields
the results in input order (``preserve_order``). The driver cuts and writes the shards
(`dloco.data.pipeline`). A URI (``s3://``, ``gs://``, ``hdfs://``, ``file://``) is read through its
`pyarrow.fs` filesystem wherever Ray runs the read; a local path as it is on one node, and on a
cluster of several as ``local://`` (on the driver's node: Ray Data deprecates that form, so put a
large corpus on shared or cloud storage).

Ray starts only once the inputs and ``--out`` are checked (a refusal starts nothing): a local
cluster on 127.0.0.1 as ``dloco train`` starts one (`actors.launch.connect`), stopped at the end,
or the cluster of ``--address`` / RAY_ADDRESS, as under ``ray job submit -- dloco prepare …``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from dloco import data
from dloco.data.encode import BATCH_DOCUMENTS


def _one_line(e: BaseException) -> str:
    """The user's error inside a Ray error, as one line: its last line that names an exception."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        return _one_line(cause)
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception"))]
    return (named or lines or [type(e).__name__])[-1]


def ray_engine(
    kind: str, paths: list[str], fs: Any, text_field: str, udf: type, kwargs: dict[str, Any]
) -> Iterator[dict[str, np.ndarray]]:
    """`dloco.data.encode.Engine` on Ray Data (module docstring); connects to Ray if not yet."""
    import ray
    import ray.data
    from ray.data import ActorPoolStrategy

    from actors.launch import connect

    if not ray.is_initialized():
        connect(None, num_cpus=os.cpu_count())
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False  # `dloco prepare` shows its own
    ctx.print_on_execution_start = False
    if fs is None and len([n for n in ray.nodes() if n.get("Alive")]) > 1:
        paths = ["local://" + os.path.abspath(p) for p in paths]
    common: dict[str, Any] = {"include_paths": True, "filesystem": fs, "file_extensions": None}
    if kind == "text":
        ds = ray.data.read_binary_files(paths, **common)
    elif kind == "jsonl":
        ds = ray.data.read_json(paths, **common)
    else:
        ds = ray.data.read_parquet(paths, columns=[text_field], **common)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    ds = ds.map_batches(
        udf,
        fn_constructor_kwargs=kwargs,
        compute=ActorPoolStrategy(min_size=1, max_size=cpus),
        batch_size=BATCH_DOCUMENTS,
        batch_format="numpy",
    )
    try:
        yield from ds.iter_batches(batch_size=None, batch_format="numpy")
    except ray.exceptions.RayError as e:
        named = next((p for p in paths if p in str(e)), None)  # the file, where Ray's message names it
        where = named or f"{kind} source of {len(paths)} files from {paths[0]}"
        raise ValueError(f"{where}: {_one_line(e)}") from None


def prepare(source: str, out: str, *, address: str | None = None, **options: Any) -> data.Manifest:
    """`dloco.data.prepare` of `source` into `out` on Ray Data (`ray_engine`): on the cluster of
    `address` (or RAY_ADDRESS), else on a local one started for it and stopped at the end. `options`
    are `dloco.data.prepare`'s."""
    import ray

    from actors.launch import connect

    started = False

    def engine(
        kind: str, paths: list[str], fs: Any, text_field: str, udf: type, kwargs: dict[str, Any]
    ) -> Iterator[dict[str, np.ndarray]]:
        nonlocal started
        if not ray.is_initialized():
            started = connect(address, num_cpus=os.cpu_count())
        return ray_engine(kind, paths, fs, text_field, udf, kwargs)

    try:
        return data.prepare(source, out, engine=engine, **options)
    finally:
        if started:
            ray.shutdown()
