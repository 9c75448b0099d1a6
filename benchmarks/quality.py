"""Quality at equal tokens in the compute-optimal regime: a fair sweep, 3-seed finals, ablations.

Every row is one deterministic in-process run (`dloco.sim.run_local`: the same learner, syncer
and store services the Ray actors wrap, on a virtual clock), so rows differ only in what the row
changes, and each is reproducible bit for bit.

**Regime.** The `mini` preset's model (d64, 2 layers) on the whole corpus, `BATCH` sequences of
64 tokens per learner step. Every learner takes S steps: the larger of what makes M = 4 learners
train `TOKENS_PER_PARAM` (20) tokens per parameter in total (the compute-optimal budget of the
DiLoCo comparisons) and `MIN_PERIODS` (80) sync periods per fragment at H = 24. The DP reference
is one learner with an M× batch for the same S steps (exactly what synchronous data parallel
computes, up to float summation order), so every comparison is at equal tokens; M = 8 and 16 rows
train 2× and 4× as many tokens as M = 4. The inner schedule (warmup 10 %, cosine) spans S in
every row.

**Phases.** `sweep` (corpus stdlib, M = 4, seed 0): four grid points per algorithm (`DP_LRS`,
`GRID` × `INNER_LRS`, see below), plus the outer-optimizer study under K = 1 (Delayed and
per-commit Nesterov at four (η, μ) each; `grid` false: it takes no part in the tuning). Then, from
the best grid point of each: `final` (seeds 1, 2; the table pools them with the sweep's seed 0),
`m8` (the decisive rows at M = 8), `m1` (DiLoCo with one learner against plain training at equal
tokens, dp's tuned lr as the inner lr of both), `merge` (RDA vs mean at M = 4, 8, 16),
`compression` (bf16, int2; int4 is the default), `receive` (overwrite, blend; rebase is the
default), `quorum` (stragglers: K = M, K = 1 without and with grace), `scale` (dp, diloco and
decoupled on the `tiny` preset, 0.43 M parameters, in the same regime) and `shakespeare` (the
final table on a second corpus: Shakespeare, BPE tokens). One invocation runs the sweep rows it
selects first and then the rows that depend on them; `--missing` runs only rows the JSON lacks.

Learner speeds: learner m's step takes 1 + 0.2·m/(M−1) virtual seconds (a mildly heterogeneous
fleet), a commit reaches the learners 0.5 s after it closes; the quorum rows instead slow half
the learners by 20 % and add per-step jitter U(1, 1.3).

**Ray Tune.** Each phase is one Tune experiment: `param_space` is the phase's rows as one grid
(``tune.grid_search`` over the row dicts), the trainable (`trial`) runs one row in its own worker
process and reports what it measured (``tune.report``: the eval loss, tokens, bytes, ...), and a
trial takes `--cpus-per-trial` CPUs, so the same sweep spreads over a cluster's nodes with
`--address`. Without it a local Ray cluster of `--workers` × `--cpus-per-trial` CPUs is started
(127.0.0.1 only, no dashboard: `actors.launch.connect`). The rows are deterministic, so a row
reads the same number through Tune as run on its own (`run_row`; tests/test_benchmarks_run.py).

Usage:  python benchmarks/quality.py [--workers 2] [--cpus-per-trial 1] [--address ADDR] [--storage PATH]
                                    [--only PHASE[/LABEL-PREFIX],...] [--seeds 0,...]
                                    [--missing] [--tiny] [--out benchmarks/results/quality.json]
Writes  the JSON (every row with its overrides and config hash; a rerun replaces the rows it ran
        and keeps the others) and a PNG beside it. `benchmarks/report.py` turns it into docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dloco import config  # noqa: E402

TOKENS_PER_PARAM = 20  # the floor of the regime
M_REF = 4  # the M whose total tokens meet TOKENS_PER_PARAM
BATCH = 8  # sequences per learner step (512 tokens)
MIN_PERIODS = 80  # sync periods per fragment at the default H
MODEL = (
    "preset=mini",
    "data.max_bytes=0",
    f"inner.batch_size={BATCH}",
    "data.eval_batches=32",
    "data.eval_batch_size=16",
)
# `--tiny`: the 21k-parameter `micro` preset, 16 steps, a few rows (for the test suite)
TINY_MODEL = ("preset=micro", "sync.every=8", "fragments.count=2", "sync.overlap=1")
TINY_STEPS = 16
CORPORA = {
    "stdlib": ("data.source=stdlib", "data.tokenizer=byte"),
    "shakespeare": ("data.source=shakespeare", "data.tokenizer=bpe", "data.vocab_size=512"),
}
# Tuning grids, four points per algorithm: dp's inner lr; for diloco and streaming the outer (η, μ)
# × the learners' inner lr; for decoupled plain averaging and Delayed Nesterov (η 0.5, μ 0.5) × the
# inner lr. The outer-optimizer study (grid False) adds Delayed and per-commit Nesterov at four
# (η, μ) each, at the default inner lr.
DP_LRS = (3e-3, 6e-3, 9e-3, 1.2e-2)
INNER_LRS = (3e-3, 6e-3)  # the first was the preset's when the sweep ran (its labels carry no lr); 6e-3 is now
GRID = ((0.5, 0.5), (0.7, 0.9))
OUTER_STUDY = ((0.5, 0.5), (1.0, 0.5), (0.5, 0.9), (0.7, 0.9))
TINY_GRID, TINY_DP_LRS, TINY_INNER_LRS = ((0.7, 0.9),), (3e-3, 6e-3), (3e-3,)
STRAGGLERS = ("chaos.stragglers=2", "chaos.straggler_factor=1.2", "chaos.jitter=0.3")
FAMILIES = ("dp", "diloco", "streaming", "decoupled/delayed", "decoupled/per-commit", "decoupled/plain")
# the issue's own scale point: the `tiny` preset (0.43 M parameters, sequences of 128 tokens)
SCALE_MODEL = (
    "preset=tiny",
    "data.max_bytes=0",
    "inner.batch_size=8",
    "data.eval_batches=16",
    "data.eval_batch_size=16",
)


# the sweep's decoupled rows and the rows built on them ran before `sync.dynamic` (DyLU) existed:
# with it off, as this pins now that it is on by default
STATIC = ("sync.dynamic=false",)
# every decoupled row ran with merged fragments published in full, the default until the ladder's
# delta rung showed no measurable cost; this pins it now that delta is the default
FULL = ("compression.publish=full",)


def outer_ov(lr: float, mu: float, delay: int = 0) -> tuple[str, ...]:
    return (f"outer.lr={lr}", f"outer.momentum={mu}", f"outer.delay={delay}")


def sweep_rows(tiny: bool) -> list[dict]:
    grid, lrs, inner = (TINY_GRID, TINY_DP_LRS, TINY_INNER_LRS) if tiny else (GRID, DP_LRS, INNER_LRS)
    r = []

    def add(family, label, ov, algorithm, grid=True):
        ov = ov + STATIC + FULL if algorithm == "decoupled" else ov
        r.append(row("sweep", label, "stdlib", 4, algorithm, ov, 0, family=family, grid=grid))

    def lr_ov(lr):
        return (f"inner.lr={lr}",), "" if lr == inner[0] else f", inner lr {lr:g}"

    for lr in lrs:
        add("dp", f"dp, lr {lr:g}", (f"inner.lr={lr}",), "dp")
    for alg in ("diloco", "streaming"):
        for (eta, mu), lr in ((g, lr) for g in grid for lr in inner):
            ov, tag = lr_ov(lr)
            add(alg, f"{alg}, η {eta:g} μ {mu:g}{tag}", outer_ov(eta, mu) + ov, alg)
    for lr in inner:
        ov, tag = lr_ov(lr)
        add("decoupled/plain", f"decoupled/plain, η 1 μ 0{tag}", outer_ov(1.0, 0.0) + ov, "decoupled")
        add("decoupled/delayed", f"decoupled/delayed, η 0.5 μ 0.5{tag}", outer_ov(0.5, 0.5) + ov, "decoupled")
    if tiny:
        return r
    study_lr = lr_ov(inner[0])[0]
    for eta, mu in OUTER_STUDY:
        if (eta, mu) != (0.5, 0.5):
            ov = outer_ov(eta, mu) + study_lr
            add("decoupled/delayed", f"decoupled/delayed, η {eta:g} μ {mu:g}", ov, "decoupled", False)
        ov = outer_ov(eta, mu, 1) + study_lr
        add("decoupled/per-commit", f"decoupled/per-commit, η {eta:g} μ {mu:g}", ov, "decoupled", False)
    return r


def row(group, label, corpus, M, algorithm, overrides, seed, **extra) -> dict:
    return {
        "group": group,
        "label": label,
        "corpus": corpus,
        "M": M,
        "algorithm": algorithm,
        "overrides": list(overrides),
        "seed": seed,
    } | extra


def best(results: list[dict], family: str, grid_only: bool = True) -> dict | None:
    """The sweep row of `family` with the lowest eval loss (None until the sweep has run it)."""
    cands = [r for r in results if r["group"] == "sweep" and r.get("family") == family and (r["grid"] or not grid_only)]
    return min(cands, key=lambda r: r["eval_loss"]) if cands else None


def tuned(results: list[dict]) -> dict[str, dict] | None:
    """Per algorithm the best grid point: dp, diloco, streaming, decoupled (the better of plain
    averaging and Delayed Nesterov), and decoupled/plain; None while a family is missing."""
    b = {f: best(results, f) for f in ("dp", "diloco", "streaming", "decoupled/delayed", "decoupled/plain")}
    if any(v is None for v in b.values()):
        return None
    dec = min(b["decoupled/delayed"], b["decoupled/plain"], key=lambda r: r["eval_loss"])
    return {k: b[k] for k in ("dp", "diloco", "streaming")} | {"decoupled": dec, "plain": b["decoupled/plain"]}


def dependent_rows(results: list[dict], tiny: bool) -> list[dict]:
    """The rows built on the sweep's winners (empty until the sweep is complete)."""
    t = tuned(results)
    if t is None:
        return []
    r = []
    ov = {k: tuple(v["overrides"]) for k, v in t.items()}
    seeds = (1,) if tiny else (1, 2)
    finals = ("dp", "diloco", "streaming", "decoupled") + (() if t["decoupled"] is t["plain"] else ("plain",))
    for k in finals:
        alg = t[k]["algorithm"]
        for s in seeds:
            r.append(row("final", f"{k} (tuned)", "stdlib", 4, alg, ov[k], s))
    dp_lr = ov["dp"]
    # DiLoCo with one learner (its batch = dp's) against plain training: dp's tuned lr for both
    for s in (0,) if tiny else (0, 1, 2):
        r.append(row("m1", "diloco M=1 (tuned outer)", "stdlib", 1, "diloco", ov["diloco"] + dp_lr, s))
    r.append(row("compression", "int2", "stdlib", 4, "decoupled", ov["decoupled"] + ("compression.dtype=int2",), 0))
    if tiny:
        return r
    for k in ("dp", "diloco", "decoupled"):
        r.append(row("m8", f"{k} (tuned)", "stdlib", 8, t[k]["algorithm"], ov[k], 0))
    r.append(row("compression", "bf16", "stdlib", 4, "decoupled", ov["decoupled"] + ("compression.dtype=bf16",), 0))
    for M in (4, 8, 16):
        r.append(row("merge", "mean", "stdlib", M, "decoupled", ov["decoupled"] + ("merge.rule=mean",), 0))
    r.append(row("merge", "rda", "stdlib", 16, "decoupled", ov["decoupled"], 0))
    for mode in ("overwrite", "blend"):  # rebase is the default
        r.append(row("receive", mode, "stdlib", 4, "decoupled", ov["decoupled"] + (f"learner.receive={mode}",), 0))
    q = ov["decoupled"] + STRAGGLERS
    r.append(row("quorum", "K=M", "stdlib", 4, "decoupled", q + ("syncer.quorum=4", "syncer.grace_factor=0"), 0))
    r.append(row("quorum", "K=1, no grace", "stdlib", 4, "decoupled", q + ("syncer.grace_factor=0",), 0))
    r.append(row("quorum", "K=1 + grace", "stdlib", 4, "decoupled", q, 0))
    for k in ("dp", "diloco", "decoupled"):
        r.append(row("scale", f"{k} (tuned)", "stdlib", 4, t[k]["algorithm"], ov[k], 0, model="tiny"))
    for s in (0, 1, 2):
        for k in ("dp", "diloco", "decoupled"):
            r.append(row("shakespeare", f"{k} (tuned)", "shakespeare", 4, t[k]["algorithm"], ov[k], s))
        r.append(row("shakespeare", "diloco M=1 (tuned outer)", "shakespeare", 1, "diloco", ov["diloco"] + dp_lr, s))
    return r


# The ablation ladder (`ladder`): from tuned synchronous DiLoCo to the decoupled default, one
# change per rung, every rung at LADDER_SEEDS (the ends at FINAL_SEEDS). All DiLoCo-family rungs
# use the inner lr `LADDER_LR` (the sweep's best for every family). `speeds: equal` rows give
# every learner the same step time; the others the bench's fleet (1.0 to 1.2 s per step).
LADDER_SEEDS = (0, 1, 2)
FINAL_SEEDS = (0, 1, 2, 3, 4)
LADDER_LR = ("inner.lr=0.006",)
PLAIN = outer_ov(1.0, 0.0)
LADDER = (
    # (label, algorithm, overrides, speeds, seeds)
    ("dp, lr 0.006 (tuned data-parallel)", "dp", ("inner.lr=0.006",), "fleet", FINAL_SEEDS),
    ("diloco, η 0.5 μ 0.5 (tuned sync DiLoCo)", "diloco", outer_ov(0.5, 0.5) + LADDER_LR, "fleet", FINAL_SEEDS),
    ("diloco, plain averaging (η 1 μ 0)", "diloco", PLAIN + LADDER_LR, "fleet", LADDER_SEEDS),
    ("streaming: P = 4 fragments, τ = 2", "streaming", PLAIN + LADDER_LR, "fleet", LADDER_SEEDS),
    (
        "decoupled P = 1, K = 1 + grace, equal speeds",
        "decoupled",
        PLAIN + LADDER_LR + STATIC + FULL + ("fragments.count=1",),
        "equal",
        LADDER_SEEDS,
    ),
    (
        "decoupled P = 1, K = 1 + grace, fleet speeds",
        "decoupled",
        PLAIN + LADDER_LR + STATIC + FULL + ("fragments.count=1",),
        "fleet",
        LADDER_SEEDS,
    ),
    (
        "decoupled P = 4, K = M, fleet speeds",
        "decoupled",
        PLAIN + LADDER_LR + STATIC + FULL + ("syncer.quorum=4",),
        "fleet",
        LADDER_SEEDS,
    ),
    (
        "decoupled P = 4, K = 1 + grace, equal speeds",
        "decoupled",
        PLAIN + LADDER_LR + STATIC + FULL,
        "equal",
        LADDER_SEEDS,
    ),
    (
        "decoupled P = 4, K = 1 + grace, fleet speeds (old default)",
        "decoupled",
        PLAIN + LADDER_LR + STATIC + FULL,
        "fleet",
        LADDER_SEEDS,
    ),
    (
        "decoupled P = 1 + DyLU, fleet speeds",
        "decoupled",
        PLAIN + LADDER_LR + FULL + ("fragments.count=1", "sync.dynamic=true"),
        "fleet",
        LADDER_SEEDS,
    ),
    (
        "decoupled + DyLU, fleet speeds",
        "decoupled",
        PLAIN + LADDER_LR + FULL + ("sync.dynamic=true",),
        "fleet",
        FINAL_SEEDS,
    ),
    (
        "decoupled + DyLU + Delayed Nesterov η 0.5 μ 0.5",
        "decoupled",
        outer_ov(0.5, 0.5) + LADDER_LR + FULL + ("sync.dynamic=true",),
        "fleet",
        LADDER_SEEDS,
    ),
    (
        "decoupled + DyLU, publish: delta (default)",
        "decoupled",
        PLAIN + LADDER_LR + ("sync.dynamic=true", "compression.publish=delta"),
        "fleet",
        FINAL_SEEDS,
    ),
)

# the rung the claims compare (5 seeds, as the rows at M = 8, on Shakespeare and at the scale
# point ran: merged fragments published in full); the default publishes deltas, its own rung
DYLU_RUNG = "decoupled + DyLU, fleet speeds"
DEFAULT_RUNG = "decoupled + DyLU, publish: delta (default)"
# (inner lr, seeds): at seed 0 synchronous DiLoCo read 1.95 % better at 9e-3 than at 6e-3, more than
# the seed spread, so 9e-3 runs the ladder's seeds for both ends
EDGE_LRS = ((9e-3, LADDER_SEEDS), (1.2e-2, (0,)))


def ladder_rows(tiny: bool) -> list[dict]:
    """The ladder's rows (none in `--tiny`: the suite runs the sweep's)."""
    if tiny:
        return []
    out = [
        row("ladder", label, "stdlib", 4, alg, ov, s, speeds=speeds)
        for label, alg, ov, speeds, seeds in LADDER
        for s in seeds
    ]
    # the new default where the old one was measured: M = 8, the second corpus, the scale point
    dylu = PLAIN + LADDER_LR + FULL + ("sync.dynamic=true",)
    out.append(row("dylu", "decoupled + DyLU", "stdlib", 8, "decoupled", dylu, 0, speeds="fleet"))
    for s in LADDER_SEEDS:
        out.append(row("dylu", "decoupled + DyLU", "shakespeare", 4, "decoupled", dylu, s, speeds="fleet"))
    out.append(row("dylu", "decoupled + DyLU", "stdlib", 4, "decoupled", dylu, 0, speeds="fleet", model="tiny"))
    # past the sweep's top inner lr, where every DiLoCo-family winner sat: the two ends of the ladder
    for lr, seeds in EDGE_LRS:
        ov = (f"inner.lr={lr}",)
        for s in seeds:
            out.append(
                row("edge", f"diloco, η 0.5 μ 0.5, inner lr {lr:g}", "stdlib", 4, "diloco", outer_ov(0.5, 0.5) + ov, s)
            )
            dylu_lr = PLAIN + ov + FULL + ("sync.dynamic=true",)
            out.append(row("edge", f"decoupled + DyLU, inner lr {lr:g}", "stdlib", 4, "decoupled", dylu_lr, s))
    return out


def setting(r: dict) -> tuple:
    """What a row trains, without its seed: rows of one setting pool across groups. Blocking
    algorithms compute the same whatever the learners' speeds, so their rows pool across speeds."""
    speeds = "fleet" if r["algorithm"] in config.BLOCKING_ALGORITHMS else r.get("speeds", "fleet")
    return (r["corpus"], r.get("model", "mini"), r["algorithm"], r["M"], tuple(sorted(r["overrides"])), speeds)


def key(r: dict) -> tuple:
    return (r["group"], r["label"], r["corpus"], r["M"], r["seed"])


def base_overrides(r: dict, tiny: bool) -> tuple[str, ...]:
    """The model and corpus of a row."""
    model = TINY_MODEL if tiny else SCALE_MODEL if r.get("model") == "tiny" else MODEL
    return (*model, *CORPORA[r["corpus"]])


def row_config(r: dict, steps: int, tiny: bool) -> config.RunConfig:
    M = r["M"]
    base = base_overrides(r, tiny)
    if r["algorithm"] in config.DP_ALGORITHMS:  # dp implies H = P = 1, τ = 0
        base = tuple(o for o in base if not o.startswith(("sync.", "fragments.")))
    if r["algorithm"] == "diloco":  # diloco: one fragment
        base = tuple(o for o in base if not o.startswith("fragments."))
    batch = config.load(overrides=base).inner.batch_size
    ov = [
        *base,
        f"algorithm={r['algorithm']}",
        f"seed={r['seed']}",
        f"chaos.seed={r['seed']}",
        f"inner.total_steps={steps}",
        f"inner.warmup_steps={max(1, steps // 10)}",
        "budget.tokens=0",
        f"budget.steps={steps}",
    ]
    # the same training windows for every algorithm: a single learner (dp, or DiLoCo M=1) reads
    # them all with an M_REF× / M× batch; M learners read M disjoint shards of them
    if r["algorithm"] in config.DP_ALGORITHMS:
        ov += ["learners.count=1", f"inner.batch_size={batch * M}", "data.shards=1"]
    elif M == 1:
        ov += ["learners.count=1", f"inner.batch_size={batch * M_REF}", "data.shards=1"]
    else:
        ov += [f"learners.count={M}", f"data.shards={M}"]
    return config.load(overrides=[*ov, *r["overrides"]])


def steps_for(r: dict, tiny: bool) -> tuple[int, int]:
    """(S, parameters): S steps per learner, the larger of what makes M_REF learners (at the model's
    batch) train TOKENS_PER_PARAM tokens per parameter and MIN_PERIODS sync periods of its H."""
    from dloco import build

    cfg = row_config(r, 100, tiny)
    params = sum(f.size for f in build.blueprint(cfg).plan.fragments)
    if tiny:
        return TINY_STEPS, params
    base = config.load(overrides=base_overrides(r, tiny))
    per_step = M_REF * base.inner.batch_size * base.data.seq_len
    H = base.sync.every
    return max(math.ceil(TOKENS_PER_PARAM * params / per_step / H), MIN_PERIODS) * H, params


def config_hash(cfg: config.RunConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def run_row(args: tuple[dict, bool]) -> dict:
    from dloco.sim import run_local

    r, tiny = args
    steps, params = steps_for(r, tiny)
    cfg = row_config(r, steps, tiny)
    M = cfg.learners.count
    times = [1.0 + 0.2 * m / (M - 1) for m in range(M)] if M > 1 else [1.0]
    if r.get("speeds") == "equal" or any(o.startswith("chaos.stragglers") for o in r["overrides"]):
        times = [1.0] * M
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        run = run_local(cfg, d, steps=steps, step_times=times, sync_time=0.5)
        loss = run.evaluate()
    merges = [e for e in run.events if e["event"] == "merge"]
    tokens = sum(c.step_count * c.tokens_per_step for c in run.learners)
    P = run.blueprint.plan.count
    return {
        **r,
        "steps": steps,
        "params": params,
        "tokens": tokens,
        "tokens_per_param": tokens / params,
        "periods": steps // cfg.sync.every,  # sync periods per fragment (one push per learner each)
        "commits_per_fragment": len(merges) / P,
        "config_hash": config_hash(cfg),
        "eval_loss": loss,
        "rejections": sum(e["event"] == "rejection" for e in run.events),
        "bytes_up": sum(e["bytes_in"] for e in merges),
        "bytes_down_per_learner": sum(run.bytes_down) / M,
        "virtual_s": run.now,
        "wall_s": time.perf_counter() - t0,
    }


# what `run_row` measures, beside the row itself: what a trial reports
MEASURED = (
    "steps",
    "params",
    "tokens",
    "tokens_per_param",
    "periods",
    "commits_per_fragment",
    "config_hash",
    "eval_loss",
    "rejections",
    "bytes_up",
    "bytes_down_per_learner",
    "virtual_s",
    "wall_s",
)


def trial(params: dict) -> None:
    """One row as a Tune trial (`params`: ``{"row": ..., "tiny": ..., "jax_platforms": ...}``, a point
    of the phase's grid): runs it and reports what it measured (`MEASURED`: the row itself is the
    trial's config)."""
    from ray import tune

    # the driver's platform (cpu unless JAX_PLATFORMS said otherwise): a cluster's worker has not its environment
    os.environ["JAX_PLATFORMS"] = params["jax_platforms"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    res = run_row((params["row"], params["tiny"]))
    tune.report({k: res[k] for k in MEASURED})


def run_trials(
    rows: list[dict], tiny: bool, cpus_per_trial: float, workers: int, storage: str, done: Callable[[dict], None]
) -> None:
    """Runs `rows` as the trials of one Tune experiment, at most `workers` at once (0: as many as
    the cluster's CPUs allow), `cpus_per_trial` CPUs each; calls `done` with each finished row (the
    row and what its trial reported) as it comes. Raises if a trial failed, once the others ended."""
    from ray import cloudpickle, tune

    if __name__ != "__main__":  # imported (a test, a notebook): the trainable travels by value, as a script's does
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    failed: list[str] = []

    class Rows(tune.Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):  # each trial reports once
            done({**trial.config["row"], **{k: result[k] for k in MEASURED}})

        def on_trial_error(self, iteration, trials, trial, **info):
            failed.append(trial.config["row"]["label"])

    tuner = tune.Tuner(
        tune.with_resources(trial, {"cpu": cpus_per_trial}),
        param_space={"row": tune.grid_search(rows), "tiny": tiny, "jax_platforms": os.environ["JAX_PLATFORMS"]},
        tune_config=tune.TuneConfig(
            max_concurrent_trials=workers or None,
            reuse_actors=True,  # a row's process runs the next row, as a pool's worker did: JAX, numba, the corpus warm
            trial_name_creator=lambda t: t.trial_id,  # not the row's config: labels hold commas and Greek
            trial_dirname_creator=lambda t: t.trial_id,
        ),
        run_config=tune.RunConfig(name="quality", storage_path=storage, callbacks=[Rows()], verbose=0),
    )
    grid = tuner.fit()
    if grid.errors:
        raise RuntimeError(f"{len(grid.errors)} row(s) failed ({'; '.join(failed)}): {grid.errors[0]}")


def summarize(results: list[dict]) -> list[dict]:
    """One entry per setting (rows pooled across groups and seeds): mean, spread (max − min)."""
    out: dict[tuple, dict] = {}
    for r in results:
        s = out.setdefault(setting(r), {"setting": list(setting(r)), "losses": [], "seeds": [], "hashes": []})
        if r["seed"] not in s["seeds"]:
            s["losses"].append(r["eval_loss"])
            s["seeds"].append(r["seed"])
            s["hashes"].append(r["config_hash"])
    for s in out.values():
        s["mean"] = statistics.fmean(s["losses"])
        s["spread"] = max(s["losses"]) - min(s["losses"])
    return list(out.values())


def plot(results: list[dict], path: Path) -> None:
    """The sweep: eval loss per grid point, one panel per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = [f for f in FAMILIES if any(r.get("family") == f for r in results)]
    if not fams:
        return
    fig, axes = plt.subplots(1, len(fams), figsize=(2.6 * len(fams), 3.4), squeeze=False, sharey=True)
    for ax, f in zip(axes[0], fams, strict=True):
        items = [r for r in results if r.get("family") == f]
        ax.bar(range(len(items)), [r["eval_loss"] for r in items], color="C0")
        ax.set_xticks(range(len(items)), [r["label"].split(", ", 1)[1] for r in items], rotation=60, fontsize=7)
        ax.set_title(f, fontsize=9)
    lo = min(r["eval_loss"] for r in results if r.get("family"))
    hi = max(r["eval_loss"] for r in results if r.get("family"))
    axes[0][0].set_ylim(lo - 0.05 * (hi - lo) - 1e-3, hi + 0.05 * (hi - lo) + 1e-3)
    axes[0][0].set_ylabel("validation loss (nats/token)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, old: dict | None, kept: list[dict], ran: list[dict], tiny: bool, command: str, t0: float) -> dict:
    """Writes the JSON: the kept rows that were not rerun, the rows run, in table order. Called after
    every row, so a run that stops half way (a missing corpus, a kill) keeps what it ran."""
    done = {key(r) for r in ran}
    results = [r for r in kept if key(r) not in done] + ran
    order = {key(r): i for i, r in enumerate(sweep_rows(tiny) + dependent_rows(results, tiny) + ladder_rows(tiny))}
    results = [r for r in results if key(r) in order]  # rows the table no longer has are dropped
    results.sort(key=lambda r: order[key(r)])
    doc = {
        "commands": (old.get("commands", []) if old else []) + [command],
        "tiny": tiny,
        "regime": {
            "tokens_per_param": TOKENS_PER_PARAM,
            "min_periods": MIN_PERIODS,
            "M_ref": M_REF,
            "batch": BATCH,
            "model": list(MODEL),
        },
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "wall_s": (old["wall_s"] if old else 0.0) + time.time() - t0,
        "results": results,
        "summary": summarize(results),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="rows at once (0: as many as the cluster's CPUs allow)")
    ap.add_argument("--cpus-per-trial", type=float, default=1.0, help="CPUs a row's Tune trial takes")
    ap.add_argument("--address", help="a Ray cluster to run the rows on (default: a local one, 127.0.0.1 only)")
    ap.add_argument("--storage", help="Tune's storage_path, its experiment state (default: a temporary directory)")
    ap.add_argument("--only", default="", help="comma-separated phases, or phase/label-prefix, to run (default: all)")
    ap.add_argument("--seeds", default="", help="comma-separated seeds to run (default: every row's)")
    ap.add_argument("--tiny", action="store_true", help="the micro preset, 16 steps, few rows (for tests)")
    ap.add_argument("--missing", action="store_true", help="run only the selected rows the JSON does not hold yet")
    ap.add_argument("--out", default="benchmarks/results/quality.json")
    a = ap.parse_args(argv)
    sel = [x for x in a.only.split(",") if x]
    seeds = {int(x) for x in a.seeds.split(",") if x}
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.exists() else None
    if old is not None and old.get("tiny") != a.tiny:
        old = None
    kept = list(old["results"]) if old else []

    def chosen(r: dict) -> bool:
        if seeds and r["seed"] not in seeds:
            return False
        return not sel or any(
            x == r["group"] or (x.startswith(r["group"] + "/") and r["label"].startswith(x.split("/", 1)[1]))
            for x in sel
        )

    t0 = time.time()
    command = "python benchmarks/quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    ran: list[dict] = []

    def done(res: dict) -> None:
        ran.append(res)
        write(out, old, kept, ran, a.tiny, command, t0)
        print(
            f"{res['group']:12s} {res['label']:40s} {res['corpus']:11s} M={res['M']:<3d} seed={res['seed']} "
            f"loss {res['eval_loss']:.4f}  ({res['wall_s']:.0f} s)",
            flush=True,
        )

    from actors.launch import connect

    workers = max(0, a.workers)
    owns = connect(a.address, num_cpus=math.ceil(max(1, workers) * a.cpus_per_trial))
    try:
        with tempfile.TemporaryDirectory(prefix="dloco-quality-tune-") as scratch:
            for phase in ("sweep", "dependent", "ladder"):
                known = {key(r): r for r in kept} | {key(r): r for r in ran}
                pooled = {(setting(r), r["seed"]) for r in known.values()}  # a row of that setting and seed ran
                if phase == "sweep":
                    cands = sweep_rows(a.tiny)
                elif phase == "dependent":
                    cands = dependent_rows(list(known.values()), a.tiny)
                else:
                    cands = ladder_rows(a.tiny)
                todo = [
                    r
                    for r in cands
                    if chosen(r) and not (a.missing and (key(r) in known or (setting(r), r["seed"]) in pooled))
                ]
                if phase == "dependent" and not cands and sel != ["sweep"]:
                    print("the rows after the sweep need every sweep family: run --only sweep first", flush=True)
                longest_first = sorted(todo, key=lambda r: -r["M"] * (4 if r["algorithm"] == "dp" else 1))
                if longest_first:
                    run_trials(longest_first, a.tiny, a.cpus_per_trial, workers, a.storage or scratch, done)
    finally:
        if owns:
            import ray

            ray.shutdown()
    doc = write(out, old, kept, ran, a.tiny, command, t0)
    results = doc["results"]
    plot(results, out.with_suffix(".png"))
    print(f"\n{'setting':90s} {'loss':>8s} {'±':>7s} seeds")
    for s in doc["summary"]:
        print(f"{str(s['setting'])[:90]:90s} {s['mean']:8.4f} {s['spread']:7.4f} {len(s['seeds'])}")
    print(f"wrote {out} and {out.with_suffix('.png')} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
