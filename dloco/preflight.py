"""What can be checked about a run before anything is written or Ray starts, and its fingerprint.

`actors.launch.start` runs `check` (no writes: run directory, corpus, data windows, vocabulary,
model and fragment plan, memory, resume rules), connects to Ray, runs `check_resources` (each
learner group and store shard fits on a node) and `check_devices`, then `record` (creates the run
directory, writes config and fingerprint), and only then starts the actors. A failed check raises
`PreflightError`: one line naming the field or file and the fix; nothing is on disk but the corpus cache.

``fingerprint.json``, written by a run's first start, holds what its durable state depends on:
algorithm, fragment plan (names, shapes), parameter count, learner ids, outer-state layout, tokenizer
and vocabulary, data key (`build.corpus`'s cache key, window length, shard count). `--resume`
refuses a config whose fingerprint differs, naming the first difference; budget, metrics cadence,
chaos and timings may change. A resumed run writes ``config-resume-N.json``, never ``config.json``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from dloco import build, data, durable, export, model, outer
from dloco.config import ConfigError, LearnerGroup, RunConfig, from_dict
from dloco.fragments import flatten, partition
from dloco.services import shards

FINGERPRINT_FILE, CONFIG_FILE = "fingerprint.json", "config.json"
FORMAT, _GIB = 1, 1024**3


class PreflightError(ValueError):
    """A run that cannot start as configured: one line naming the field or file, and the fix."""


@dataclass(frozen=True)
class Preflight:
    """A run that passed `check`: where it writes, whether it resumes, its corpus and fingerprint."""

    run_dir: Path
    resume: bool
    corpus: data.Corpus
    fingerprint: dict[str, Any]


def resolve_run_dir(cfg: RunConfig, run_dir: str | os.PathLike | None = None, *, job: bool = False) -> Path:
    """`run_dir`, else ``{cfg.run_dir}/{date-time}`` (``~`` expanded; a relative one under ``~`` in a Ray `job`)."""
    path = Path(run_dir or Path(cfg.run_dir) / time.strftime("%Y%m%d-%H%M%S")).expanduser()
    return Path.home() / path if job and not run_dir and not path.is_absolute() else path


def holds_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a run (a fingerprint, or the store of a run from before them)."""
    return (run_dir / FINGERPRINT_FILE).is_file() or (run_dir / "store").is_dir()


def check(cfg: RunConfig, run_dir: str | os.PathLike, resume: bool = False, *, local: bool = True, progress=None):
    """Checks everything about the run that needs no Ray, writing nothing; raises `PreflightError`. `local`:
    the learners run on this machine, so their memory is checked here; `progress`: as the corpus is prepared."""
    path = Path(run_dir)
    _check_run_dir(path, resume, cfg.syncer.shards)
    check_data(cfg, corpus := _corpus(cfg, progress))
    check_memory(cfg, fp := fingerprint(cfg, corpus), local)
    if cfg.model.init_from and not resume:  # readable, and of this model (ValueError, OSError: one line)
        export.initial_params(cfg.model.init_from, cfg, corpus.vocab_size, cfg.data.seq_len)
    if resume:
        compare(_run_fingerprint(path), fp, path)
    return Preflight(path, resume, corpus, fp)


def record(pf: Preflight, cfg: RunConfig) -> Path:
    """Creates the run directory and writes the config (``config.json``; on resume the next free
    ``config-resume-N.json``) and, unless it is there, ``fingerprint.json``; returns the config's path."""
    pf.run_dir.mkdir(parents=True, exist_ok=True)
    name = CONFIG_FILE
    if pf.resume:
        taken = [p.stem.rpartition("-")[2] for p in pf.run_dir.glob("config-resume-*.json")]
        name = f"config-resume-{1 + max((int(n) for n in taken if n.isdigit()), default=0)}.json"
    _write_json(pf.run_dir / name, cfg.to_dict())
    if not (pf.run_dir / FINGERPRINT_FILE).exists():
        _write_json(pf.run_dir / FINGERPRINT_FILE, pf.fingerprint)
    return pf.run_dir / name


def _write_json(path: Path, value: Any) -> None:
    """Atomically, 0600, through a fresh temporary file (a link planted beside `path` is not followed)."""
    durable.replace_bytes(path, json.dumps(value, indent=2).encode())


# ---- the run directory -------------------------------------------------------------------------
def _check_run_dir(run_dir: Path, resume: bool, n: int = 1) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise PreflightError(f"run dir {run_dir} is a file, not a directory: pass another --run-dir")
    again = "check --run-dir, or drop --resume to start a fresh run"
    if resume and not run_dir.is_dir():
        raise PreflightError(f"run dir {run_dir} holds no run to resume: it does not exist: {again}")
    fp, store = (run_dir / FINGERPRINT_FILE).is_file(), (run_dir / "store").is_dir()
    if resume and not (fp or (store and (run_dir / CONFIG_FILE).is_file())):  # or a run from before fingerprints
        raise PreflightError(
            f"run dir {run_dir} holds no run to resume: no {FINGERPRINT_FILE}, nor {CONFIG_FILE} and store/: {again}"
        )
    if not resume and holds_run(run_dir):
        raise PreflightError(
            f"run dir {run_dir} already holds a run: pass --resume to continue it or another --run-dir"
        )
    _check_writable(run_dir)
    if resume and (problem := shards.layout_problem(run_dir, n)):
        raise PreflightError(problem)
    for s in range(n if resume else 0):
        _check_unlocked(run_dir, shards.store_root(run_dir, s, n))


def _check_writable(run_dir: Path) -> None:
    """Creates and removes a probe file in the nearest existing ancestor of `run_dir` (or in it)."""
    probe_dir = run_dir.absolute()
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise PreflightError(f"run dir {run_dir} cannot be created: {probe_dir} is a file: pass another --run-dir")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dloco-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PreflightError(
            f"run dir {run_dir} is not writable: cannot create a file in {probe_dir} ({e.strerror or e}): "
            "pass a writable --run-dir"
        ) from None


def _check_unlocked(run_dir: Path, root: Path) -> None:
    """A store still running in `run_dir` holds ``LOCK`` in its directory `root` (`RunDirLock.probe`: no writes)."""
    lock = durable.RunDirLock(root)
    holder = lock.probe()
    if holder is not None:
        who = json.dumps(holder) if holder else "unknown"  # the holder's pid and host
        raise PreflightError(
            f"run dir {run_dir} is in use by another store ({who}; {lock.path}): stop that run or use another --run-dir"
        )


# ---- data --------------------------------------------------------------------------------------
def _corpus(cfg: RunConfig, progress=None) -> data.Corpus:
    d = cfg.data
    try:
        return build.corpus(cfg, progress=progress)
    except OSError as e:
        cache = str(Path(d.cache_dir).expanduser().absolute())
        where = str(Path(e.filename).absolute()) if e.filename else ""
        if where and (where.startswith(cache) or cache.startswith(where + os.sep)):
            raise PreflightError(
                f"data.cache_dir={d.cache_dir!r}: cannot write the corpus cache ({e.strerror}: {e.filename}): "
                "choose a writable data.cache_dir"
            ) from None
        raise PreflightError(f"data.source={d.source!r}: {_line(e)}: point data.source at readable files") from None
    except ValueError as e:  # also pyarrow's ArrowInvalid and UnicodeDecodeError
        field = f"data.max_bytes={d.max_bytes}" if "max_bytes" in str(e) else f"data.source={d.source!r}"
        raise PreflightError(f"{field}: {_line(e)}") from None


def _line(e: BaseException) -> str:
    """An exception as one line: ``file: reason`` for an OSError, else its message with spaces collapsed."""
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split()) or type(e).__name__


def _batches(cfg: RunConfig) -> dict[str, int]:
    """Each distinct learner batch size, by the field that sets it."""
    out: dict[str, int] = {}
    for g in cfg.learners.expand():
        name = f"learners.groups[{g.name}].batch_size" if g.batch_size else "inner.batch_size"
        out[name] = g.batch_size or cfg.inner.batch_size
    return out


def check_data(cfg: RunConfig, corpus: data.Corpus) -> None:
    """The windows `dloco.data.TokenStream` and `eval_batches` need, and the model's vocabulary."""
    d, T = cfg.data, cfg.data.seq_len
    train = max(corpus.train_tokens - 1, 0) // T
    per_shard = train // d.shards
    more = "or use more data (data.source, data.max_bytes)"
    if per_shard < 1:
        raise PreflightError(
            f"data.seq_len={T}: the training split ({corpus.train_tokens:,} tokens of data.source={d.source!r}) "
            f"holds {train} windows of data.seq_len+1 tokens, fewer than data.shards={d.shards} (one per learner "
            f"shard): lower data.seq_len or data.shards, {more}"
        )
    for name, batch in _batches(cfg).items():
        if batch > per_shard:
            raise PreflightError(
                f"{name}={batch}: more than the {per_shard} windows of each learner's data shard "
                f"(data.seq_len={T}, data.shards={d.shards}), so every batch would repeat windows: lower it, "
                f"lower data.seq_len or data.shards, {more}"
            )
    val = max(corpus.val_tokens - 1, 0) // T
    if val < d.eval_batch_size:
        raise PreflightError(
            f"data.source={d.source!r}: the validation split ({corpus.val_tokens:,} tokens; documents are split "
            f"by hash, data.val_fraction={d.val_fraction}) holds {val} windows of data.seq_len+1={T + 1} tokens, "
            f"fewer than data.eval_batch_size={d.eval_batch_size}: use a corpus of more documents, or lower "
            "data.eval_batch_size or data.seq_len"
        )
    v = cfg.model.vocab_size
    if v and v < corpus.vocab_size:
        raise PreflightError(
            f"model.vocab_size={v}: below the {corpus.tokenizer} tokenizer's vocabulary of {corpus.vocab_size} "
            f"(data.source={d.source!r}; a larger id embeds as NaN and every loss would be NaN): set it to 0 "
            f"(the tokenizer's) or >= {corpus.vocab_size}"
        )


def check_devices(cfg: RunConfig) -> None:
    """The driver splits each evaluation batch across its devices. Called once Ray runs: counting the
    devices starts JAX's threads, which must not exist yet when Ray forks its processes."""
    if cfg.data.eval_batch_size % (n := jax.device_count()):
        raise PreflightError(
            f"data.eval_batch_size={cfg.data.eval_batch_size}: the driver evaluates on its {n} devices, one "
            f"slice each: use a multiple of {n}"
        )


# ---- the fingerprint ---------------------------------------------------------------------------
def fingerprint(cfg: RunConfig, corpus: data.Corpus) -> dict[str, Any]:
    """What the run's durable state depends on (module docstring), as plain JSON values.

    Shapes come from `jax.eval_shape`: no parameter is computed, whatever the model's size.
    """
    vocab = cfg.model.vocab_size or corpus.vocab_size
    params = jax.eval_shape(functools.partial(model.init_params, model.build(cfg.model, vocab), 0, 1))
    try:
        plan = partition(params, cfg.fragments.count)
    except ValueError as e:
        raise PreflightError(f"{e} (model.n_layers={cfg.model.n_layers}): lower fragments.count") from None
    flat = flatten(params)
    tx = outer.outer_optimizer(outer.outer_config(cfg))
    states = [jax.eval_shape(tx.init, {n: flat[n] for n in f.names}) for f in plan.fragments]
    fp = {
        "format": FORMAT,
        "algorithm": cfg.algorithm,
        "fragments": plan.count,
        "learners": list(range(cfg.learners.count)),
        "tokenizer": {"kind": corpus.tokenizer, "vocab_size": corpus.vocab_size},
        "vocab_size": vocab,
        "parameters": sum(f.size for f in plan.fragments),
        "plan": [[[n, list(s)] for n, s in zip(f.names, f.shapes, strict=True)] for f in plan.fragments],
        "outer_state": [len(jax.tree_util.tree_leaves(s)) for s in states],
        "data": {"key": corpus.key, "seq_len": cfg.data.seq_len, "shards": cfg.data.shards},
    }
    return json.loads(json.dumps(fp))  # tuples → lists: equal to what fingerprint.json reads back


# key → (what differs, the config fields that set it), in the order they are compared
_FIELDS: dict[str, tuple[str, str]] = {
    "format": ("fingerprint formats", "the dloco version that wrote it"),
    "algorithm": ("algorithms", "algorithm"),
    "fragments": ("fragments", "fragments.count"),
    "learners": ("learners", "learners.count"),
    "tokenizer": ("tokenizers", "data.tokenizer, data.vocab_size"),
    "vocab_size": ("vocabularies", "model.vocab_size"),
    "parameters": ("parameter counts", "model"),
    "plan": ("fragment plans", "model, fragments.count"),
    "outer_state": ("outer optimizer states", "outer.momentum, outer.delay, outer.nesterov"),
    "data": ("data", "data"),
}


def compare(run: Mapping[str, Any], now: Mapping[str, Any], run_dir: Path | None = None) -> None:
    """Raises `PreflightError` naming the first difference between a run's fingerprint and the config's."""
    own = f" (--config {run_dir / CONFIG_FILE})" if run_dir is not None else ""
    fix = f"resume with the run's own config{own} or start a fresh run in another --run-dir"
    for key, (label, fields) in _FIELDS.items():
        a, b = run.get(key), now.get(key)
        if a == b:
            continue
        if key == "learners":
            a, b = len(a or []), len(b or [])
        elif key == "plan":
            a, b = _plan_difference(a or [], b or [])
        elif key == "data" and isinstance(a, Mapping) and isinstance(b, Mapping):
            sub = next(k for k in sorted({*a, *b}) if a.get(k) != b.get(k))
            fields = f"data.{sub}" if sub != "key" else "data.source, data.max_bytes, data.val_fraction or the files"
            a, b = a.get(sub), b.get(sub)
        raise PreflightError(f"resume: {label} differ ({fields}): run has {a}, config has {b}: {fix}")


def _plan_difference(a: list, b: list) -> tuple[str, str]:
    """The first tensor whose fragment or shape differs, as each plan has it."""
    where = [{n: f"{n} {s} in fragment {p}" for p, f in enumerate(x) for n, s in f} for x in (a, b)]
    n = next(n for n in [*where[0], *where[1]] if where[0].get(n) != where[1].get(n))
    return where[0].get(n, f"no tensor {n}"), where[1].get(n, f"no tensor {n}")


def _run_fingerprint(run_dir: Path) -> Mapping[str, Any]:
    """The stored fingerprint; for a run from before fingerprints, the one of its ``config.json``."""
    path = run_dir / FINGERPRINT_FILE
    try:
        if path.is_file():
            fp = json.loads(path.read_text())
            if not isinstance(fp, dict):
                raise ValueError("not a JSON object")
            return fp
        path = run_dir / CONFIG_FILE
        old = from_dict(json.loads(path.read_text()))
    except (OSError, ValueError) as e:  # ConfigError and JSONDecodeError are ValueErrors
        kind = "config error: " if isinstance(e, ConfigError) else ""
        raise PreflightError(f"cannot resume from {path}: {kind}{_line(e)}: repair or remove it") from None
    return fingerprint(old, _corpus(old))


# ---- memory ------------------------------------------------------------------------------------
def physical_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit if lower (0: unknown)."""
    total = 0
    with contextlib.suppress(OSError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        total = min(total, int(Path("/sys/fs/cgroup/memory.max").read_text()))  # "max": no limit, ValueError
    return total


def _step_bytes(cfg: RunConfig, fp: Mapping[str, Any], batch: int, copies: int) -> int:
    """A lower bound on a step's memory: `copies` of the parameters, and one layer's attention scores
    [batch, heads, T, T] or the logits [batch, T, vocab], the larger (all float32)."""
    T = cfg.data.seq_len
    scores, logits = batch * cfg.model.n_heads * T * T * 4, batch * T * fp["vocab_size"] * 4
    return copies * fp["parameters"] * 4 + max(scores, logits)


def check_memory(cfg: RunConfig, fp: Mapping[str, Any], local: bool) -> None:
    """The driver evaluates here; with `local`, the CPU learners of the local cluster train here too."""
    have, T, B = physical_memory(), cfg.data.seq_len, cfg.data.eval_batch_size
    driver = _step_bytes(cfg, fp, B, 2)  # the blueprint's initial fragments and the evaluated model
    cpu = [g for g in cfg.learners.expand() if local and g.num_gpus == 0 and "TPU" not in g.resources]
    # parameters, gradients and AdamW's two moments per learner, beside the driver
    learners = sum(_step_bytes(cfg, fp, g.batch_size or cfg.inner.batch_size, 4) for g in cpu)
    if have and driver + learners > have:
        alone = driver > have
        fields = f"data.eval_batch_size={B}" if alone else ", ".join(f"{k}={v}" for k, v in _batches(cfg).items())
        who = "the driver's evaluation needs" if alone else f"the driver and the {len(cpu)} local learners need"
        gib = (driver if alone else driver + learners) / _GIB
        raise PreflightError(
            f"{fields}, data.seq_len={T}: {who} at least {gib:.1f} GiB (parameters, "
            f"optimizer state, one layer's attention scores or the logits), this machine has {have / _GIB:.1f} GiB: "
            "lower the batch size or data.seq_len, or use a smaller model or fewer learners"
        )


# ---- Ray's resources (checked right after connecting) --------------------------------------------
def _needs(g: LearnerGroup) -> dict[str, float]:
    need = {"CPU": g.num_cpus, "GPU": g.num_gpus, **{k: float(v) for k, v in g.resources.items()}}
    return {k: v for k, v in need.items() if v > 0}


def _field(cfg: RunConfig, g: LearnerGroup, resource: str) -> str:
    pre = f"learners.groups[{g.name}]" if cfg.learners.groups else "learners"
    return {"CPU": f"{pre}.num_cpus", "GPU": f"{pre}.num_gpus"}.get(resource, f"{pre}.resources.{resource}")


def check_resources(cfg: RunConfig, nodes: Sequence[Mapping[str, Any]]) -> None:
    """Raises `PreflightError` unless every learner group and store shard fits on some live node and all
    learners fit in the cluster's totals (else they wait forever); `nodes` is ``ray.nodes()``."""
    alive = [dict(n.get("Resources") or {}) for n in nodes if n.get("Alive", True)]
    if not alive:
        raise PreflightError("the Ray cluster has no live node: check the cluster with `ray status`")
    lost = [(s, k) for s, k in enumerate(cfg.syncer.shard_resources) if not any(r.get(k, 0) >= 1e-3 for r in alive)]
    if lost:
        where = f"syncer.shard_resources[{lost[0][0]}]={lost[0][1]!r}: no node of the Ray cluster has it"
        raise PreflightError(f"{where}, so that store shard would wait forever: name a resource some node has")
    wanted, checked = dict[str, float](), set[str]()
    for g in cfg.learners.expand():
        need = _needs(g)
        for k, v in need.items():
            wanted[k] = wanted.get(k, 0.0) + v
        if g.name in checked or any(all(r.get(k, 0.0) >= v for k, v in need.items()) for r in alive):
            checked.add(g.name)
            continue
        most = {k: max((r.get(k, 0.0) for r in alive), default=0.0) for k in need}
        k = next((k for k, v in need.items() if most[k] < v), "")
        if k:
            lacks = f"{_field(cfg, g, k)}={need[k]:g}: no node of the Ray cluster has {need[k]:g} {k}"
            lacks += f" (the most any node has: {most[k]:g})"
        else:
            pre = f"learners.groups[{g.name}]" if cfg.learners.groups else "learners"
            lacks = f"{pre}: no node of the Ray cluster has all of {need} at once"
        raise PreflightError(f"{lacks}, so its learners would wait forever: lower it, or add a node that has it")
    for k, v in wanted.items():
        have = sum(r.get(k, 0.0) for r in alive)
        if v > have + 1e-9:
            raise PreflightError(
                f"learners.count={cfg.learners.count}: the learners need {v:g} {k} in all, the Ray cluster has "
                f"{have:g}, so some would wait forever: lower learners.count or each learner's {k}, or add nodes"
            )
