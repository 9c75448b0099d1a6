"""Fuzzing the syncer core against a real store (`dloco.syncer`, `dloco.defence`, `dloco.store`).

Random sequences of pushes (shapes right or wrong, every wire dtype, NaN/Inf, norms over 50 orders
of magnitude, versions, incarnations, steps, token counts, cursors, malformed fields of every kind),
round closes and restarts, closed the way `dloco.services.syncer` closes them, committed into a
`StoreCore` in a temporary directory. Properties:

- nothing raises: every push is decided with a reason, every pushed round closes;
- every push is merged or rejected with a reason (or superseded by its learner's newer push, or
  forgotten with a restarted syncer's soft state);
- what is committed is finite (Θ_p and s_p), and each commit makes v_p exactly one larger;
- the ledger's tokens never exceed what the pushes accepted at push time claimed.
"""

import math
import tempfile
from functools import cache

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dloco import compress, config, fragments, outer
from dloco.policy import ContributionMeta
from dloco.store import StoreCore
from dloco.syncer import SyncerCore

PARAMS = {"embed": {"embedding": np.full((2, 3), 0.1, np.float32)}, "w": np.linspace(-1, 1, 6).astype(np.float32)}
LEARNERS = (0, 1, 2)
DTYPES = ("fp32", "bf16", "int8", "int4", "int2")


@cache
def setup(quorum, warmup, lr, momentum, rule, publish):
    cfg = config.load(
        overrides=(
            "learners.count=3",
            f"syncer.quorum={quorum}",
            f"syncer.norm_warmup={warmup}",
            f"outer.lr={lr}",
            f"outer.momentum={momentum}",
            f"merge.rule={rule}",
            f"compression.publish={publish}",
        )
    )
    plan = fragments.partition(PARAMS, 2)
    initial = plan.split(PARAMS)
    return cfg, plan, initial, [outer.state_to_numpy(outer.init(outer.outer_config(cfg), f)) for f in initial]


configs = st.tuples(
    st.sampled_from([1, 2]),
    st.sampled_from([0, 2, 8]),
    st.sampled_from(["1.0", "1.0", "0.7", "1.0e+3", "1.0e+30"]),  # η: sane, or huge (refused at commit)
    st.sampled_from(["0.0", "0.9"]),
    st.sampled_from(["rda", "mean"]),
    st.sampled_from(["full", "delta"]),
)

BAD_CURSORS = [
    {"epoch": "x", "index": 1},
    [1, 2],
    {"epoch": 0},
    {"epoch": 0, "index": -1},
    {"epoch": 0, "index": math.nan},
    {"epoch": 0, "index": object()},
    {"epoch": 0, "index": 2**80},
    "cursor",
]

# A push is a valid one with up to two fields replaced by one of their bad values, so that rounds
# fill with mostly well-formed pushes and each kind of damage is met alone and in pairs.
BAD = {
    "learner": [5, -1, "1", True, 1.0, [0], None],
    "incarnation": [0, 2, "1", None, 2**70, 1.5],
    "fragment": [2, -1, 1.0, "0", None],
    "behind": [-1, 12, None, 0.5],  # base = v_p − behind
    "steps": [0, -1, 2.5, 10**30, True],
    "tokens": [0, -10, 10**7, 10**200, 2.0**70, math.nan, "many"],
    "step": [-5, 0, 1, 10**300, "now"],
    "step_time": [math.nan, math.inf, -1.0, "x", 10**400],
    "cursor": BAD_CURSORS,
    "shape": ["wrong", "missing", "extra", "lost", "garbage"],
    "special": [math.nan, math.inf, -math.inf],
}
valid_pushes = st.fixed_dictionaries(
    {
        "learner": st.sampled_from(LEARNERS),
        "incarnation": st.just(1),
        "fragment": st.sampled_from([0, 1]),
        "behind": st.integers(0, 2),
        "steps": st.integers(1, 40),
        "tokens": st.just("exact"),
        "step": st.just("next"),
        "step_time": st.floats(0, 10),
        "cursor": st.sampled_from(["valid", None]),
        "shape": st.just("right"),
        "dtype": st.sampled_from(DTYPES),
        "magnitude": st.sampled_from([-6, -5, -4, -4, -3, -3, -2, -12, 0, 3, 10, 19, 30, 40]),  # 10^k per value
        "special": st.none(),
        "seed": st.integers(0, 2**16),
    }
)
damage = st.lists(
    st.sampled_from(sorted(BAD)).flatmap(lambda k: st.tuples(st.just(k), st.sampled_from(BAD[k]))), max_size=2
)
pushes = st.tuples(valid_pushes, damage).map(lambda t: {**t[0], **dict(t[1])})
ops = st.lists(
    st.one_of(
        pushes.map(lambda p: ("push", p)),
        st.sampled_from([0, 1]).map(lambda p: ("close", p)),
        st.booleans().map(lambda store_too: ("restart", store_too)),
    ),
    min_size=1,
    max_size=16,
)


def payload_for(spec, shapes):
    """A payload as the spec says; None: lost with its owner."""
    if spec["shape"] == "lost":
        return None
    if spec["shape"] == "garbage":
        return {n: "not a payload" for n in shapes}
    shapes = dict(shapes)
    name = next(iter(shapes))
    if spec["shape"] == "wrong":
        shapes[name] = (*shapes[name], 2)
    elif spec["shape"] == "missing":
        del shapes[name]
    elif spec["shape"] == "extra":
        shapes["extra"] = (3,)
    rng = np.random.default_rng(spec["seed"])
    out = {}
    for n, shape in shapes.items():
        with np.errstate(over="ignore"):
            x = (rng.normal(size=shape) * 10.0 ** spec["magnitude"]).astype(np.float32)
        if spec["special"] is not None and x.size:
            x.reshape(-1)[spec["seed"] % x.size] = spec["special"]
        try:
            out[n] = compress.encode(x, spec["dtype"])
        except ValueError:  # encode refuses non-finite values: send them as fp32, built directly
            out[n] = compress.Payload("fp32", x.shape, x, None, 128)
    return out


class Harness:
    """One run: a store in a temporary directory, a syncer built from it, the fuzzed operations."""

    def __init__(self, root, cfg, plan, initial, initial_outer):
        self.root, self.cfg, self.plan, self.initial, self.initial_outer = root, cfg, plan, initial, initial_outer
        self.store = StoreCore(root, initial, initial_outer, snapshot_every=3)
        for m in LEARNERS:
            self.store.register(m)
        self.versions = list(self.store.versions)
        self.claimed: dict[tuple[int, int], int] = {}  # (learner, fragment) → tokens of pushes accepted
        self.merged: dict[tuple[int, int], int] = {}  # (learner, fragment) → tokens of merged pushes
        self.steps = dict.fromkeys(LEARNERS, 0)
        self.pending: dict[int, dict[int, ContributionMeta]] = {0: {}, 1: {}}  # id(meta) → meta, accepted
        self.now = 0.0
        self.start_syncer()

    def start_syncer(self):
        """As `SyncerService` builds its core from `StoreService.syncer_state`."""
        n = len(self.store.versions)
        frs = [(*self.store.fragment(p), self.store.outer_state(p)) for p in range(n)]
        merged = [
            {m: (int(e["incarnation"]), int(e["step"])) for m, e in self.store.last_merged(p).items()} for p in range(n)
        ]
        shadows = [self.store.shadow(p)[1] for p in range(n)]
        norms = [list(f.norms) for f in self.store.fragments]
        names = fragments.embedding_names(self.plan.names)
        self.syncer = SyncerCore(self.cfg, self.plan, names, frs, self.store.live_registry(), shadows, merged, norms)
        self.pending = {0: {}, 1: {}}  # a restarted syncer forgets its rounds (soft state)

    def restart(self, store_too):
        if store_too:
            self.store.close()
            self.store = StoreCore(self.root, self.initial, self.initial_outer, snapshot_every=3)
            assert self.store.versions == self.versions
            self.check_finite()
        self.start_syncer()

    def push(self, spec):
        learner, p = spec["learner"], spec["fragment"]
        target = p if p in (0, 1) and type(p) is int else 1
        version = self.syncer.versions[target]
        steps, known = spec["steps"], type(learner) is int and learner in LEARNERS
        if spec["step"] == "next":
            step = self.steps[learner] + steps if known and type(steps) is int else 7
        else:
            step = spec["step"]
        if known and type(step) is int and 0 <= step < 2**62:
            self.steps[learner] = max(self.steps[learner], step)
        tokens = spec["tokens"]
        if tokens == "exact":
            tokens = steps * self.syncer.tokens_per_step(learner if known else 0) if type(steps) is int else 1
        behind = spec["behind"]
        base = version - behind if type(behind) is int else behind
        cursor = spec["cursor"]
        if cursor == "valid":
            cursor = {"epoch": 0, "index": step if type(step) is int and 0 <= step < 2**62 else 0}
        meta = ContributionMeta(learner, spec["incarnation"], p, base, tokens, steps, step, spec["step_time"], cursor)
        self.now += 0.5
        d = self.syncer.push(meta, payload_for(spec, self.plan.fragments[target].shape_map), self.now)
        assert isinstance(d.reason, str) and d.reason
        event(f"push: {d.reason.split(':')[0]}")
        if d.accept:
            self.pending[p][id(meta)] = meta
            key = (learner, p)
            self.claimed[key] = self.claimed.get(key, 0) + tokens
        else:
            assert d.reason != "accepted"

    def close(self, p):
        """As `SyncerService._close` does (payloads fetched already: the core holds them)."""
        self.now += 1.0
        items, grace = self.syncer.take(p, self.now)
        try:
            if not items:
                return
            lost = {id(m) for m, x in items if x is None}
            out = self.syncer.merge(p, items, grace_used=grace, lost=lambda m: "payload lost: its owner died")
            rejected = {(r["learner"], r["step"]) for r in out.rejections}
            assert all(r["reason"] for r in out.rejections)
            merged = set()
            if out.commit is not None:
                result = self.store.commit(out.commit)
                assert result.accepted and result.version == self.versions[p] + 1, result
                self.versions[p] += 1
                self.syncer.committed(out, 0.01)
                merged = {(mp.learner_id, mp.step) for mp in out.commit.merged}
                for mp in out.commit.merged:
                    key = (mp.learner_id, p)
                    self.merged[key] = self.merged.get(key, 0) + mp.tokens
                self.check_finite()
            else:
                assert out.event["event"] in ("round_empty", "commit_rejected")
            event(out.event["event"])  # `pytest --hypothesis-show-statistics`: how the rounds ended
            for r in out.rejections:
                event(f"rejected at close: {r['reason'].split(':')[0]}")
            # every closed push: merged, or rejected with a reason, never both, never neither
            keys = [(m.learner_id, m.step) for m, _ in items]
            assert len(keys) == len(set(keys)) and set(keys) == rejected | merged and not rejected & merged
            assert all((m.learner_id, m.step) in rejected for m, _ in items if id(m) in lost)
        finally:
            self.syncer.release(p)
            self.pending[p] = {}  # the closed pushes, and those they superseded

    def check_finite(self):
        for p in range(len(self.store.versions)):
            assert all(np.isfinite(x).all() for x in self.store.fragment(p)[1].values())
            assert all(np.isfinite(x).all() for x in self.store.outer_state(p))
            assert all(np.isfinite(x).all() for x in self.store.shadow(p)[1].values())

    def finish(self):
        for p in (0, 1):
            self.close(p)
        assert self.store.versions == self.versions
        self.check_finite()
        ledger = self.store.tokens_merged()
        for m, per_fragment in ledger.items():
            for p, tokens in enumerate(per_fragment):
                assert tokens == self.merged.get((m, p), 0) <= self.claimed.get((m, p), 0)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(configs, ops)
def test_every_contribution_is_merged_or_rejected_and_the_model_stays_finite(variant, operations):
    with tempfile.TemporaryDirectory() as root:
        h = Harness(root, *setup(*variant))
        try:
            for kind, arg in operations:
                getattr(h, kind)(arg)
            h.finish()
        finally:
            h.store.close()
