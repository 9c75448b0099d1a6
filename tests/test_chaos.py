"""The seeded chaos schedule and per-step draws (dloco.chaos): reproducible, with the right rates."""

import numpy as np
import pytest

from dloco import chaos, config


def cfg(**kw):
    return config.ChaosConfig(**kw)


def test_same_seed_same_schedule_other_seed_another():
    c = cfg(seed=3, mtbf_s=50, freeze_mtbf_s=80, freeze_s=4, warmup_s=10, horizon_s=1000, syncer_kills_s=(30,))
    a, b = chaos.schedule(c, 6), chaos.schedule(c, 6)
    assert a == b and len(a) > 20
    other = chaos.schedule(config.ChaosConfig(**{**c.__dict__, "seed": 4}), 6)
    assert [f.at for f in other] != [f.at for f in a]
    # adding a learner adds its faults and leaves every other learner's faults where they were
    more = chaos.schedule(c, 7)
    assert [f for f in more if f.target != "learner-6"] == a


def test_schedule_is_sorted_respects_warmup_and_horizon_and_lists_the_kills():
    c = cfg(mtbf_s=20, freeze_mtbf_s=30, warmup_s=15, horizon_s=300, syncer_kills_s=(40, 400), store_kills_s=(60,))
    s = chaos.schedule(c, 3)
    assert [f.at for f in s] == sorted(f.at for f in s)
    learner_faults = [f for f in s if f.target.startswith("learner-")]
    assert min(f.at for f in learner_faults) > 15 and max(f.at for f in s) < 300
    assert [(f.at, f.kind) for f in s if f.target == "syncer"] == [(40.0, "kill")]  # 400 is past the horizon
    assert [(f.at, f.kind) for f in s if f.target == "store"] == [(60.0, "kill")]
    assert {f.kind for f in learner_faults} == {"kill", "freeze"}
    assert all(f.duration == 5.0 for f in learner_faults if f.kind == "freeze")


def test_kill_gaps_are_exponential_with_the_configured_mean():
    c = cfg(seed=1, mtbf_s=10, horizon_s=200_000)
    times = [f.at for f in chaos.schedule(c, 1)]
    gaps = np.diff([0.0, *times])
    assert len(gaps) > 15_000
    assert gaps.mean() == pytest.approx(10, rel=0.03)
    assert np.std(gaps) == pytest.approx(10, rel=0.05)  # exponential: std = mean
    assert chaos.expected_failures(c, 4, 100.0) == pytest.approx(40.0)


def test_freezes_of_one_learner_never_overlap():
    c = cfg(seed=2, freeze_mtbf_s=3, freeze_s=2, horizon_s=5000)
    s = chaos.schedule(c, 1)
    starts = [f.at for f in s]
    assert all(b - a >= 2.0 for a, b in zip(starts, starts[1:], strict=False))
    # mean gap = freeze_s + freeze_mtbf_s
    assert np.mean(np.diff(starts)) == pytest.approx(5.0, rel=0.05)


def test_stragglers_and_step_factors():
    c = cfg(seed=5, stragglers=3, straggler_factor=1.5, jitter=0.4)
    s = chaos.stragglers(c, 8)
    assert len(s) == 3 and s <= set(range(8)) and s == chaos.stragglers(c, 8)
    assert chaos.stragglers(cfg(stragglers=10), 4) == frozenset(range(4))
    assert chaos.stragglers(cfg(), 4) == frozenset()
    f = [chaos.step_factor(c, 0, t, straggler=True) for t in range(2000)]
    g = [chaos.step_factor(c, 0, t, straggler=False) for t in range(2000)]
    assert min(f) >= 1.5 and max(f) <= 1.5 * 1.4 and np.mean(f) == pytest.approx(1.5 * 1.2, rel=0.02)
    assert min(g) >= 1.0 and max(g) <= 1.4
    assert f == [chaos.step_factor(c, 0, t, straggler=True) for t in range(2000)]  # seeded per step
    assert chaos.step_factor(cfg(), 0, 7, straggler=False) == 1.0


def test_payload_loss_rate_and_determinism():
    c = cfg(seed=9, payload_loss=0.2)
    draws = [chaos.payload_lost(c, m, 1, t, p) for m in range(4) for t in range(500) for p in range(2)]
    assert np.mean(draws) == pytest.approx(0.2, abs=0.02)
    assert draws == [chaos.payload_lost(c, m, 1, t, p) for m in range(4) for t in range(500) for p in range(2)]
    assert not any(chaos.payload_lost(cfg(), 0, 1, t, 0) for t in range(100))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("chaos.mtbf_s=-1", "chaos.mtbf_s"),
        ("chaos.payload_loss=1.0", "chaos.payload_loss"),
        ("chaos.straggler_factor=0.5", "chaos.straggler_factor"),
        ("chaos.freeze_s=0", "chaos.freeze_s"),
        ("chaos.syncer_kills_s=[10, -1]", "chaos.syncer_kills_s"),
        ("chaos.store_kills_s=5", "chaos.store_kills_s"),
    ],
)
def test_bad_chaos_config_names_the_field(override, field):
    with pytest.raises(config.ConfigError, match=field.replace(".", r"\.")):
        config.load(overrides=(override,))
