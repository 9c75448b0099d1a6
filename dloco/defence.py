"""What keeps bad input out of the global model (ALGORITHM.md §5, §6): the checks a closed round's
pushes pass before they are merged (`screen`), and the check of the merged result before it is
committed (`check_commit`). `dloco.syncer.SyncerCore.merge` runs both.

Two bounds come from what one inner AdamW step can do, so they hold from the first push on,
before the syncer has any history of accepted norms (ALGORITHM.md §5):

```
A_p = η_in·(U·√n_p + λ·‖Θ_p‖),   U = max(1, (1 − β1)/√(1 − β2))
```

n_p parameters of fragment p, η_in = `inner.lr` (the schedule's peak), λ = `inner.weight_decay`.
AdamW moves a parameter by η_t·(m̂/(√v̂ + ε) + λ·θ), and |m̂/√v̂| ≤ U (Kingma & Ba 2015, §2.1),
so one step moves Θ_p by at most A_p (taking the learner's ‖θ_p‖ as ‖Θ_p‖). With ρ =
`syncer.max_norm_ratio`:

- contribution (`contribution_bound`): during the outlier check's warm-up (fewer than
  `syncer.norm_warmup` norms recorded: a fresh run, or a run directory from before the history
  was kept), a push whose per-step norm ‖δ‖ / c_steps exceeds ρ·A_p is rejected. Measured in
  process (`dloco.sim.run_local`, 48 steps, every push): the largest per-step norm was 0.81·A_p
  (`micro`, H = 8, P = 2), 0.69·A_p (`micro` defaults), 0.64·A_p (`tiny`), 1.64·A_p (`micro`,
  M = 8, int2, `receive: blend`: error feedback and blending add to δ); ρ = 10 leaves ≥ 6×.
  Not for dp, whose contributions are gradients: its outer AdamW clips and normalizes them.
- commit (`check_commit`): Θ_p and s_p after the outer step must be finite, and
  ‖ΔΘ_p‖ ≤ ρ·(‖Θ_p‖ + H·(A_p + s)), s the largest per-step norm ‖δ_m‖ / c_steps among the round's
  accepted pushes: a commit may move a fragment by ρ times its own norm plus a sync period of H
  steps at the pace of AdamW's bound and of its fastest contribution. Measured, the largest honest
  ‖ΔΘ_p‖ / (‖Θ_p‖ + H·A_p) (s left out) was 0.37 (`micro`), 0.45 (`micro` defaults), 0.51
  (M = 8, int2, blend), 0.59 (η = 0.7, μ = 0.9, Delayed or per-commit Nesterov), 0.014 (dp,
  H = 1). The bound scales with neither η nor a push's raw norm: a huge `outer.lr`, or a finite
  but enormous δ claiming many steps, is refused here even if it passed every check before.

Neither bound changes a value: a round that breaks none is merged exactly as without them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dloco import compress, events
from dloco.config import DP_ALGORITHMS, RunConfig
from dloco.policy import ContributionMeta, Decision, NormTracker, check_values
from dloco.policy.checks import INT_FIELDS, is_int


def norm(arrays: Iterable[Any]) -> float:
    """‖x‖ over all the arrays, in float64 (inf if any value is not finite; never raises)."""
    with np.errstate(over="ignore", invalid="ignore"):
        sq = sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in arrays)
    return math.sqrt(sq) if math.isfinite(sq) else math.inf


def adam_step_bound(cfg: RunConfig, size: int, theta_norm: float) -> float:
    """A_p = η_in·(U·√n + λ·‖Θ_p‖): the most one inner AdamW step moves `size` parameters."""
    i = cfg.inner
    u = max(1.0, (1.0 - i.b1) / math.sqrt(1.0 - i.b2))
    return i.lr * (u * math.sqrt(size) + i.weight_decay * theta_norm)


def contribution_bound(cfg: RunConfig, size: int, theta_norm: float) -> float | None:
    """ρ·A_p, the largest per-step norm accepted during the outlier check's warm-up; None for dp."""
    if cfg.algorithm in DP_ALGORITHMS:
        return None
    return cfg.syncer.max_norm_ratio * adam_step_bound(cfg, size, theta_norm)


def change_bound(cfg: RunConfig, size: int, theta_norm: float, step_norm: float) -> float:
    """ρ·(‖Θ_p‖ + H·(A_p + s)), s the round's largest accepted per-step norm: the largest ‖ΔΘ_p‖ a commit may make."""
    pace = adam_step_bound(cfg, size, theta_norm) + step_norm
    return cfg.syncer.max_norm_ratio * (theta_norm + cfg.sync.every * pace)


def check_commit(
    cfg: RunConfig,
    size: int,
    old: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    state: list[np.ndarray],
    step_norms: Iterable[float],
) -> str | None:
    """Why a merged Θ_p (`new`, from `old`) with outer state `state` must not be committed, or None.

    `step_norms` are the per-step norms ‖δ_m‖ / c_steps of the round's accepted pushes.
    """
    for kind, arrays in (("Θ_p", new.items()), ("outer state", enumerate(state))):
        bad = [str(k) for k, x in arrays if not np.isfinite(np.asarray(x)).all()]
        if bad:
            return f"non-finite {kind}: {', '.join(bad)}"
    theta, fastest = norm(old.values()), max(step_norms, default=0.0)
    change = norm(np.asarray(new[k], np.float64) - np.asarray(old[k], np.float64) for k in old)
    limit = change_bound(cfg, size, theta, fastest)
    if change > limit:
        return (
            f"implausible change: ‖ΔΘ_p‖ {change:.6g} > max_norm_ratio × (‖Θ_p‖ {theta:.6g} + H × (AdamW step "
            f"bound {adam_step_bound(cfg, size, theta):.6g} + largest per-step norm {fastest:.6g})) = {limit:.6g}"
        )
    return None


@dataclass
class Screened:
    """A closed round after `screen`: the accepted pushes (meta, δ as its checked payloads, per-tensor
    ‖δ‖) and the rest. The payloads stay packed: `merge` decodes them chunk by chunk as it sums."""

    metas: list[ContributionMeta] = field(default_factory=list)
    deltas: list[dict[str, compress.Payload]] = field(default_factory=list)
    norms: list[dict[str, float]] = field(default_factory=list)
    rejections: list[dict[str, Any]] = field(default_factory=list)
    nbytes_in: int = 0


def screen(
    items: list[tuple[ContributionMeta, dict[str, compress.Payload] | None]],
    *,
    expected: Mapping[str, tuple],
    check: Callable[[ContributionMeta], Decision],
    norms: NormTracker,
    max_norm_ratio: float,
    bound: float | None,
    lost: Callable[[ContributionMeta], str] | None = None,
) -> Screened:
    """A closed round's pushes through the checks at close (ALGORITHM.md §5), in order.

    A payload of None was lost (`lost` names why); `check` re-checks the metadata (v_p may have
    moved since the push); then the payloads' structure (any failure: malformed), shapes, ‖δ‖² read
    from the codes (`compress.sq_norm`: non-finite if a scale or value is), and
    the per-step norm ‖δ‖ / c_steps against the outlier median or, without one, `bound`.

    The outlier check compares per-step norms ‖δ‖ / c_steps. A raw ‖δ‖ grows with the steps a
    push covers, and a fragment's first pushes cover only its send offset o_p, in lr warmup:
    measured (M = 8, mini model), the first median of fragment 1 (o_1 = 6 steps) was so
    small that every later push of it was a "norm outlier", so fragment 1 never moved again
    and the rejected pushes kept growing (the median only learns from accepted norms).
    """
    out = Screened()
    for meta, payload in items:
        reason, delta = None, None
        if payload is None:
            reason = lost(meta) if lost else "payload lost"
        else:
            d = check(meta)
            if d.accept:
                try:
                    delta = {n: compress.validate(x) for n, x in payload.items()}
                    with np.errstate(over="ignore", invalid="ignore"):
                        tn = {n: math.sqrt(compress.sq_norm(x)) for n, x in delta.items()}
                except Exception as e:  # noqa: BLE001 - any undecodable payload is rejected, never merged
                    reason, delta = f"malformed payload: {e}", None
            if delta is not None:
                d = check_values(
                    expected_shapes=expected,
                    shapes={n: x.shape for n, x in delta.items()},
                    sq_norm=float(sum(v * v for v in tn.values())) / max(meta.steps, 1) ** 2,
                    norms=norms,
                    max_norm_ratio=max_norm_ratio,
                    bound=bound,
                )
            if not d.accept:
                reason = d.reason
        if reason is not None:
            out.rejections.append(rejection(meta, reason))
            continue
        assert payload is not None and delta is not None  # no reason: fetched, decoded and accepted
        out.metas.append(meta)
        out.deltas.append(delta)
        out.norms.append(tn)
        out.nbytes_in += sum(x.nbytes for x in payload.values())
    return out


def rejection(meta: ContributionMeta, reason: str, time: float | None = None) -> dict[str, Any]:
    """The ``rejection`` event of a contribution (time: set by the caller's clock). An id or step
    that is not an int within int64 (a malformed push, `check_fields`) is written as -1, so the
    event stays valid JSON; `reason` names the value."""
    ids = {k: getattr(meta, k) if is_int(getattr(meta, k)) else -1 for k in INT_FIELDS}
    return events.Rejection(
        time=time,
        fragment=ids["fragment_id"],
        learner=ids["learner_id"],
        incarnation=ids["incarnation"],
        step=ids["step"],
        base_version=ids["base_version"],
        reason=reason,
    ).to_dict()
