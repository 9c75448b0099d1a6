"""The learner's algorithm (ALGORITHM.md §4), without any transport: one object, one step at a time.

`LearnerCore` owns θ_m (replicated on the learner's device mesh), its AdamW state, its data
stream, and per fragment p: the anchor (the global Θ̂_p it last installed), the version v_p of
that anchor, the counters c_tok[p], c_steps[p], the error-feedback residual e_p and the record of
its last push. `step()` never blocks: it trains one batch and returns the pushes that fell due;
`install()` applies a merged fragment by `learner.receive` (with `compression.publish: delta` the
fragment arrives as a quantized difference that `receive()` adds to the copy the learner holds):

    overwrite: θ_p ← Θ'_p; counters reset
    blend:     θ_p ← α·θ_p + (1−α)·Θ'_p; counters reset
    rebase:    θ_p ← Θ'_p + (θ_p − base); base = θ_p at the push this merge included (counters
               keep what was trained after it), or the old anchor if the merge did not include a
               push of this learner (counters unchanged); a push still not merged after
               `syncer.max_staleness` newer versions is given up and the fragment overwritten

A push carries everything since the anchor, so a second push of p sent before the first one's
merge came back contains it. Every push not yet known merged is kept (`pending_pushes`): a merge
that included any of them (not only the newest) moves the base to it, and the syncer rejects a
later push that overlaps a merged one (`SyncerCore`); its progress stays in θ_p and goes with the
next push. While merges come back within H steps a newer push may still supersede an older one in
its open round (§5). When the learner's measured round trip (push → install of its merge) exceeds
H steps, each further push would only be rejected, so a decoupled learner then keeps one push of
p in flight: a due push is skipped (its progress goes with the next) until the last one is merged
or older than 2 × the round trip (taken as lost). At most `MAX_PENDING_PUSHES` are kept, never
dropped. Measured in Ray before this (ms steps, merges 6–12 steps late at H = 8): 484–2,240 steps
merged twice per run, and eval loss above its start.

Pushes fall due on the fragment plan's fixed schedule (`FragmentPlan.due`), or with
`sync.dynamic` (DyLU) when the syncer said: each accepted push's decision names in how many steps
the next push of its fragment is due (`retime`, `dloco.policy.Beat`); until it has, H steps.

A push carries δ_p = anchor_p − θ_p (compressed with error feedback) and `ContributionMeta`.
Data-parallel baselines (`algorithm: dp | elastic_dp`, §9): `step()` computes the gradient g of
the batch at θ (= the installed global Θ) without applying it and pushes g every step; the merged
update Θ ← AdamW(Θ, mean g) comes back and is installed before the next step (blocking, τ = 0).
The Ray actor in `actors/learner.py` is a thin wrapper around this class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dloco import compress, inner
from dloco.config import BLOCKING_ALGORITHMS, DP_ALGORITHMS, RunConfig
from dloco.data import Cursor, TokenStream
from dloco.fragments import FragmentPlan
from dloco.policy import ContributionMeta, Ema


@dataclass(frozen=True)
class Push:
    """One learner → syncer contribution: metadata plus one compressed payload per tensor."""

    meta: ContributionMeta
    payload: dict[str, compress.Payload]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.payload.values())


@dataclass(frozen=True)
class Delivery:
    """A merged fragment Θ'_p at `version` that reached the learner; `included_step` is the step
    of this learner's last push merged into fragment p by this or an earlier version (the store's
    ledger; None if none was), so a learner that skipped versions still knows what was merged.

    With `compression.publish: delta` a delivery may carry `delta` (tensor → payload q) instead of
    `values`: Θ̂'_p = Θ̂_p + decode(q), valid only on top of version `base_version` (default
    `version − 1`; a per-learner delta, `dloco.publish.Copies`, may span several versions)."""

    fragment_id: int
    version: int
    values: Mapping[str, np.ndarray] | None
    included_step: int | None = None
    delta: Mapping[str, compress.Payload] | None = None
    base_version: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the payloads of a delta, else the float32 values."""
        if self.delta:
            return sum(q.nbytes for q in self.delta.values())
        assert self.values is not None, "a delivery carries values or a delta"
        return sum(x.nbytes for x in self.values.values())


@dataclass
class _PushRecord:
    step: int
    theta: dict[str, np.ndarray]  # θ_p at push time (for rebase)
    tokens: int
    steps: int
    base_version: int
    residual: dict[str, np.ndarray] | None = None  # e_p after this push (error feedback)


# Pushes of one fragment kept while not known merged; at this many a due push is skipped. None is
# dropped: a merge of a forgotten push would install as "not included" and count its steps twice.
MAX_PENDING_PUSHES = 16


class LearnerCore:
    """One learner m. See the module docstring for the update rules.

    Args:
      cfg: the run config.
      learner_id, incarnation: identity in the store's registry.
      model, mesh: the Flax model and this learner's device mesh.
      plan: the fragment plan shared by every actor.
      fragments: the global fragments Θ̂_p (one flat numpy dict per fragment) to start from.
      versions: their versions v_p.
      stream: this learner's token stream (positioned at its resume cursor).
      step: the local step counter t to resume from (drives the inner lr schedule).
    """

    def __init__(
        self,
        cfg: RunConfig,
        learner_id: int,
        incarnation: int,
        model,
        mesh,
        plan: FragmentPlan,
        fragments: Sequence[Mapping[str, np.ndarray]],
        versions: list[int],
        stream: TokenStream,
        step: int = 0,
    ) -> None:
        self.cfg, self.learner_id, self.incarnation = cfg, learner_id, incarnation
        self.plan, self.mesh, self.stream = plan, mesh, stream
        self.dp = cfg.algorithm in DP_ALGORITHMS
        self.sharding = cfg.learners.sharding  # parameters and AdamW state: replicated or FSDP over the mesh
        if self.dp:
            self._grad_step = inner.make_grad_step(model, mesh, self.sharding, cfg.inner.accum_steps)
        else:
            self._train_step = inner.make_train_step(model, cfg.inner, mesh, self.sharding)
        params = plan.join([{n: np.asarray(a, np.float32) for n, a in f.items()} for f in fragments])
        self.state = inner.init_state(params, cfg.inner, mesh, self.sharding)._replace(step=step)
        P = plan.count
        self.anchors: list[dict[str, np.ndarray]] = [{k: np.array(v) for k, v in f.items()} for f in fragments]
        self.versions = list(versions)
        self.c_tok, self.c_steps = [0] * P, [0] * P
        self.residuals: list[dict[str, np.ndarray] | None] = [None] * P
        # per fragment: the pushes not known merged, oldest first (module docstring)
        self.pending_pushes: list[list[_PushRecord]] = [[] for _ in range(P)]
        self.tokens_per_step = stream.tokens_per_batch
        self.step_time = self.cycle_time = 0.0
        self.resyncs = 0  # rebase: pending pushes given up (see `install`)
        self.skipped = 0  # due pushes skipped while the last push of the fragment was in flight
        self.round_trip = Ema(0.8)  # steps from a push to the install of its merge
        # Blocking baselines (§9): after pushing p at step s, the merge is installed at step s + τ
        # exactly, and the learner waits for it there. Decoupled learners install on arrival.
        self.blocking = cfg.algorithm in BLOCKING_ALGORITHMS
        self.inbox: dict[int, Delivery] = {}
        self.outstanding: dict[int, int] = {}  # fragment → step of a push still awaiting its merge
        # sync.dynamic: per fragment the step its next push is due, and the step of its last push
        self.dynamic = cfg.sync.dynamic and not self.blocking and not self.dp
        H = cfg.sync.every
        self.next_due = [step + 1 + (plan.offset(p, H) - step - 1) % H for p in range(P)]
        self.pushed_at: list[int | None] = [None] * P

    @property
    def last_pushes(self) -> list[_PushRecord | None]:
        """Per fragment: the newest push not known merged, or None."""
        return [r[-1] if r else None for r in self.pending_pushes]

    @property
    def step_count(self) -> int:
        return self.state.step

    @property
    def cursor(self) -> Cursor:
        return self.stream.cursor

    def step(
        self, step_time: float | None = None, cycle_time: float | None = None
    ) -> tuple[dict[str, float], list[Push]]:
        """One inner AdamW step on the next batch; returns its metrics and the pushes now due.

        `step_time` is the caller's measure of seconds per step (wall or virtual clock); it
        travels in the pushes' metadata and feeds the syncer's ξ_step. `cycle_time` (seconds per
        step including waits for merges; default `step_time`) feeds the goodput accounting.
        """
        if step_time is not None:
            self.step_time = float(step_time)
        self.cycle_time = self.step_time if cycle_time is None else float(cycle_time)
        batch = inner.shard_batch(self.stream.next_batch(), self.mesh)
        grads = None
        if self.dp:
            grads, metrics = self._grad_step(self.state.params, batch)
            self.state = self.state._replace(step=self.state.step + 1)
        else:
            params, opt_state, metrics = self._train_step(
                self.state.params, self.state.opt_state, batch, self.state.step
            )
            self.state = inner.TrainState(params, opt_state, self.state.step + 1)
        for p in range(self.plan.count):
            self.c_tok[p] += self.tokens_per_step
            self.c_steps[p] += 1
        out = {k: float(v) for k, v in metrics.items()}
        pushes = []
        for p in self._due():
            if self._in_flight(p):
                self.skipped += 1
                continue
            push = self._push(p, grads)
            if push is None:
                out["diverged_fragment"] = p
            else:
                pushes.append(push)
        return out, pushes

    def _due(self) -> tuple[int, ...]:
        """The fragments whose push falls due after the step just taken (module docstring)."""
        t, H = self.state.step, self.cfg.sync.every
        if not self.dynamic:
            return self.plan.due(t, H)
        due = tuple(p for p in range(self.plan.count) if t >= self.next_due[p])
        for p in due:  # H steps on, unless the syncer says otherwise (`retime`)
            self.next_due[p] = t + H
        return due

    def retime(self, p: int, step: int, steps: int) -> None:
        """`sync.dynamic`: the syncer accepted this learner's push of fragment p sent at `step` and
        said its next push of p is due `steps` steps after it; a decision on an older push is ignored."""
        if self.dynamic and self.pushed_at[p] == step:
            self.next_due[p] = step + max(1, int(steps))

    def _push(self, p: int, grads=None) -> Push | None:
        theta = self.plan.extract(self.state.params, p)
        if grads is None:
            pseudo_grad = {n: self.anchors[p][n] - x for n, x in theta.items()}  # δ = anchor − θ
        else:
            pseudo_grad = self.plan.extract(grads, p)  # dp: the gradient itself
        if not all(np.isfinite(x).all() for x in (*theta.values(), *pseudo_grad.values())):
            # Local training diverged: nothing to send; restart this fragment from the global one.
            self._reset_fragment(p)
            return None
        cfg = self.cfg.compression
        payload, residual = {}, {}
        previous = self.residuals[p]
        for n, delta in pseudo_grad.items():
            e = previous[n] if (cfg.error_feedback and previous is not None) else None
            payload[n], residual[n] = compress.encode_with_feedback(delta, e, cfg.dtype, cfg.block, cfg.entropy)
        if cfg.error_feedback:
            self.residuals[p] = residual
        records = self.pending_pushes[p]
        records.append(
            _PushRecord(
                self.state.step,
                theta,
                self.c_tok[p],
                self.c_steps[p],
                self.versions[p],
                residual if cfg.error_feedback else None,
            )
        )
        if self.blocking:
            self.outstanding[p] = self.state.step
        self.pushed_at[p] = self.state.step
        meta = ContributionMeta(
            learner_id=self.learner_id,
            incarnation=self.incarnation,
            fragment_id=p,
            base_version=self.versions[p],
            tokens=self.c_tok[p],
            steps=self.c_steps[p],
            step=self.state.step,
            step_time=self.step_time,
            cursor=self.stream.cursor.to_dict(),
            cycle_time=self.cycle_time,
        )
        return Push(meta, payload)

    def flush(self) -> list[Push]:
        """A preemption notice: a push now, off schedule, of every fragment with progress since its
        anchor and no push in flight (one in flight: its merge comes first, or the new push would
        overlap it; flush again then). Decoupled learners only: blocking ones wait for merges anyway."""
        if self.blocking or self.dp:
            return []
        idle = [p for p, records in enumerate(self.pending_pushes) if self.c_steps[p] and not records]
        return [push for p in idle if (push := self._push(p)) is not None]

    def _in_flight(self, p: int) -> bool:
        """Whether a due push of p waits for the last one (decoupled learners; module docstring)."""
        records = self.pending_pushes[p]
        if self.blocking or self.dp or not records:
            return False
        if len(records) >= MAX_PENDING_PUSHES:
            return True
        rtt = self.round_trip.value
        if rtt is None or rtt <= self.cfg.sync.every:
            return False  # merges come back before the next push is due
        return self.state.step - records[-1].step < 2 * rtt

    def _reset_fragment(self, p: int) -> None:
        self.c_tok[p] = self.c_steps[p] = 0
        self.residuals[p] = None
        self.pending_pushes[p] = []
        anchor = inner.place(self.anchors[p], self.mesh, self.sharding)
        self.state = self.state._replace(params=self.plan.install(self.state.params, anchor))

    def receive(self, d: Delivery) -> bool:
        """Queues a merged fragment; `apply_inbox` installs it when its time has come.

        A `delta` delivery is resolved here against the newest copy this learner has of fragment
        p (queued or installed): Θ̂'_p = Θ̂_p + decode(q). Returns False when that copy is not at
        `version − 1` (a version was missed): the caller fetches Θ̂_p in full instead.
        """
        p = d.fragment_id
        if d.version <= self.versions[p]:
            return True
        old = self.inbox.get(p)
        if old is not None and d.version <= old.version:
            return True
        if d.delta is not None:
            base_version, base = (old.version, old.values) if old is not None else (self.versions[p], self.anchors[p])
            assert base is not None  # the inbox holds values: a delta is applied here, on arrival
            if base_version != (d.version - 1 if d.base_version is None else d.base_version):
                return False
            values = {n: base[n] + compress.decode(q) for n, q in d.delta.items()}
            d = Delivery(p, d.version, values, d.included_step)
        if old is not None and d.included_step is None:  # a newer merge still carries what the skipped one merged
            d = Delivery(p, d.version, d.values, old.included_step)
        self.inbox[p] = d
        return True

    def pending(self, in_flight: Iterable[Delivery] = ()) -> list[int | None]:
        """Per fragment: the step of its last push that no merge includes yet, installed, queued in
        the inbox or `in_flight` (sent to it, not yet received); None if none: what
        `learner.install: own` waits on (`dloco.publish.due`)."""
        out = [None if r is None else r.step for r in self.last_pushes]
        for d in [*self.inbox.values(), *in_flight]:
            s = out[d.fragment_id]
            if s is not None and d.included_step is not None and d.included_step >= s:
                out[d.fragment_id] = None
        return out

    def apply_inbox(self) -> list[int]:
        """Installs queued merges (blocking mode: only once step ≥ push step + τ); returns their ids."""
        done = []
        for p in sorted(self.inbox):
            s = self.outstanding.get(p)
            if s is not None and self.state.step < s + self.cfg.sync.overlap:
                continue
            d = self.inbox.pop(p)
            assert d.values is not None  # receive() applies a delta before queueing it
            self.install(p, d.version, d.values, d.included_step)
            self.outstanding.pop(p, None)
            done.append(p)
        return done

    def waiting_for(self) -> list[int]:
        """Blocking mode: fragments whose merge must be installed before the next step."""
        return [p for p, s in self.outstanding.items() if self.state.step >= s + self.cfg.sync.overlap]

    def install(
        self, fragment_id: int, version: int, values: Mapping[str, np.ndarray], included_step: int | None
    ) -> None:
        """Installs merged fragment Θ'_p of `version` by `learner.receive` (module docstring).

        `included_step` is the local step of this learner's last push merged into fragment p (by
        this or an earlier version), or None; a pending push counts as merged iff it is that one
        (any pending push, not only the newest: module docstring).
        """
        p = fragment_id
        if version <= self.versions[p]:
            return  # an older or repeated publish: nothing new to install
        mode, alpha = self.cfg.learner.receive, self.cfg.learner.blend_alpha
        records = self.pending_pushes[p]
        # The merge included one of the pending pushes, not necessarily the newest: with a round
        # trip longer than H steps the next push was sent before this merge came back. That later
        # push contains the included one, so the syncer rejects it (it overlaps a merged push):
        # it is dropped here too, and what it held beyond the included push stays in θ_p.
        hit = [i for i, r in enumerate(records) if included_step is not None and r.step == included_step]
        included = bool(hit)
        record = records[hit[0]] if included else (records[-1] if records else None)
        if included and record is not None:
            self.round_trip.update(self.state.step - record.step)
        # rebase keeps unmerged progress only while its push can still be merged: a push that
        # `syncer.max_staleness` newer versions did not include (rejected, lost or too stale) is
        # given up, or a rejected contribution would keep growing and be rejected forever.
        given_up = (
            mode == "rebase"
            and record is not None
            and not included
            and version - record.base_version > self.cfg.syncer.max_staleness
        )
        new: dict[str, np.ndarray]
        if mode == "overwrite":
            new = {n: np.asarray(v, np.float32) for n, v in values.items()}
        else:
            theta = self.plan.extract(self.state.params, p)
            if mode == "blend":
                new = {n: alpha * theta[n] + (1.0 - alpha) * values[n] for n in values}
            elif given_up:  # rebase, but the pending push can no longer be merged: resynchronize
                new = {n: np.asarray(v, np.float32) for n, v in values.items()}
            else:  # rebase
                base = record.theta if record is not None and included else self.anchors[p]
                new = {n: values[n] + (theta[n] - base[n]) for n in values}
        if mode != "rebase" or given_up:
            self.resyncs += given_up
            self.c_tok[p] = self.c_steps[p] = 0
            self.pending_pushes[p] = []
        elif record is not None and included:
            self.c_tok[p] -= record.tokens
            self.c_steps[p] -= record.steps
            if self.cfg.compression.error_feedback:
                self.residuals[p] = record.residual  # what the merged push left unsent, not a later one's
            self.pending_pushes[p] = []
        else:
            # The pending pushes may still be merged later: move their θ by the same shift as θ.
            for r in records:
                r.theta = {n: r.theta[n] + (values[n] - self.anchors[p][n]) for n in values}
        self.anchors[p] = {n: np.array(v, np.float32) for n, v in values.items()}
        self.versions[p] = version
        new = inner.place({n: np.asarray(v, np.float32) for n, v in new.items()}, self.mesh, self.sharding)
        self.state = self.state._replace(params=self.plan.install(self.state.params, new))
