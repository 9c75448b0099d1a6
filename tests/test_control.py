"""`dloco status` / `dloco stop` through the run directory (`dloco.control`), on a virtual clock;
the Ray end-to-end use is in tests/test_ray_run.py (the SIGTERM test stops its run this way)."""

import json
import os

import pytest

from actors.cli import main
from dloco import control

STATUS = {
    "elapsed_s": 42.0,
    "tokens_trained": 12_345,
    "budget_tokens": 400_000,
    "merges": 7,
    "rejected": 1,
    "eval_loss": 3.5,
    "learners": {0: {"step": 3}, 1: {"step": 4}},
    "errors": {},
    "last_error": None,
}


def test_the_status_is_read_back_with_its_state(tmp_path):
    control.publish(tmp_path, STATUS, now=1000.0)
    control.publish(tmp_path, {**STATUS, "merges": 9}, now=1002.0)  # rewritten in place
    s = control.read(tmp_path, now=1010.0)
    assert (s["state"], s["merges"], s["updated"], s["pid"]) == ("running", 9, 1002.0, os.getpid())
    assert s["learners"] == {"0": {"step": 3}, "1": {"step": 4}}  # JSON keys
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary file left
    assert control.read(tmp_path, now=1032.0)["state"] == "not answering"  # 30 s without an update
    (tmp_path / "summary.json").write_text(json.dumps({"merges": 11, "run_dir": str(tmp_path)}))
    assert control.read(tmp_path, now=1032.0) == {"state": "ended", "merges": 11, "run_dir": str(tmp_path)}
    os.utime(tmp_path / "summary.json", (1.0, 1.0))  # older than the status: a resumed run is running again
    assert control.read(tmp_path, now=1003.0)["state"] == "running"
    with pytest.raises(FileNotFoundError):
        control.read(tmp_path / "nothing")


def test_a_stop_request_counts_for_runs_started_before_it_only(tmp_path):
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


def test_the_commands_print_the_state_and_refuse_a_directory_without_a_run(tmp_path, capsys):
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


class _Handle:
    """What `actors.observe.Observer.tick` reads of a `RunHandle`."""

    def __init__(self, run_dir):
        import threading
        import time

        from dloco.tally import Tally

        self.run_dir, self.started, self._lock = run_dir, time.time() - 5, threading.Lock()
        self.tally = Tally(2, 30.0, self.started)

    def status(self):
        return {**STATUS, "learners": {0: {"bytes_out": 10, "bytes_in": 30}}}


def test_the_observer_keeps_the_run_going_when_the_status_file_cannot_be_written(tmp_path, monkeypatch):
    """`Observer.tick` (the driver, every 2 s): a run dir that cannot take status.json (full, read
    only) leaves `dloco status` stale but the run and its Ray metrics going; a stop request is seen."""
    from actors.observe import Observer

    obs, handle = Observer("r"), _Handle(tmp_path)
    set_to = {}
    for name, gauge in obs.gauges.items():
        monkeypatch.setattr(gauge, "set", lambda v, tags, name=name: set_to.__setitem__(name, (v, tags)))
    (tmp_path / "status.json").mkdir()  # os.replace onto a directory fails: as a disk that refuses the file
    assert obs.tick(handle) is False
    assert set_to["merges"] == (7.0, {"run": "r"}) and set_to["bytes_down"] == (30.0, {"run": "r"})
    assert set_to["commit_gap_s"][0] >= 5.0  # no merge yet: the gap runs from the start
    (tmp_path / "status.json").rmdir()
    set_to.clear()
    (tmp_path / "stop-requested").write_text("now")
    assert obs.tick(handle) is True  # the stop is seen at once ...
    assert set_to == {} and not (tmp_path / "status.json").exists()  # ... within 2 s: nothing rewritten
    obs._last -= control.EVERY_S
    assert obs.tick(handle) is True and (tmp_path / "status.json").is_file() and set_to["merges"][0] == 7.0
