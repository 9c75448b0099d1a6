"""`dloco plot`: PNG figures from launcher-shaped run directories; one line and exit 2 on bad input."""

import struct

import pytest
from synthetic_runs import make_run

from actors.cli import main
from dloco import metrics, plot

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def two_runs(tmp_path):
    a, b = tmp_path / "runs" / "k1-m2", tmp_path / "runs" / "k1-m4"
    make_run(a, learners=2, fragments=2)
    make_run(b, learners=4, fragments=4, seconds=30.0)
    return a, b


def test_plot_two_runs_writes_valid_pngs(two_runs, tmp_path, capsys):
    out = tmp_path / "figs"
    assert main(["plot", str(two_runs[0]), str(two_runs[1]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    names = {"eval_loss.png", "goodput.png", "wire.png", "fragments_k1-m2.png", "fragments_k1-m4.png"}
    assert {p.rsplit("/", 1)[-1] for p in printed} == names
    for name in names:
        path = out / name
        assert path.is_file() and str(path) in printed
        w, h = png_size(path)
        assert w >= 500 and h >= 300
        assert path.stat().st_size > 20_000  # lines, legends and labels, not a blank canvas


def test_default_out_dir(two_runs):
    assert main(["plot", str(two_runs[0])]) == 0
    assert (two_runs[0] / "plots" / "eval_loss.png").is_file()
    assert main(["plot", *map(str, two_runs)]) == 0
    assert (two_runs[0].parent / "plots" / "goodput.png").is_file()  # the runs' common parent


def test_series_follow_the_accounting(two_runs):
    run = plot.load_run(two_runs[0])
    assert [e["t"] for e in run.events] == sorted(e["t"] for e in run.events)  # file order is not time order
    merges = run.of("merge")
    _, merged = plot.merged_series(run)
    per_learner = metrics.learner_time(run.events, run.events[-1]["time"], run.fragments)
    assert merged[-1] == pytest.approx(sum(v["merged_tokens"] for v in per_learner.values()))
    # every push after a learner's first covers H new steps: at most the ledger's Σ c_tok / P
    assert 0.9 * sum(sum(e["tokens"]) for e in merges) / 2 <= merged[-1] <= sum(sum(e["tokens"]) for e in merges) / 2
    _, bi, bo = plot.wire_series(run)
    assert bi[-1] == sum(e["bytes_in"] for e in merges) and bo[-1] == sum(e["bytes_out"] for e in merges)
    t, ratio = plot.goodput_series(run)  # no goodput events in this run: the token ratio
    assert ratio and all(0 <= r <= 1.0 for r in ratio)
    run.events.append({"event": "goodput", "t": 50.0, "time": 50.0, "goodput": 0.8, "uptime": 1.0})
    assert plot.goodput_series(run) == ([50.0], [0.8])  # a run's goodput events take precedence
    assert run.label == "k1-m2 (decoupled, M=2)"


def test_dir_without_metrics_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dloco: {tmp_path / 'empty'}: no metrics.jsonl (not a dloco run directory)"]


def test_malformed_metrics_is_one_line_exit_2(tmp_path, capsys):
    run = tmp_path / "bad"
    make_run(run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    assert main(["plot", str(run)]) == 2
    assert "metrics.jsonl:2: not a JSON event" in capsys.readouterr().err


def test_a_partial_last_line_of_a_running_run_is_ignored(tmp_path):
    run = tmp_path / "live"
    n = sum(e["event"] == "merge" for e in make_run(run))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"event": "merge", "fragm')
    assert len(plot.load_run(run).of("merge")) == n
    assert plot.plot([run], tmp_path / "o")
