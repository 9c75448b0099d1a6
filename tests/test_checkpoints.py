"""Checkpoints during a run (`export.*`, `dloco.checkpoints`): the store writes exports of consistent
cuts as it commits, off its commit path; the newest `keep` stay, and each holds the cut it took."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dloco import checkpoints, config, export
from dloco.checkpoints import Checkpointer
from dloco.config import ConfigError
from dloco.fragments import flatten


def test_a_run_leaves_its_newest_checkpoints_each_the_cut_taken_at_its_commit(store_run):
    cfg, run_dir, final, taken = store_run  # conftest: a checkpoint every third commit, two kept
    commits = sum(f.version for f in final)
    assert commits >= 9 and taken and all(n % 3 == 0 for n in taken)
    assert sorted(taken) == list(range(3, commits + 1, 3))  # none skipped: each was written before the next
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    newest_two = sorted(taken)[-2:]
    assert names == [f"commit-{n:08d}" for n in newest_two], (names, sorted(taken))
    assert checkpoints.newest(run_dir) == run_dir / "checkpoints" / f"commit-{newest_two[-1]:08d}"
    for n in newest_two:
        d = run_dir / "checkpoints" / f"commit-{n:08d}"
        meta = json.loads((d / "dloco.json").read_text())
        versions, values = taken[n]
        assert meta["commits"] == n and meta["versions"] == versions and meta["format"] == "safetensors"
        got = flatten(export.load(d).params)
        assert got.keys() == values.keys()
        assert all(np.array_equal(got[k], values[k]) for k in values), n  # the cut, bit for bit
    assert (run_dir / "checkpoints").stat().st_mode & 0o077 == 0  # the run's files are its user's


def test_a_checkpoint_is_due_every_n_commits_or_every_s_seconds_once_per_commit(tmp_path):
    t = [0.0]
    cfg = config.load(None, ["preset=micro", "export.every_commits=4", "export.every_s=10"])
    c = Checkpointer(cfg, tmp_path, lambda: t[0], on_error=print)
    assert [n for n in range(1, 10) if c.due(n)] == [4, 8]
    t[0] = 10.0
    assert c.due(5)  # ten seconds since the start, however many commits
    c.last_commits, c.last_time = 5, 10.0  # what `take` records
    assert not c.due(5) and not c.due(6) and c.due(8)
    t[0] = 19.9
    assert not c.due(7)
    t[0] = 20.0
    assert c.due(7)
    off = Checkpointer(config.load(None, ["preset=micro"]), tmp_path, lambda: 1e9, on_error=print)
    assert not any(off.due(n) for n in range(1, 20))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["export.every_commits=-1"],
            "export.every_commits=-1 is invalid: must be >= 0 (0: off)",
        ),
        (
            ["export.every_commits=5", "fragments.count=2", "sync.every=8", "syncer.shards=2"],
            "export.every_commits=5 is invalid: checkpoints during a run need syncer.shards=1",
        ),
        (
            ["export.every_s=60", "export.format=hf"],
            "export.format='hf' is invalid: a Hugging Face checkpoint is of the llama family",
        ),
        (["export.format=orbax"], "export.format='orbax' is invalid"),
    ],
)
def test_bad_checkpoint_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        config.load(None, ["preset=micro", *overrides])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
