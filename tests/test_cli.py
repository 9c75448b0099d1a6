"""`dloco train`: bad input gets one clear line and a non-zero exit; a real run ends with its table."""

import json
import subprocess
import sys

import pytest


def dloco(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "actors.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("train", "--set", "sync.overlap=6"), "dloco: config error: sync.overlap=6 is invalid"),
        (("train", "--set", "data.source=text:/nonexistent/*.txt"), "matches no files"),
        (("train", "--address", "127.0.0.1:1"), "dloco: cannot reach the Ray cluster at 127.0.0.1:1"),
        (("train", "--config", "/nonexistent.yaml"), "No such file"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, message):
    out = dloco(*args)
    assert out.returncode == 2
    assert message in out.stderr
    lines = [x for x in out.stderr.strip().splitlines() if not x.startswith("preparing the corpus: ")]
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr  # a cold corpus cache adds progress


def test_corpus_preparation_shows_a_line_per_stage_when_not_on_a_terminal(capsys):
    from actors import cli
    from dloco import config

    show = cli._progress(config.load())
    for done in (0, 400, 1000):
        show({"preparing": "reading", "done": done, "total": 1000})
    show({"preparing": "tokenizing", "done": 512, "total": 1000})
    show({"preparing": "tokenizing", "done": 1000, "total": 1000})
    assert capsys.readouterr().err.splitlines() == [
        "preparing the corpus: reading 1,000/1,000 done",
        "preparing the corpus: tokenizing 1,000/1,000 done",
    ]


def test_existing_run_dir_needs_resume(tmp_path):
    (tmp_path / "store").mkdir()
    out = dloco("train", "--run-dir", str(tmp_path))
    assert out.returncode == 2 and "pass --resume" in out.stderr


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_train_end_to_end(tmp_path, tiny_run):
    args = ["train", "--run-dir", str(tmp_path / "run"), "--quiet"]
    for kv in (
        *tiny_run,
        "learners.count=2",
        "learners.num_cpus=0.5",
        "budget.tokens=30000",
        "metrics.eval_every_s=5",
    ):
        args += ["--set", kv]
    out = dloco(*args, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "eval loss" in out.stdout and "merges" in out.stdout and "wall time" in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens_trained"] >= 30000 and summary["merges"] > 0
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"merge", "eval", "learner_start", "store_start", "syncer_start"} <= kinds
    merge = next(e for e in events if e["event"] == "merge")
    for key in (
        "fragment",
        "version",
        "contributors",
        "weights",
        "staleness",
        "grace_s",
        "slack_s",
        "bytes_in",
        "bytes_out",
        "time",
    ):
        assert key in merge
    assert (tmp_path / "run" / "config.json").exists()
