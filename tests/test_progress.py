"""The progress display: share of each budget kind, tokens/s and ETA over a window, the plain-line
pace off a terminal. Statuses are hand-made `RunHandle.status()` snapshots on a virtual clock."""

import pytest

from dloco.config import BudgetConfig
from dloco.progress import ProgressLine, done_fraction, duration


def status(t, tokens, steps=(), loss=None, **extra):
    return {
        "elapsed_s": t,
        "tokens_trained": tokens,
        "learners": {m: {"step": s} for m, s in enumerate(steps)},
        "eval_loss": loss,
        "merges": 0,
        "rejected": 0,
        "errors": {},
        **extra,
    }


def test_the_share_done_follows_whichever_budget_ends_the_run_first():
    # tokens only: 100k of 400k
    assert done_fraction(status(50, 100_000), BudgetConfig(tokens=400_000), 2) == 0.25
    # time only (the README's chaos command): 30 s of 120 s, whatever the tokens
    assert done_fraction(status(30, 10**9), BudgetConfig(tokens=0, seconds=120), 2) == 0.25
    # steps: every learner must get there, so the slowest counts; a learner not yet reporting is at 0
    assert done_fraction(status(9, 0, steps=(40, 10)), BudgetConfig(tokens=0, steps=100), 2) == 0.10
    assert done_fraction(status(9, 0, steps=(40,)), BudgetConfig(tokens=0, steps=100), 2) == 0.0
    # several: the one furthest along ends the run; never above 1
    assert done_fraction(status(90, 100_000), BudgetConfig(tokens=400_000, seconds=100), 1) == 0.9
    assert done_fraction(status(200, 100_000), BudgetConfig(tokens=400_000, seconds=100), 1) == 1.0


def test_durations_read_like_a_clock():
    assert [duration(s) for s in (0, 44.6, 60, 725, 3600, 10_920)] == ["0s", "45s", "1m00s", "12m05s", "1h00m", "3h02m"]


def test_tokens_per_second_and_eta_over_the_window_not_the_start_up():
    line = ProgressLine(BudgetConfig(tokens=400_000), 4, tty=True)
    assert line(status(20.0, 0)).startswith("[------------------------------]   0.0%  tokens 0  -- tok/s  ETA --")
    line(status(25.0, 10_000))  # 25 s of start-up (compile) before the first token: not the pace
    text = line(status(35.0, 30_000, loss=3.25))  # 20,000 tokens in 10 s
    assert text.startswith("[##" + "-" * 28 + "]   7.5%")
    assert "2,000 tok/s" in text and "ETA 3m05s" in text and "eval 3.250" in text and text.endswith("35s")
    # the window keeps the last 30 s: a slowdown shows within it
    for t in range(36, 100):
        text = line(status(float(t), 30_000 + (t - 35) * 1_000))
    assert "1,000 tok/s" in text  # 370,000 tokens left at 1,000/s
    assert "ETA 5m06s" in text


def test_a_time_budget_counts_down_at_its_own_pace():
    line = ProgressLine(BudgetConfig(tokens=0, seconds=120), 2, tty=True)
    line(status(10.0, 1_000))
    text = line(status(30.0, 41_000))
    assert " 25.0%" in text and "2,000 tok/s" in text and "ETA 1m30s" in text


def test_a_step_budget():
    line = ProgressLine(BudgetConfig(tokens=0, steps=200), 2, tty=True)
    line(status(10.0, 1_000, steps=(10, 10)))
    assert " 50.0%" in (text := line(status(20.0, 2_000, steps=(120, 100)))) and "ETA 11s" in text


def test_off_a_terminal_a_plain_line_every_ten_seconds_with_errors_named():
    line = ProgressLine(BudgetConfig(tokens=1_000_000), 1, tty=False)
    shown = [t for t in range(0, 35) if line(status(float(t), 1_000 * t))]
    assert shown == [0, 10, 20, 30]
    text = line(status(40.0, 40_000, errors={"learner-1": 2}, last_error="ValueError: disk"))
    assert "ERRORS 2 (last: ValueError: disk)" in text and "\r" not in text


@pytest.mark.parametrize("tty", [True, False])
def test_the_cli_writes_lines_in_place_on_a_terminal_and_plainly_otherwise(tty, monkeypatch, capsys):
    import sys

    from actors import cli
    from dloco import config

    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    show = cli._progress(config.load(overrides=("budget.tokens=1000",)))
    show(status(1.0, 100))
    show(status(2.0, 300))
    err = capsys.readouterr().err
    if tty:
        assert err.count("\r") == 2 and "\n" not in err and " 30.0%" in err
    else:
        assert err.count("\n") == 1 and "\r" not in err and " 10.0%" in err
