"""`dloco.tensorboard`: events written as TensorBoard scalars, read back from the event file itself.

The reader parses the TFRecord framing (length, masked CRC-32C of the length, the serialized
`Event`, masked CRC-32C of the data) with tensorboardX's own protobufs and CRC, so the test checks
the bytes TensorBoard would read, not the writer's in-memory state.
"""

import struct
from collections import defaultdict
from pathlib import Path

import pytest
from synthetic_runs import make_run

from dloco import metrics, tensorboard

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
record_writer = pytest.importorskip("tensorboardX.record_writer")


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """tag → [(step, value, wall_time)] from every event file in `run_dir`, CRCs checked."""
    out: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    files = sorted(run_dir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {run_dir}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            header = data[pos : pos + 8]
            (length,) = struct.unpack("Q", header)
            (hcrc,) = struct.unpack("I", data[pos + 8 : pos + 12])
            assert hcrc == record_writer.masked_crc32c(header)
            body = data[pos + 12 : pos + 12 + length]
            (bcrc,) = struct.unpack("I", data[pos + 12 + length : pos + 16 + length])
            assert bcrc == record_writer.masked_crc32c(body)
            pos += 16 + length
            ev = event_pb2.Event.FromString(body)
            for v in ev.summary.value:
                out[v.tag].append((ev.step, v.simple_value, ev.wall_time))
    return dict(out)


def test_eval_merge_rejection_restart_scalars(tmp_path):
    run = tmp_path / "run"
    with tensorboard.TensorBoardSink(run, fragments=2) as sink:
        assert sink.write({"event": "eval", "time": 1000.0, "t": 2.0, "loss": 5.5, "tokens": 0}) == 2
        n = sink.write(
            {
                "event": "merge",
                "fragment": 1,
                "version": 3,
                "contributors": [1, 3],
                "tokens": [12288, 4096],
                "steps": [24, 8],
                "inner_steps": [24, 8],
                "staleness": [2, 1],
                "grace_s": 0.25,
                "grace_window_s": 0.33,
                "slack_s": 0.66,
                "bytes_in": 135432,
                "bytes_out": 525312,
                "time": 1010.0,
                "t": 12.0,
            }
        )
        assert n == 7 + 3
        sink.write(
            {
                "event": "merge",
                "fragment": 0,
                "version": 1,
                "contributors": [0],
                "tokens": [8192],
                "steps": [16],
                "inner_steps": [16],
                "staleness": [0],
                "grace_s": 0.0,
                "grace_window_s": 0.3,
                "slack_s": 0.6,
                "bytes_in": 100,
                "bytes_out": 200,
                "time": 1011.0,
                "t": 13.4,
            }
        )
        sink.write({"event": "rejection", "time": 1012.0, "t": 14.0, "fragment": 0, "learner": 2, "reason": "stale"})
        sink.write({"event": "rejection", "time": 1013.0, "t": 15.0, "fragment": 1, "learner": 2, "reason": "stale"})
        sink.write({"event": "learner_restart", "time": 1014.0, "t": 16.0, "learner": 0, "incarnation": 2})
        sink.write({"event": "fault", "time": 1013.5, "t": 15.5, "target": "learner-0", "kind": "kill"})
        sink.write({"event": "eval", "time": 1020.0, "t": 22.4, "loss": 4.25, "tokens": 49152})
        sink.write({"event": "goodput", "time": 1021.0, "t": 23.0, "goodput": 0.5, "uptime": 0.9})
        assert sink.write({"event": "store_start", "time": 1000.0, "t": 2.0, "versions": [0, 0]}) == 0
    s = read_scalars(run)
    assert s["eval/loss"] == [(0, 5.5, 1000.0), (49152, 4.25, 1020.0)]
    assert [(st, v) for st, v, _ in s["eval/loss_by_wall_s"]] == [(2, 5.5), (22, 4.25)]
    assert s["merge/fragment_1/quorum"] == [(3, 2.0, 1010.0)]
    assert s["merge/fragment_1/staleness_mean"][0][:2] == (3, 1.5)
    for tag, want in [("grace_s", 0.25), ("grace_window_s", 0.33), ("slack_s", 0.66)]:
        assert s[f"merge/fragment_1/{tag}"][0][1] == pytest.approx(want)
    assert s["merge/fragment_1/bytes_in"][0][1] == 135432 and s["merge/fragment_1/bytes_out"][0][1] == 525312
    assert s["merge/fragment_0/quorum"] == [(1, 1.0, 1011.0)]
    # tokens merged: every step of these pushes is new, so Σ c_tok / P: (12288 + 4096) / 2, then + 8192 / 2
    assert [v for _, v, _ in s["merge/tokens_merged"]] == [8192.0, 12288.0]
    assert [v for _, v, _ in s["wire/bytes_in_total"]] == [135432.0, 135532.0]
    assert [v for _, v, _ in s["wire/bytes_out_total"]] == [525312.0, 525512.0]
    assert [(st, v) for st, v, _ in s["rejections/total"]] == [(14, 1.0), (15, 2.0)]
    assert [(st, v) for st, v, _ in s["learners/restarts"]] == [(16, 1.0)]
    assert [v for _, v, _ in s["faults/total"]] == [1.0]
    assert s["goodput/token_proxy"] == [(49152, pytest.approx(12288 / 49152), 1020.0)]
    assert s["goodput/goodput"][0][1] == 0.5 and s["goodput/uptime"][0][1] == pytest.approx(0.9)


def test_closed_sink_refuses_writes(tmp_path):
    sink = tensorboard.TensorBoardSink(tmp_path, fragments=1)
    sink.close()
    sink.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        sink.write({"event": "eval", "t": 0.0, "loss": 1.0, "tokens": 0})


def test_from_metrics_of_a_launcher_shaped_run(tmp_path):
    run = tmp_path / "run"
    events = make_run(run, learners=2, fragments=2)
    tensorboard.from_metrics(run)
    s = read_scalars(run)
    merges = [e for e in events if e["event"] == "merge"]
    evals = sorted((e for e in events if e["event"] == "eval"), key=lambda e: e["t"])
    assert [v for _, v, _ in s["eval/loss"]] == pytest.approx([e["loss"] for e in evals])
    for p in (0, 1):
        mine = [e for e in merges if e["fragment"] == p]
        assert [st for st, _, _ in s[f"merge/fragment_{p}/quorum"]] == [e["version"] for e in mine]
        assert [v for _, v, _ in s[f"merge/fragment_{p}/quorum"]] == [len(e["contributors"]) for e in mine]
    # P is read from config.json; the last cumulative value is the one definition of tokens merged
    # (`metrics.merged_progress`: steps merged twice count once), what summary.json reports
    per_learner = metrics.learner_time(events, events[-1]["time"], 2)
    assert s["merge/tokens_merged"][-1][1] == pytest.approx(sum(v["merged_tokens"] for v in per_learner.values()))
    assert s["merge/tokens_merged"][-1][1] < sum(sum(e["tokens"]) for e in merges) / 2  # the ledger's raw Σ
    assert s["wire/bytes_in_total"][-1][1] == sum(e["bytes_in"] for e in merges)
    assert s["learners/starts"][-1][1] == 2 and s["learners/restarts"][-1][1] == 1
    assert s["rejections/total"][-1][1] == 1


def test_from_metrics_needs_metrics_jsonl(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        tensorboard.from_metrics(tmp_path)
