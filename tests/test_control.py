"""`dloco status` / `dloco stop` through the run directory (`dloco.control`), on a virtual clock;
the Ray end-to-end use is in tests/test_ray_run.py (the SIGTERM test stops its run this way)."""

import json
import os

import pytest

from actors.cli import main
from dloco import control

STATUS = {"elapsed_s": 42.0, "tokens_trained": 12_345, "budget_tokens": 400_000, "merges": 7, "rejected": 1,
          "eval_loss": 3.5, "learners": {0: {"step": 3}, 1: {"step": 4}}, "errors": {}, "last_error": None}  # fmt: skip


def test_status_is_written_every_two_seconds_and_read_back_with_its_state(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "_last", {})
    assert control.publish(tmp_path, STATUS, now=1000.0)
    assert not control.publish(tmp_path, {**STATUS, "merges": 8}, now=1001.9)  # within EVERY_S: skipped
    assert control.publish(tmp_path, {**STATUS, "merges": 9}, now=1002.0)
    s = control.read(tmp_path, now=1010.0)
    assert (s["state"], s["merges"], s["updated"], s["pid"]) == ("running", 9, 1002.0, os.getpid())
    assert s["learners"] == {"0": {"step": 3}, "1": {"step": 4}}  # JSON keys
    assert control.read(tmp_path, now=1032.0)["state"] == "not answering"  # 30 s without an update
    (tmp_path / "summary.json").write_text(json.dumps({"merges": 11, "run_dir": str(tmp_path)}))
    assert control.read(tmp_path, now=1032.0) == {"state": "ended", "merges": 11, "run_dir": str(tmp_path)}
    os.utime(tmp_path / "summary.json", (1.0, 1.0))  # older than the status: a resumed run is running again
    assert control.read(tmp_path, now=1003.0)["state"] == "running"
    with pytest.raises(FileNotFoundError):
        control.read(tmp_path / "nothing")


def test_a_stop_request_counts_for_runs_started_before_it_only(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "_last", {})
    with pytest.raises(FileNotFoundError):
        control.request_stop(tmp_path)  # no run here
    control.publish(tmp_path, STATUS, now=5.0)
    assert not control.stop_requested(tmp_path, since=0.0)
    control.request_stop(tmp_path)
    made = (tmp_path / "stop-requested").stat().st_mtime
    assert control.stop_requested(tmp_path, since=made - 10) and not control.stop_requested(tmp_path, since=made + 1)
    (tmp_path / "summary.json").write_text("{}")  # newer than status.json: ended
    with pytest.raises(ValueError, match="the run has ended already"):
        control.request_stop(tmp_path)


def test_the_commands_print_the_state_and_refuse_a_directory_without_a_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(control, "_last", {})
    control.publish(tmp_path, STATUS)
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"state      running (driver pid {os.getpid()}" in out and "tokens     12,345 of 400,000" in out
    assert "merges     7 (rejected contributions: 1)" in out and "learners   2 reporting" in out
    assert main(["stop", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dloco: ") and "no running dloco run here" in err and len(err.splitlines()) == 1
    assert main(["stop", str(tmp_path), "--wait", "0.2"]) == 1  # nobody acts on the request here
    assert "no summary within 0.2 s" in capsys.readouterr().err
