"""Weights out and back in: a run's global model as safetensors or an Orbax checkpoint, loaded
again to evaluate, to start a run from (`model.init_from`) or to use elsewhere.

An export is a directory:

    model.safetensors | orbax/   the parameters, float32, named as in the model's tree
                                 ("block_0/attn/qkv/kernel", ...; safetensors keys are those paths)
    config.json                  the run's config (model, data, tokenizer: enough to rebuild it)
    dloco.json                   format, per-fragment versions, where from, parameter count, vocabulary
    tokenizer.json               the BPE tokenizer, when the run used one

``--format hf`` writes the llama family as a Hugging Face checkpoint instead (`dloco.hf`: HF's
config, tensor names and layouts, tokenizer files), which ``model.init_from=hf:DIR`` reads back.

`read_run` reads the global model of a run directory without touching the run: the newest state
that verifies (`read_global`), so a running store may go on writing beside it; a
fragment that never merged is still its initial Θ_p⁰. ``snapshot=N`` reads the state after N
commits instead (one of the snapshots the store keeps): with P fragments, each with its own
version, the snapshots are the consistent cuts that exist on disk.

An export is written complete or not at all (a ``tmp-*`` directory beside it, renamed into place),
and what does not read as one (a truncated, empty or foreign model file, a ``dloco.json`` or
``config.json`` other than `export` writes) raises `ModelReadError` naming the file: ``dloco eval``
ends with that one line and exit 2 (`actors.cli`), not a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import linen as nn

from dloco import config, durable, hf, model
from dloco.commitlog import SNAP_NAME, WAL_NAME, load_entry, load_fragment, roll_forward
from dloco.config import RunConfig
from dloco.data import Tokenizer
from dloco.durable import CorruptFileError
from dloco.fragments import flatten, unflatten
from dloco.services import shards

FORMATS = ("safetensors", "orbax")  # dloco's own: what `load` reads back
EXPORT_FORMATS = (*FORMATS, "hf")  # and the llama family as a Hugging Face checkpoint (`dloco.hf`)
META = "dloco.json"
READ_ATTEMPTS = 8  # reads of a store that pruned what was being read, before `read_global` gives up


class ModelReadError(ValueError):
    """A model that cannot be read: a damaged export (the message names the file), or a run's
    store that pruned what was being read on every one of `READ_ATTEMPTS` reads. A ValueError, so
    the CLI ends with one line and exit 2 (`actors.cli._expected`); deliberately not a
    FileNotFoundError, which `read_shards` takes for a shard with nothing merged yet (Θ_p⁰)."""


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
    `FileNotFoundError` naming what is there when nothing (or not that snapshot) verifies.

    A running store prunes as it snapshots (`StoreCore._prune`: older snapshots, and the log files
    the oldest kept one covers), so a file listed here may be gone when it is read. Falling back
    to what else was listed is then wrong: with ``store.keep=1`` the older snapshot is gone too,
    and a fragment with commits read as Θ_p⁰ (206 of 8,455 reads racing a store). So a read that
    found a listed file missing while the store's listing changed starts over from a new listing,
    and after `READ_ATTEMPTS` such reads raises `ModelReadError`. A file missing from a listing
    that did not change is damage, and is skipped as a damaged one is (as the store's own restore
    does). The log is listed before the snapshots: a log file pruned after that is covered by a
    snapshot the later listing holds, so no fragment reads older than it was when the read began."""
    root = Path(root)
    for _ in range(READ_ATTEMPTS):
        if (got := _read_global_once(root, count, snapshot)) is not None:
            return got
    raise ModelReadError(
        f"{root}: the store pruned the files of its state as they were read, {READ_ATTEMPTS} times in a row "
        "(a run snapshotting faster than it can be read); try again"
    )


def _listing(root: Path, snapshot: int | None) -> tuple[list, list]:
    """(log files, snapshot directories) of a store directory, oldest first; no log for `snapshot`."""
    log = durable.numbered(root / "wal", WAL_NAME) if snapshot is None and (root / "wal").is_dir() else []
    return log, [(n, p) for (n,), p in durable.numbered(root, SNAP_NAME) if p.is_dir()]


def _read_global_once(root: Path, count: int, snapshot: int | None) -> tuple[list, list, str] | None:
    """One read of `read_global`; None when a listed file vanished as the store moved on (read again)."""
    source, missing = "", False
    frs: list = [None] * count
    log, snaps = _listing(root, snapshot)  # the log first (`read_global`)
    for _, snap in reversed([(n, p) for n, p in snaps if snapshot in (None, n)]):
        try:
            frs, source = list(load_fragment(snap / f"p{p:03d}.npz") for p in range(count)), snap.name
            break
        except CorruptFileError as e:
            missing = missing or e.reason == "missing"
    damaged: list[str] = []
    for p in range(count):
        held = frs[p]
        frs[p] = roll_forward(
            held,
            [(v, path) for (q, v), path in log if q == p],
            set_aside=lambda path, reason: damaged.append(reason),  # read only: the store sets files aside
            check=lambda path, f: None,
            load=lambda path: load_entry(path),  # looked up at each call (a test wraps it)
        )
        source = source or ("log" if frs[p] is not held else "")
    missing = missing or "missing" in damaged
    if missing:
        now_log, now_snaps = _listing(root, snapshot)
        if now_snaps != snaps or not set(log) <= set(now_log):  # pruned (or set aside) under this read
            return None
    if snapshot is not None and not source:
        raise FileNotFoundError(f"{root}: no intact snapshot after {snapshot} commits (kept: {[n for n, _ in snaps]})")
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
    versions, values, source = read_shards(run_dir, len(fp["plan"]), cfg.syncer.shards, snapshot)
    return assemble(run_dir, versions, values, source)


def assemble(run_dir: str | os.PathLike, versions: list[int], values: list, source: str) -> Exported:
    """The model of run `run_dir` from its fragments' `values` (None: never merged, Θ_p⁰ from the
    run's seed) at `versions`: `read_run` from the files, `dloco.checkpoints` from a store's memory."""
    run_dir = Path(run_dir)
    cfg, fp = _run_config(run_dir)
    vocab = int(fp["vocab_size"])
    shapes = [{n: tuple(s) for n, s in f} for f in fp["plan"]]
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
    in `fmt` (safetensors | orbax | hf); returns what ``dloco.json`` holds (an HF export,
    `dloco.hf`, has no ``dloco.json``: it is HF's files alone, with this in its safetensors header).

    Complete or not at all (`durable.write_dir`): written into a ``tmp-*`` directory beside `out`,
    every file fsynced, then renamed to `out`. Written in place, a failure (disk full) or a kill
    midway left a half export that ``dloco eval`` read (or, its ``dloco.json`` not yet written,
    took for a run directory) and that refused the same --out again; now no `out` appears, and
    the temporary directory is removed (a kill leaves it, named ``tmp-*``)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    out = Path(out)

    def refuse_a_used_out() -> None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"{out}: exists and is not an empty directory; choose a new --out")

    refuse_a_used_out()
    if fmt == "hf":  # before the run is read: a model or corpus it cannot write
        cfg, fp = _run_config(Path(run_dir))
        hf.check_exportable(cfg, fp.get("tokenizer", {}).get("kind", cfg.data.tokenizer))
    m = read_run(run_dir, snapshot)
    flat = flatten(m.params)
    meta = {
        "format": fmt,
        "versions": m.versions,
        "source": m.source,
        "parameters": int(sum(x.size for x in flat.values())),
        "vocab_size": m.vocab_size,
    }

    def fill(d: Path) -> None:
        _mode_of_a_new_dir(d)
        write_model(d, m, meta, fmt)
        refuse_a_used_out()  # again: `write_dir` replaces what is at `out`, and the export took a while

    out.parent.mkdir(parents=True, exist_ok=True)  # with the umask's mode, as `out` (`_mode_of_a_new_dir`)
    durable.write_dir(out, fill)
    return meta


def write_model(d: Path, m: Exported, meta: dict, fmt: str) -> None:
    """Writes the model `m` into the existing directory `d` in `fmt` (`export`), every file fsynced;
    `meta` is what ``dloco.json`` holds (its ``versions`` and ``source`` go into an HF header)."""
    if fmt == "hf":
        hf.write(d, m.cfg, m.params, m.vocab_size, m.tokenizer_file, {k: meta[k] for k in ("versions", "source")})
    elif fmt == "safetensors":
        from safetensors.numpy import save_file

        flat = {n: np.asarray(x, np.float32) for n, x in flatten(m.params).items()}
        save_file(flat, str(d / "model.safetensors"), metadata={"format": "dloco", "versions": str(m.versions)})
    else:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save((d / "orbax").absolute(), m.params)
    if fmt != "hf":
        (d / "config.json").write_text(json.dumps(m.cfg.to_dict(), indent=2))
        if m.tokenizer_file is not None and m.cfg.data.tokenizer != "byte":
            shutil.copy(m.tokenizer_file, d / "tokenizer.json")
        (d / META).write_text(json.dumps(meta, indent=2))
    _fsync_tree(d)


def _mode_of_a_new_dir(d: Path) -> None:
    """Gives `d` the mode ``mkdir`` would under the umask (0755 as a rule): `durable.write_dir`'s
    temporary directory is private (0700, `tempfile.mkdtemp`), and an export is for other users and
    services to read. The umask is read off a directory made for it: `os.umask` can only be read by
    setting it, which would change it under the process's other threads meanwhile."""
    probe = d / "mode"
    probe.mkdir()
    mode = probe.stat().st_mode & 0o777
    probe.rmdir()
    d.chmod(mode)


def _fsync_tree(d: Path) -> None:
    """Makes every file and directory entry under `d` durable before it is renamed into place: a
    rename may reach the disk before the data it names, leaving empty files after a power loss."""
    for p in d.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for sub in [d, *(p for p in d.rglob("*") if p.is_dir())]:
        durable.fsync_dir(sub)


def read_export(path: str | os.PathLike) -> Exported:
    """An export written by `export`; `ModelReadError` naming the file of it that does not read."""
    path = Path(path)
    meta = _json_object(path / META)
    for key, kind in (("format", str), ("versions", list), ("vocab_size", int)):
        if key not in meta:
            raise ModelReadError(f'{path / META}: no "{key}": not as dloco export writes it (damaged?)')
        if not isinstance(meta[key], kind):
            raise ModelReadError(f'{path / META}: "{key}" is {meta[key]!r}, not a {kind.__name__}')
    raw = _json_object(path / "config.json")
    try:
        cfg = config.from_dict(raw)
    except ValueError as e:  # a ConfigError
        raise ModelReadError(f"{path / 'config.json'}: config error: {e}") from None
    if meta["format"] == "safetensors":
        params = unflatten(_read_safetensors(path / "model.safetensors"))
    elif meta["format"] == "orbax":
        import orbax.checkpoint as ocp

        try:
            with ocp.StandardCheckpointer() as ckpt:
                params = ckpt.restore((path / "orbax").absolute())
        except Exception as e:  # orbax and tensorstore fail on a damaged checkpoint in many ways
            raise ModelReadError(
                f"{path / 'orbax'}: not a readable Orbax checkpoint ({type(e).__name__}: {e})"
            ) from None
        params = unflatten({n: np.asarray(x, np.float32) for n, x in flatten(params).items()})
    else:
        raise ModelReadError(f"{path / META}: unknown format {meta['format']!r}")
    tok = path / "tokenizer.json"
    return Exported(
        cfg, params, list(meta["versions"]), str(path), int(meta["vocab_size"]), tok if tok.exists() else None
    )


def _json_object(file: Path) -> dict:
    """The JSON object in `file`; `ModelReadError` naming it if it is not one."""
    try:
        obj = json.loads(file.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ModelReadError(f"{file}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ModelReadError(f"{file}: not a JSON object but a {type(obj).__name__}")
    return obj


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, its header checked against the file first: the file
    starts with the 8-byte little-endian length of a JSON header, which a damaged file can give as
    2**62 (read as is, a request for that much memory), and a truncated copy ends before the byte
    ranges its header gives the tensors. Either, and whatever else the library refuses, is a
    `ModelReadError` naming the file."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    size = file.stat().st_size
    with file.open("rb") as fh:
        if size < 8:
            raise ModelReadError(f"{file}: {size} bytes, not even the 8-byte length of its header: truncated or empty")
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > size - 8:
            raise ModelReadError(
                f"{file}: a header of {n:,} bytes in a file of {size:,} bytes: truncated, or not a safetensors file"
            )
        try:
            header = json.loads(fh.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ModelReadError(f"{file}: its header is not safetensors JSON ({type(e).__name__}: {e})") from None
    if end > size - 8 - n:
        raise ModelReadError(
            f"{file}: truncated: its tensors need {end:,} bytes after the header, it holds {size - 8 - n:,}"
        )
    try:
        return load_file(str(file))
    except SafetensorError as e:
        raise ModelReadError(f"{file}: not a readable safetensors file ({e})") from None


def load(path: str | os.PathLike, snapshot: int | None = None) -> Exported:
    """A model from an export directory or a run directory."""
    path = Path(path)
    if (path / META).is_file():
        if snapshot is not None:
            raise ValueError(f"{path}: an export holds one state; --snapshot applies to a run directory")
        return read_export(path)
    return read_run(path, snapshot)


def initial_params(path: str | os.PathLike, cfg: RunConfig, vocab_size: int, seq_len: int) -> dict[str, Any]:
    """`model.init_from`: the parameters at `path` (``hf:DIR``: an HF checkpoint, `dloco.hf.read`)
    for the model `cfg` builds; a `ValueError` naming the first tensor that differs if they are not
    of that model."""
    if str(path).startswith("hf:"):
        return hf.read(str(path)[3:], cfg, vocab_size, seq_len)
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
