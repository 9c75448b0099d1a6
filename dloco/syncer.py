"""The syncer's algorithm (ALGORITHM.md §5, §6), without any transport.

`SyncerCore` runs one independent round per fragment p: it validates each push (`dloco.policy`),
keeps the latest valid push per learner, decides when a round closes (quorum K, adaptive grace
window ξ_grace), and turns the closing round into a `Commit`: decode the payloads, check their
values, weight them (w_m = c_tok² / c_steps), merge (RDA or mean), apply the outer Nesterov step.

It holds nothing the store cannot rebuild: Θ_p, s_p, v_p (with `publish: delta` the shadow Θ̂_p)
come from it at start and with each acknowledged commit; pending pushes and timings are soft state.

Publishing (ALGORITHM.md §7): with `compression.publish: delta` the commit carries
q = encode(Θ_p − Θ̂_p, `publish_dtype`) and the new shadow Θ̂_p + decode(q); a learner holding
Θ̂_p applies the same float32 addition and holds the new shadow bit for bit. What the wire lost
stays in Θ_p − Θ̂_p and is sent with the next publish (error feedback). That q is what learners
get with `learner.install: every`; with `own` the store encodes a delta per learner instead
(`dloco.publish`). Every decision comes back with its reason, for the caller to log as an event.

Data-parallel baselines (§9): `dp` is the same machinery with H = P = 1 and K = M (a dead or
frozen learner stops every step); contributions are gradients averaged by tokens (w_m = c_tok),
and the outer step is the inner AdamW (`dloco.outer`). `elastic_dp` closes a round without the
learners still missing `syncer.elastic_timeout_s` after its first push, drops them (the next
rounds expect only the others: the reconfiguration) and takes them back with their next push.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dloco import build, compress, defence, events, merge, outer
from dloco.config import DP_ALGORITHMS, RunConfig
from dloco.defence import rejection
from dloco.fragments import FragmentPlan
from dloco.policy import (
    Beat,
    ContributionMeta,
    Decision,
    FragmentRound,
    NormTracker,
    RoundDecision,
    SyncerTimings,
    check_fields,
    check_meta,
)
from dloco.policy.pace import PaceCheck
from dloco.recipe import Recipe, merge_step, outer_spec
from dloco.store import Commit, MergedPush

__all__ = ["MAX_CLOCK_SKEW_S", "MergeOutcome", "SyncerCore", "rejection"]

# How far a learner's wall clock (a push's `sent_at`) may run ahead of the syncer's: NTP keeps
# hosts within milliseconds; a minute leaves room for a host that lost its time server.
MAX_CLOCK_SKEW_S = 60.0


@dataclass(frozen=True)
class MergeOutcome:
    """A closed round: the commit to send to the store (None if nothing valid) and its event."""

    commit: Commit | None
    event: dict[str, Any]
    rejections: list[dict[str, Any]]
    outer_state: Any = None  # s_p after the outer step (optax state), adopted on acknowledgement
    norms: tuple[float, ...] = ()  # per-step norms of the merged pushes, recorded on acknowledgement
    weights: tuple[tuple[int, float], ...] = ()  # (learner, w_m) of the merged pushes, likewise


class SyncerCore:
    """Per-fragment rounds over the global state `fragments` = [(v_p, Θ_p, s_p leaves)].

    Args:
      cfg: the run config.
      plan: the fragment plan.
      embedding: tensor names merged by weighted mean.
      fragments: per fragment (version, values, outer-state leaves) from the store.
      registry: learner id → current incarnation, from the store.
      shadows: per fragment the shadow Θ̂_p from the store (publish: delta); None: Θ_p.
      merged: per fragment, learner → (incarnation, step) of its last merged push (the store's
        ledger): a push not newer than that is a replay and is rejected.
      norms: per fragment the per-step norms of the outlier check (`NormTracker.to_state`, the
        store keeps them with each commit); None or missing (an old run directory): none yet.

    Nothing in a closed round's `merge` changes this object: the norm history, the weights and
    Θ_p, s_p, v_p move only in `committed`, once the store acknowledged, so a discarded commit
    leaves no trace, and `push` may run on another thread between `take` and `committed`.
    """

    def __init__(
        self,
        cfg: RunConfig,
        plan: FragmentPlan,
        embedding: frozenset[str],
        fragments: list[tuple[int, dict[str, np.ndarray], list[np.ndarray]]],
        registry: Mapping[int, int],
        shadows: list[dict[str, np.ndarray]] | None = None,
        merged: list[Mapping[int, tuple[int, int]]] | None = None,
        norms: list[Iterable[float]] | None = None,
    ) -> None:
        self.cfg, self.plan, self.embedding = cfg, plan, embedding
        self.versions = [v for v, _, _ in fragments]
        self.values = [dict(vals) for _, vals, _ in fragments]
        self.delta_publish = cfg.compression.publish == "delta"
        self.shadows = [dict(h) for h in shadows] if shadows is not None else [dict(v) for v in self.values]
        self.states = [outer.state_from_numpy(outer.outer_config(cfg), vals, s) for _, vals, s in fragments]
        self.registry = dict(registry)
        self.rounds = [FragmentRound(p, cfg.syncer.quorum) for p in range(plan.count)]
        self.beats = [Beat(cfg.sync.every) for _ in range(plan.count)] if cfg.sync.dynamic else None
        self.norms = [self._tracker(h) for h in norms or [[] for _ in range(plan.count)]]
        self.timings = SyncerTimings(cfg.syncer.ema_decay)
        self.pace = PaceCheck(cfg.syncer.max_norm_ratio, cfg.sync.every)
        self.outer_step = outer.make_outer_step(outer.outer_config(cfg))
        self.merge_step = outer.make_merge_step(outer.outer_config(cfg), self.outer_step)  # fused where it can
        self.outer_spec = outer_spec(outer.outer_config(cfg))  # the commits' recipes name it (`dloco.recipe`)
        self.dp, self.elastic = cfg.algorithm in DP_ALGORITHMS, cfg.algorithm == "elastic_dp"
        self.dropped: set[int] = set()  # elastic_dp: learners the current configuration runs without
        self._dropping: dict[int, list[int]] = {}  # fragment → learners its closing round dropped
        # fragment → learner → weight w_m of its last merged push (soft state for `share`)
        self._last_weights: list[dict[int, float]] = [{} for _ in range(plan.count)]
        self.merged_steps = [dict(x) for x in merged or [{} for _ in range(plan.count)]]
        self._closing: dict[int, tuple[float, float, dict[int, int]]] = {}  # p → (ξ_grace, slack, registry) at take
        self._inflight: list[set[tuple[int, int, int]]] = [set() for _ in range(plan.count)]  # taken, not acked

    def _tracker(self, history: Iterable[float]) -> NormTracker:
        """The outlier check's tracker from a stored history (what is not a finite norm > 0 is dropped:
        a zero median would switch the check off, `dloco.policy.check_values`)."""
        kept = [float(x) for x in history if isinstance(x, int | float) and math.isfinite(x) and x > 0]
        return NormTracker.from_state(kept, warmup=self.cfg.syncer.norm_warmup)

    def tokens_per_step(self, learner_id: int) -> int:
        """Tokens one inner step of the learner trains: its batch (`build.learner_batch_size`) × seq_len."""
        return build.learner_batch_size(self.cfg, learner_id) * self.cfg.data.seq_len

    def weight_cap(self, learner_id: int) -> float:
        """The largest merge weight one push of the learner carries: ρ·H·(its tokens per step)², what
        w_m = c_tok² / c_steps is for ρ·H steps of its registered batch. An honest push covers about
        H steps (w_m = H·tps²) and is never capped; one that claims more (a learner back from an
        outage, or one that inflates its steps within the pace the time allows) weighs at most ρ
        honest pushes of its size, so no single learner's weight can drown the round's others."""
        return self.cfg.syncer.max_norm_ratio * self.cfg.sync.every * float(self.tokens_per_step(learner_id)) ** 2

    def push(self, meta: ContributionMeta, payload: Any, now: float, wall: float | None = None) -> Decision:
        """Validates a push's metadata and adds it to its fragment's round (`payload` is opaque).

        `wall` is the syncer's wall clock, against which a push's `sent_at` (the learner's wall
        clock) may run ahead by at most `MAX_CLOCK_SKEW_S`; None skips that check.
        """
        d = check_fields(meta)  # before anything compares, hashes or indexes with its fields
        if not d.accept:
            return d
        p = meta.fragment_id
        if not 0 <= p < self.plan.count:
            return Decision(False, f"unknown fragment {p}")
        if wall is not None and meta.sent_at > wall + MAX_CLOCK_SKEW_S:
            return Decision(
                False, f"sent in the future: sent_at {meta.sent_at:.6g} > now {wall:.6g} + {MAX_CLOCK_SKEW_S:g} s"
            )
        if self.registry.get(meta.learner_id) == meta.incarnation:
            self.dropped.discard(meta.learner_id)  # elastic_dp: a dropped learner is back
        d = self._check(p, meta, self.registry, in_round=True)
        if not d.accept:
            return d
        self.timings.observe_step_time(meta.learner_id, meta.step_time)
        merged = [mp[1] for f in self.merged_steps if (mp := f.get(meta.learner_id)) is not None]
        implausible = self.pace.check(meta, now, self.timings.step_time, max(merged, default=0))
        if implausible is not None:
            return Decision(False, implausible)
        self.pace.passed(meta, now)
        if self.beats is not None and meta.cycle_time > 0:
            self.timings.observe_cycle_time(meta.learner_id, meta.cycle_time)
        note = self.rounds[p].add(meta, payload, now)
        return Decision(True, note or "accepted", next_push=self._next_push(p, meta.learner_id, now))

    def _next_push(self, p: int, learner_id: int, now: float) -> int | None:
        """`sync.dynamic`: places the push on fragment p's beat and says in how many steps the
        learner's next push of p is due (`Beat`), the period T being H × the fastest learner's
        seconds per step, each learner's counted end to end (`cycle_time`)."""
        fastest, own = self.timings.fastest_cycle_time, self.timings.cycle_time(learner_id)
        if self.beats is None or not fastest or not own:
            return None
        period = self.cfg.sync.every * fastest
        return self.beats[p].next_push(self.beats[p].place(now, period), period, own)

    def _check(self, p: int, meta: ContributionMeta, registry: Mapping[int, int], in_round: bool) -> Decision:
        """`check_meta` (the learner's tokens per step included), then `_check_replay`."""
        s = self.cfg.syncer
        d = check_meta(
            meta,
            registry=registry,
            current_version=self.versions[p],
            max_staleness=s.max_staleness,
            tokens_per_step=self.tokens_per_step,
        )
        return self._check_replay(p, meta, in_round) if d.accept else d

    def holds(self, meta: ContributionMeta) -> bool:
        """Whether this syncer has `meta`'s push: pending in its fragment's round, in the round being
        merged, or merged already. A blocking learner waiting for its merge sends the payload again
        only when the syncer does not (`LearnerService.resend_due`): lost on the wire, or forgotten
        with a restart or a dropped round."""
        p, m = meta.fragment_id, meta.learner_id
        if not 0 <= p < len(self.rounds):
            return False
        pending = self.rounds[p].pending.get(m)
        if pending is not None and (pending[0].incarnation, pending[0].step) == (meta.incarnation, meta.step):
            return True
        if (m, meta.incarnation, meta.step) in self._inflight[p]:
            return True
        last = self.merged_steps[p].get(m)
        return last is not None and last[0] == meta.incarnation and meta.step <= last[1]

    def _check_replay(self, p: int, meta: ContributionMeta, in_round: bool = True) -> Decision:
        """A push of an incarnation whose step is not newer than its last merged one is a replay;
        so is one whose round is being merged now (a blocking learner's resend, say). A push covers
        steps (step − c_steps, step]; one that starts before the last merged step was sent before
        that merge reached its learner and contains the merged push: it would apply those steps
        twice. The learner rebases on the merged push and sends the rest next (`LearnerCore.install`)."""
        if in_round and (meta.learner_id, meta.incarnation, meta.step) in self._inflight[p]:
            return Decision(False, f"replay: step {meta.step} is in the round being merged")
        last = self.merged_steps[p].get(meta.learner_id)
        if last is not None and last[0] == meta.incarnation and meta.step <= last[1]:
            return Decision(False, f"replay: step {meta.step} was merged already (last merged step {last[1]})")
        if not self.dp and last is not None and last[0] == meta.incarnation and meta.step - meta.steps < last[1]:
            start = meta.step - meta.steps
            return Decision(False, f"overlap: steps {start}..{meta.step} include merged step {last[1]}")
        return Decision(True, "accepted")

    def grace(self) -> float:
        """ξ_grace = clamp(γ·(τ·ξ_step − ξ_quorum − ξ_sync), 0, ξ_step·max_grace_steps)."""
        return self.timings.grace(self.cfg.sync.overlap, self.cfg.syncer.grace_factor, self.cfg.syncer.max_grace_steps)

    def slack(self) -> float:
        """τ·ξ_step − ξ_quorum − ξ_sync: the free time the grace window may use a share γ of."""
        t = self.timings
        return self.cfg.sync.overlap * (t.step_time or 0.0) - (t.quorum_time or 0.0) - (t.sync_time or 0.0)

    def ready(self, now: float, live_learners: int | None = None) -> tuple[list[int], float | None]:
        """Fragments whose round closes now, and the seconds until the next deadline (or None)."""
        grace, due, wait = self.grace(), [], None
        for r in self.rounds:
            until = None if self.beats is None else self.beats[r.fragment_id].at
            d = self._elastic_decide(r, now) if self.elastic else r.decide(now, grace, live_learners, until)
            if d.close:
                due.append(r.fragment_id)
            elif d.wait is not None:
                wait = d.wait if wait is None else min(wait, d.wait)
        return due, wait

    def _expected(self) -> set[int]:
        return set(self.registry) - self.dropped

    def _elastic_decide(self, r: FragmentRound, now: float) -> RoundDecision:
        """elastic_dp: close when every expected learner pushed, or `elastic_timeout_s` after the first push."""
        present, expected = set(r.pending), self._expected()
        if r.first_push_at is None:
            return RoundDecision(False, "waiting for the first push", None)
        if present >= expected:
            return RoundDecision(True, f"all {len(expected)} expected learners contributed", None)
        left = r.first_push_at + self.cfg.syncer.elastic_timeout_s - now
        if left <= 0:
            return RoundDecision(True, f"reconfiguring without learners {sorted(expected - present)}", None)
        return RoundDecision(False, f"waiting for learners {sorted(expected - present)}, {left:.3g} s left", left)

    def take(self, p: int, now: float) -> tuple[list[tuple[ContributionMeta, Any]], float]:
        """Closes round p: its pending (meta, payload) pairs and the grace time it used.

        Records the round's ξ_quorum sample (first push → K-th push).
        """
        r = self.rounds[p]
        if r.quorum_time is not None:
            self.timings.observe_quorum_time(r.quorum_time)
        grace_used = 0.0 if r.quorum_reached_at is None else max(0.0, now - r.quorum_reached_at)
        if self.elastic:
            missing = sorted(self._expected() - set(r.pending))
            self.dropped.update(missing)
            self._dropping[p] = missing
        self._closing[p] = (self.grace(), self.slack(), dict(self.registry))
        items = r.take()
        self._inflight[p] = {(m.learner_id, m.incarnation, m.step) for m, _ in items}
        return items, grace_used

    def busy(self) -> list[int]:
        """Fragments whose round commits without another push: taken, or at quorum (elastic: any push)."""
        n = 1 if self.elastic else self.cfg.syncer.quorum
        return [p for p, r in enumerate(self.rounds) if self._inflight[p] or len(r.pending) >= n]

    def release(self, p: int) -> None:
        """Round p's close is over (committed, discarded or failed): its pushes are no longer in flight."""
        self._inflight[p] = set()

    def merge(
        self,
        p: int,
        items: list[tuple[ContributionMeta, dict[str, compress.Payload] | None]],
        *,
        grace_used: float,
        lost: Callable[[ContributionMeta], str] | None = None,
    ) -> MergeOutcome:
        """Decodes, checks, weights and merges a closed round of fragment p; applies the outer step.

        `items` pairs each pushed meta with its payload, or None if the payload could not be
        fetched (e.g. lost with its dead owner): such a push is skipped as missing. The checks
        are `dloco.defence`'s: each push's at close (`screen`), then the merged result's
        (`check_commit`): one that is not finite or moves Θ_p implausibly far is not committed
        (a `commit_rejected` event, its pushes rejected), so the global model never absorbs it.
        """
        closing = self._closing.pop(p, None)
        grace_window, slack, registry = closing or (self.grace(), self.slack(), dict(self.registry))
        size, theta = self.plan.fragments[p].size, defence.norm(self.values[p].values())
        screened = defence.screen(
            items,
            expected=self.plan.fragments[p].shape_map,
            check=lambda m: self._check(p, m, registry, in_round=False),
            norms=self.norms[p],
            max_norm_ratio=self.cfg.syncer.max_norm_ratio,
            bound=defence.contribution_bound(self.cfg, size, theta),
            lost=lost,
        )
        rejections, metas, norms = screened.rejections, screened.metas, screened.norms
        if not metas:
            return MergeOutcome(None, events.RoundEmpty(fragment=p, version=self.versions[p]).to_dict(), rejections)
        if self.dp:  # the global-batch gradient: each learner's mean gradient weighted by its tokens
            weights = np.asarray([m.tokens for m in metas], np.float64)
        elif self.cfg.merge.weighting == "tokens":
            weights = merge.token_weights([m.tokens for m in metas], [m.steps for m in metas])
            weights = np.minimum(weights, [self.weight_cap(m.learner_id) for m in metas])
        else:
            weights = np.ones(len(metas))
        share = self.share(p, metas, weights, registry)  # a partial round applies its share of the weight
        made = Recipe(
            deltas=tuple(screened.deltas),
            weights=tuple(float(w) for w in np.asarray(weights, np.float64)),
            share=share,
            norms=tuple(norms),
            rule=self.cfg.merge.rule,
            embedding=tuple(sorted(self.embedding)),
            outer=self.outer_spec,
        )
        values, state = merge_step(self.values[p], self.states[p], made, self.merge_step)
        # per-step norms ‖δ‖ / c_steps (`defence.screen`), recorded when the store acknowledges
        step_norms = tuple(
            float(np.sqrt(sum(v * v for v in tn.values()))) / max(m.steps, 1)
            for tn, m in zip(norms, metas, strict=True)
        )
        state_leaves = outer.state_to_numpy(state)
        refused = defence.check_commit(self.cfg, size, self.values[p], values, state_leaves, step_norms)
        if refused is None:
            try:
                shadow, published = self._publish(p, values)
            except ValueError as e:  # Θ_p − Θ̂_p beyond what publish_dtype carries (its float16 scales overflow)
                refused = f"unpublishable: {e}"
        if refused is not None:  # discarded: its pushes are rejected, nothing of the round is adopted
            self._dropping.pop(p, None)
            rejections += [rejection(m, f"commit refused: {refused}") for m in metas]
            return MergeOutcome(None, events.CommitRejected(fragment=p, reason=refused).to_dict(), rejections)
        commit = Commit(
            fragment_id=p,
            base_version=self.versions[p],
            values=values,
            outer_state=state_leaves,
            merged=tuple(MergedPush(m.learner_id, m.incarnation, m.step, m.tokens, m.steps, m.cursor) for m in metas),
            commit_id=uuid.uuid4().hex,
            shadow=shadow,
            delta=published,
            norms=(*self.norms[p].to_state(), *step_norms)[-self.norms[p].window :],
            recipe=dataclasses.replace(made, published=published),
        )
        event = events.Merge(
            fragment=p,
            version=commit.version,
            contributors=[m.learner_id for m in metas],
            incarnations=[m.incarnation for m in metas],
            steps=[m.step for m in metas],
            tokens=[m.tokens for m in metas],
            inner_steps=[m.steps for m in metas],
            weights=[float(w) for w in np.asarray(weights) / np.sum(weights)],
            share=share,
            staleness=[self.versions[p] - m.base_version for m in metas],
            cycle_s=[m.cycle_time for m in metas],
            grace_s=grace_used,
            grace_window_s=grace_window,
            slack_s=slack,
            bytes_in=screened.nbytes_in,
            bytes_out=sum(v.nbytes for v in (published or values).values()),
            rejected=len(rejections),
            dropped=self._dropping.pop(p, []) if self.elastic else None,
        ).to_dict()
        recorded = tuple((m.learner_id, float(w)) for m, w in zip(metas, np.asarray(weights, np.float64), strict=True))
        return MergeOutcome(commit, event, rejections, state, step_norms, recorded)

    def share(
        self, p: int, metas: list[ContributionMeta], weights: np.ndarray, registry: Mapping[int, int] | None = None
    ) -> float:
        """The round's share of the live learners' weight: Σ_round w_m / (Σ_round w_m + Σ_absent ŵ_i).

        ŵ_i is the weight of learner i's last merged push to fragment p (the mean of the known
        ones for a learner not seen yet); the live learners are the registry's. 1 for dp and
        elastic_dp (their rounds are complete by construction) and with `merge.scale_by_share`
        off. The round's own weights count as its learners' last (`committed` records them).
        """
        w = np.asarray(weights, np.float64)
        registry = self.registry if registry is None else registry
        last = dict(self._last_weights[p])
        for m, wm in zip(metas, w, strict=True):
            last[m.learner_id] = float(wm)
        if self.dp or not self.cfg.merge.scale_by_share:
            return 1.0
        present = {m.learner_id for m in metas}
        absent = [i for i in registry if i not in present]
        if not absent:
            return 1.0
        known = [w_i for i, w_i in last.items() if i in registry]
        fallback = float(np.mean(known)) if known else float(w.mean())
        missing = sum(last.get(i, fallback) for i in absent)
        return float(w.sum() / (w.sum() + missing))

    def _publish(self, p: int, values: dict[str, np.ndarray]) -> tuple[dict | None, dict | None]:
        """publish: delta → (new shadow Θ̂_p + decode(q), q = encode(Θ_p − Θ̂_p)); full → (None, None)."""
        if not self.delta_publish:
            return None, None
        c = self.cfg.compression
        shadow, q = {}, {}
        for n, x in values.items():
            q[n] = compress.encode(np.asarray(x, np.float32) - self.shadows[p][n], c.publish_dtype, c.block)
            shadow[n] = self.shadows[p][n] + compress.decode(q[n])
            q[n] = compress.pack(q[n], c.entropy)  # lossless: learners decode to the same Θ̂_p
        return shadow, q

    def committed(self, outcome: MergeOutcome, sync_time: float) -> None:
        """The store acknowledged `outcome.commit`: adopt Θ_p, s_p, v_p (Θ̂_p), the round's norms,
        weights and merged steps; ξ_sync ← EMA(sync_time)."""
        c = outcome.commit
        assert c is not None, "committed() acknowledges an outcome that has a commit"
        p = c.fragment_id
        self.values[p], self.versions[p], self.states[p] = c.values, c.version, outcome.outer_state
        self.shadows[p] = c.values if c.shadow is None else c.shadow
        for n in outcome.norms:
            self.norms[p].record(n)
        self._last_weights[p].update(outcome.weights)
        for mp in c.merged:
            self.merged_steps[p][mp.learner_id] = (mp.incarnation, mp.step)
        self._inflight[p] = set()
        self.timings.observe_sync_time(sync_time)

    def reload(
        self,
        p: int,
        version: int,
        values: dict[str, np.ndarray],
        state: list[np.ndarray],
        shadow: dict[str, np.ndarray] | None = None,
        norms: Iterable[float] | None = None,
    ) -> None:
        """Adopt the store's state of fragment p (after a rejected commit or a store restart)."""
        self._closing.pop(p, None)
        if norms is not None:
            self.norms[p] = self._tracker(norms)
        self.versions[p], self.values[p] = version, dict(values)
        self.shadows[p] = dict(values if shadow is None else shadow)
        self.states[p] = outer.state_from_numpy(outer.outer_config(self.cfg), values, state)

    def update_registry(self, registry: Mapping[int, int]) -> None:
        self.registry = dict(registry)
        for m in list(self.timings.to_state()["step_time"]):
            if m[0] not in self.registry:
                self.timings.forget(m[0])
                self.pace.forget(m[0])
