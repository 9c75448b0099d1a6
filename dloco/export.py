"""Weights out and back in: a run's global model as safetensors or an Orbax checkpoint, loaded
again to evaluate, to start a run from (`model.init_from`) or to use elsewhere.

An export is a directory:

    model.safetensors | orbax/   the parameters, float32, named as in the model's tree
                                 ("block_0/attn/qkv/kernel", ...; safetensors keys are those paths)
    config.json                  the run's config (model, data, tokenizer: enough to rebuild it)
    dloco.json                   format, per-fragment versions, where from, parameter count, vocabulary
    tokenizer.json               the BPE tokenizer, when the run used one

`read_run` reads the global model of a run directory without touching the run: the newest state
that verifies (`read_global`), so a running store may go on writing beside it; a
fragment that never merged is still its initial Θ_p⁰. ``snapshot=N`` reads the state after N
commits instead (one of the snapshots the store keeps): with P fragments, each with its own
version, the snapshots are the consistent cuts that exist on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import linen as nn

from dloco import config, durable, model
from dloco.config import RunConfig
from dloco.data import Tokenizer
from dloco.fragments import flatten, unflatten
from dloco.services import shards
from dloco.store import SNAP_NAME, WAL_NAME, CorruptFileError, load_fragment

FORMATS = ("safetensors", "orbax")
META = "dloco.json"


@dataclasses.dataclass(frozen=True)
class Exported:
    """A model read from a run directory or an export: its config, float32 parameters (the
    model's nested tree), per-fragment versions, where it came from and its tokenizer file."""

    cfg: RunConfig
    params: dict
    versions: list[int]
    source: str
    vocab_size: int
    tokenizer_file: Path | None

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the model was trained with."""
        if self.cfg.data.tokenizer == "byte":
            return Tokenizer.byte()
        if self.tokenizer_file is None or not self.tokenizer_file.exists():
            raise FileNotFoundError(f"{self.source}: the BPE tokenizer of this model is not found (tokenizer.json)")
        return Tokenizer.from_file(self.tokenizer_file)

    def module(self) -> nn.Module:
        return model.build(self.cfg.model, self.vocab_size)


def read_global(root: str | os.PathLike, count: int, snapshot: int | None = None) -> tuple[list, list, str]:
    """The global model a store directory holds, read only (no lock, nothing moved: a running
    store may write beside it): (versions, Θ_p per fragment: None for one never committed, which
    is Θ_p⁰, where from). The newest snapshot that
    verifies, then each fragment's newest log file that verifies, if newer; with `snapshot`, that
    snapshot (``snap-<snapshot>``, the state after that many commits) alone. Raises
    `FileNotFoundError` naming what is there when nothing (or not that snapshot) verifies."""
    root, source = Path(root), ""
    frs: list = [None] * count
    snaps = [(n, p) for (n,), p in durable.numbered(root, SNAP_NAME) if p.is_dir()]
    for _, snap in reversed([(n, p) for n, p in snaps if snapshot in (None, n)]):
        with contextlib.suppress(CorruptFileError):
            frs, source = list(load_fragment(snap / f"p{p:03d}.npz") for p in range(count)), snap.name
            break
    if snapshot is not None and not source:
        raise FileNotFoundError(f"{root}: no intact snapshot after {snapshot} commits (kept: {[n for n, _ in snaps]})")
    log = durable.numbered(root / "wal", WAL_NAME) if snapshot is None and (root / "wal").is_dir() else []
    for p in range(count):
        for (_, v), path in reversed([e for e in log if e[0][0] == p]):
            held = frs[p]
            if held is not None and v <= held.version:
                break
            with contextlib.suppress(CorruptFileError):
                frs[p], source = load_fragment(path), source or "log"
                break
    if all(f is None for f in frs):
        raise FileNotFoundError(f"{root}: no commit to read (is it a run's store directory, and has it merged?)")
    return [0 if f is None else f.version for f in frs], [None if f is None else f.values for f in frs], source


def read_shards(run_dir: Path, count: int, n: int, snapshot: int | None = None) -> tuple[list, list, str]:
    """`read_global` over the `n` store shards of a run (`syncer.shards`), each fragment from its own
    shard (`dloco.services.shards`); ``snapshot=N`` reads each shard's snapshot after N of its commits."""
    if n == 1:
        return read_global(run_dir / "store", count, snapshot)
    versions, values, sources = [0] * count, [None] * count, []
    for s in range(n):
        try:
            v, x, source = read_global(shards.store_root(run_dir, s, n), count, snapshot)
        except FileNotFoundError:
            if snapshot is not None:
                raise
            continue  # nothing of this shard merged yet: its fragments are Θ_p⁰
        sources.append(f"shard {s}: {source}")
        for p in shards.owned(count, n, s):
            versions[p], values[p] = v[p], x[p]
    if not sources:
        raise FileNotFoundError(f"{run_dir / 'store'}: no commit in any of its {n} shards")
    return versions, values, ", ".join(sources)


def _run_config(run_dir: Path) -> tuple[RunConfig, dict]:
    for name in ("config.json", "fingerprint.json"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir}: not a run directory or an export (no {name})")
    return config.from_dict(json.loads((run_dir / "config.json").read_text())), json.loads(
        (run_dir / "fingerprint.json").read_text()
    )


def read_run(run_dir: str | os.PathLike, snapshot: int | None = None) -> Exported:
    """The global model of a run directory (module docstring)."""
    run_dir = Path(run_dir)
    cfg, fp = _run_config(run_dir)
    vocab = int(fp["vocab_size"])
    shapes = [{n: tuple(s) for n, s in f} for f in fp["plan"]]
    versions, values, source = read_shards(run_dir, len(shapes), cfg.syncer.shards, snapshot)
    if any(v is None for v in values):  # a fragment never merged: Θ_p⁰, from the run's seed
        init = flatten(model.init_params(model.build(cfg.model, vocab), cfg.seed, cfg.data.seq_len))
        values = [{n: np.asarray(init[n]) for n in s} if v is None else v for v, s in zip(values, shapes, strict=True)]
    for p, (v, s) in enumerate(zip(values, shapes, strict=True)):
        got = {n: tuple(x.shape) for n, x in v.items()}
        if got != s:
            raise ValueError(f"{run_dir}: fragment {p} on disk does not match fingerprint.json's plan")
    flat = {n: np.asarray(x, np.float32) for v in values for n, x in v.items()}
    tok = Path(cfg.data.cache_dir).expanduser() / fp["data"]["key"][:16] / "tokenizer.json"
    return Exported(cfg, unflatten(flat), versions, f"{run_dir} ({source})", vocab, tok if tok.exists() else None)


def export(run_dir: str | os.PathLike, out: str | os.PathLike, fmt: str, snapshot: int | None = None) -> dict:
    """Writes the run's global model to the directory `out` (created; must be empty or absent)
    in `fmt` (safetensors | orbax); returns what ``dloco.json`` holds."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty directory; choose a new --out")
    m = read_run(run_dir, snapshot)
    out.mkdir(parents=True, exist_ok=True)
    flat = flatten(m.params)
    if fmt == "safetensors":
        from safetensors.numpy import save_file

        save_file(flat, str(out / "model.safetensors"), metadata={"format": "dloco", "versions": str(m.versions)})
    else:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save((out / "orbax").absolute(), m.params)
    (out / "config.json").write_text(json.dumps(m.cfg.to_dict(), indent=2))
    if m.tokenizer_file is not None and m.cfg.data.tokenizer != "byte":
        shutil.copy(m.tokenizer_file, out / "tokenizer.json")
    meta = {
        "format": fmt,
        "versions": m.versions,
        "source": m.source,
        "parameters": int(sum(x.size for x in flat.values())),
        "vocab_size": m.vocab_size,
    }
    (out / META).write_text(json.dumps(meta, indent=2))
    return meta


def read_export(path: str | os.PathLike) -> Exported:
    """An export written by `export`."""
    path = Path(path)
    meta = json.loads((path / META).read_text())
    cfg = config.from_dict(json.loads((path / "config.json").read_text()))
    if meta["format"] == "safetensors":
        from safetensors.numpy import load_file

        params = unflatten(load_file(str(path / "model.safetensors")))
    elif meta["format"] == "orbax":
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckpt:
            params = ckpt.restore((path / "orbax").absolute())
        params = unflatten({n: np.asarray(x, np.float32) for n, x in flatten(params).items()})
    else:
        raise ValueError(f"{path / META}: unknown format {meta['format']!r}")
    tok = path / "tokenizer.json"
    return Exported(
        cfg, params, list(meta["versions"]), str(path), int(meta["vocab_size"]), tok if tok.exists() else None
    )


def load(path: str | os.PathLike, snapshot: int | None = None) -> Exported:
    """A model from an export directory or a run directory."""
    path = Path(path)
    if (path / META).is_file():
        if snapshot is not None:
            raise ValueError(f"{path}: an export holds one state; --snapshot applies to a run directory")
        return read_export(path)
    return read_run(path, snapshot)


def initial_params(path: str | os.PathLike, cfg: RunConfig, vocab_size: int, seq_len: int) -> dict[str, Any]:
    """`model.init_from`: the parameters at `path` for the model `cfg` builds; a `ValueError`
    naming the first tensor that differs if they are not of that model."""
    src = load(path)
    shapes = jax.eval_shape(functools.partial(model.init_params, model.build(cfg.model, vocab_size), 0, seq_len))
    want, have = flatten(shapes), flatten(src.params)
    for n in sorted(set(want) | set(have)):
        a, b = want.get(n), have.get(n)
        if a is None or b is None or tuple(a.shape) != tuple(b.shape):
            got = "missing" if b is None else f"shape {tuple(b.shape)}"
            need = "none" if a is None else f"shape {tuple(a.shape)}"
            raise ValueError(
                f"model.init_from={path}: tensor {n} is {got} there, the config's model needs {need}: "
                "use that model's settings (model.*, data.tokenizer) or another checkpoint"
            )
    return unflatten({n: np.asarray(have[n], np.float32) for n in want})


def evaluate(m: Exported, source: str, *, batches: int = 32, batch_size: int = 16, max_bytes: int = 0) -> dict:
    """Next-token loss (nats per token) and perplexity of `m` on the documents of `source` (any
    corpus source: stdlib, shakespeare, text:GLOB, jsonl:GLOB, parquet:GLOB, with the run's data.text_field),
    tokenized with `m`'s tokenizer, each ending in EOS, over the first `batches` × `batch_size`
    windows of the model's seq_len."""
    from dloco import inner
    from dloco.data import eval_batches, read_documents

    docs = read_documents(source, max_bytes, m.cfg.data.text_field)
    tok = None
    ids = []
    for _, content in docs:
        if isinstance(content, np.ndarray):  # a tokens column: the ids as given
            ids.append(content)
        else:
            tok = tok or m.tokenizer()
            ids.append(tok.encode(content.decode("utf-8", errors="replace"), eos=True))
    tokens = np.concatenate(ids)
    if tokens.size and int(tokens.max()) >= m.vocab_size:
        raise ValueError(f"{source}: token id {int(tokens.max())} is outside the model's vocabulary ({m.vocab_size})")
    mesh = inner.make_mesh()
    per = -(-batch_size // mesh.size) * mesh.size  # a multiple of the devices the batch is split over
    data = eval_batches(tokens, seq_len=m.cfg.data.seq_len, batch_size=per, max_batches=batches)
    loss = inner.evaluate(inner.make_eval_step(m.module(), mesh), inner.replicate(m.params, mesh), data, mesh)
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": len(data) * per * m.cfg.data.seq_len,
        "documents": len(docs),
        "source": source,
        "model": m.source,
    }
