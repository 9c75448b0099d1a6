"""`dloco.result.Result`: a run read back from its run directory, as Ray Train's ``Result``.

A finished run (a real one on a local Ray cluster, and a synthetic one) reads back its summary as
``metrics`` and the newest checkpoint it wrote as ``checkpoint``; a running one its live status; a
failed one its error; ``RunHandle.wait()`` returns the same `Result` that ``Result.from_path`` reads.
"""

import json
import os
import socket

import pytest
from synthetic_runs import make_run

from dloco import checkpoints, config, control, export
from dloco.result import Result

T = 1_796_000_000.0  # wall time the status files are written at


def status(error=None, done=False):
    """A status as `RunHandle.status()` returns it."""
    return {
        "elapsed_s": 12.5,
        "tokens_trained": 24_576,
        "budget_tokens": 400_000,
        "merges": 7,
        "rejected": 0,
        "eval_loss": 5.25,
        "learners": {"0": {"step": 96}, "1": {"step": 92}},
        "errors": {},
        "last_error": None,
        "error": error,
        "done": done,
    }


def test_a_finished_run_reads_back_its_summary_as_metrics(tmp_path):
    make_run(tmp_path / "run")
    r = Result.from_path(tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert r == Result(metrics=summary, path=tmp_path / "run", checkpoint=None, error=None, state="ended")
    assert r.metrics["merges"] == summary["merges"] and r.metrics["eval_loss_end"] == summary["eval_loss_end"]


def test_the_checkpoint_is_the_newest_complete_one_the_run_wrote(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    assert Result.from_path(run).checkpoint is None  # no export.every_commits / every_s: none
    cps = run / "checkpoints"
    for name in ("commit-00000004", "commit-9", "commit-00000012", "tmp-x1y2", "commit-00000016.old"):
        (cps / name).mkdir(parents=True)
    (cps / "commit-00000020").write_text("")  # not a directory: no checkpoint
    # by commit number (9 < 12 whatever the padding); tmp-* is one being written
    assert Result.from_path(run).checkpoint == cps / "commit-00000012" == checkpoints.newest(run)


def test_a_running_run_reads_its_live_status(tmp_path):
    control.publish(tmp_path, status(), now=T)
    r = Result.from_path(tmp_path, now=T + 1.0)
    live = {**status(), "updated": T, "pid": os.getpid(), "host": socket.gethostname()}
    assert r == Result(metrics=live, path=tmp_path, checkpoint=None, error=None, state="running")
    # the driver stopped writing its status 31 s ago and left no summary
    assert Result.from_path(tmp_path, now=T + 31.0).state == "not answering"
    assert Result.from_path(tmp_path, stale_s=60.0, now=T + 31.0).state == "running"


def test_a_resumed_run_that_runs_again_is_running_not_its_old_summary(tmp_path):
    make_run(tmp_path)
    os.utime(tmp_path / "summary.json", (T - 60.0, T - 60.0))  # the first start ended a minute ago
    control.publish(tmp_path, status(), now=T)  # the resume is running
    r = Result.from_path(tmp_path, now=T + 1.0)
    assert (r.state, r.metrics["merges"], r.metrics["updated"]) == ("running", 7, T)


def test_a_failed_run_reads_its_error_from_the_summary_or_the_status(tmp_path):
    why = "commits have failed for 8.0 s (store.fail_after_s=8): OSError: [Errno 28] No space left on device"
    make_run(tmp_path / "ended")
    summary = json.loads((tmp_path / "ended" / "summary.json").read_text())
    (tmp_path / "ended" / "summary.json").write_text(json.dumps({**summary, "error": why}))
    r = Result.from_path(tmp_path / "ended")
    assert (r.state, r.error, r.metrics["error"]) == ("ended", why, why)
    # a run whose driver has decided to end on an error and is winding down: running, with it
    (tmp_path / "ending").mkdir()
    control.publish(tmp_path / "ending", status(error=why), now=T)
    r = Result.from_path(tmp_path / "ending", now=T + 1.0)
    assert (r.state, r.error) == ("running", why)


def test_no_run_there_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no dloco run here"):
        Result.from_path(tmp_path)


def test_ended_is_what_summary_json_holds(tmp_path):
    """`RunHandle.wait` builds its `Result` from the summary in memory (learner ids as ints):
    its metrics are the file's (ids as strings), so it equals what `from_path` reads."""
    summary = {"learner_time": {0: {"merged": 1.5}}, "error": None, "run_dir": tmp_path, "eval_loss_end": 4.25}
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    r = Result.ended(tmp_path, summary)
    assert r.metrics == {
        "learner_time": {"0": {"merged": 1.5}},
        "error": None,
        "run_dir": str(tmp_path),
        "eval_loss_end": 4.25,
    }
    assert r == Result.from_path(tmp_path)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_wait_returns_the_result_that_from_path_reads_of_a_real_finished_run(ray_cluster, tiny_run, tmp_path):
    """A short run on a local Ray cluster: 2 learners, 24 steps each, a checkpoint every 2 commits.
    ``wait()`` returns its `Result`; ``Result.from_path`` on the finished run dir reads the same:
    the summary as metrics, no error, the newest checkpoint, which loads as the cut of its commit."""
    from actors.launch import start

    steps, M = 24, 2
    cfg = config.load(
        overrides=(
            *tiny_run,
            f"learners.count={M}",
            "learners.num_cpus=0.5",
            "budget.tokens=0",
            f"budget.steps={steps}",
            "metrics.eval_every_s=1000",
            "export.every_commits=2",
        )
    )
    run_dir = tmp_path / "run"
    with start(cfg, run_dir=run_dir) as h:
        result = h.wait(timeout=180)
    assert result is not None, h.status()
    newest = checkpoints.newest(run_dir)
    assert newest is not None and newest.parent == run_dir / "checkpoints"
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert result == Result(metrics=on_disk, path=run_dir, checkpoint=newest, error=None, state="ended")
    assert Result.from_path(run_dir) == result
    per_step = cfg.inner.batch_size * cfg.data.seq_len
    assert result.metrics["tokens_trained"] == M * steps * per_step == 2 * 24 * 4 * 32
    assert result.metrics["run_dir"] == str(run_dir) and result.metrics["merges"] > 0
    # the checkpoint after commit n: every fragment at its version then (n commits in all)
    n = int(newest.name.removeprefix("commit-"))
    meta = json.loads((newest / "dloco.json").read_text())
    assert meta["commits"] == n == sum(meta["versions"]) and n % 2 == 0
    assert n <= sum(result.metrics["versions"]) and export.load(newest).versions == meta["versions"]
