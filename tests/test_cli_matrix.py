"""`dloco train` on bad input: one line on stderr naming the field or file, exit code 2, Ray never
started and nothing written under the test's directory.

Each case runs `actors.cli.main` in this process with `ray.init` replaced by a failure, on the
`micro` preset and the session's corpus cache; the run directory is under `tmp_path`, whose every
file is compared before and after. A read-only filesystem is a real read-only bind mount in a
mount namespace of its own (`unshare -m`), which root cannot write either.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.cli import main
from dloco import config, preflight

ROOT = Path(__file__).resolve().parents[1]


def listing(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under `root`; a file with its size and mtime (directories by name only: the
    writability probe creates and removes a file in the run dir's nearest existing ancestor)."""
    return {str(p): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture
def inputs(tmp_path):
    """Files the cases point at: configs, corpora, a plain file, and a run made without Ray."""
    d = tmp_path / "in"
    (d / "confdir").mkdir(parents=True)
    (d / "bad.yaml").write_text("sync: {every: 3\n")
    (d / "list.yaml").write_text("- 1\n- 2\n")
    (d / "binary.yaml").write_bytes(b"\xff\xfe\x00\x01 not yaml")
    (d / "bad.json").write_text('{"sync": ')
    (d / "one").mkdir()
    (d / "one" / "only.txt").write_text("the only document of this corpus\n" * 300)
    (d / "pq").mkdir()
    pq.write_table(pa.table({"body": ["a document"] * 4}), d / "pq" / "a.parquet")
    (d / "tok").mkdir()
    rows = [[(7 * r + i) % 300 for i in range(400)] for r in range(40)]  # ids 0..299: a vocabulary of 300
    pq.write_table(pa.table({"tokens": rows}), d / "tok" / "ids.parquet")
    (d / "afile").write_text("not a directory")
    (d / "j").mkdir()
    (d / "j" / "a.jsonl").write_text('{"body": "a document"}\n' * 4)
    return d


def make_run(tiny_run, run_dir: Path, *overrides: str, fingerprint: bool = True) -> None:
    """A run directory as `start` leaves it (config.json, fingerprint.json, store/), made without Ray."""
    cfg = config.load(overrides=(*tiny_run, *overrides))
    preflight.record(preflight.check(cfg, run_dir), cfg)
    (run_dir / "store").mkdir()
    if not fingerprint:
        (run_dir / "fingerprint.json").unlink()  # a run from before fingerprints


@pytest.fixture
def dloco(tmp_path, tiny_run, monkeypatch, capsys):
    """Runs ``dloco train ARGS`` (micro preset, run_dir under tmp_path); returns (exit code, stderr)."""
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init was called: the input should have been refused before Ray starts")

    monkeypatch.setattr(ray, "init", no_ray)

    def run(*args: str) -> tuple[int, str]:
        before = listing(tmp_path)
        capsys.readouterr()
        code = main(["train", "--quiet", *sets(*tiny_run, f"run_dir={tmp_path / 'runs'}"), *args])
        out = capsys.readouterr()
        assert not ray.is_initialized()
        assert listing(tmp_path) == before, "something was written"
        assert out.out == ""
        return code, out.err

    return run


def sets(*kvs: str) -> list[str]:
    return [a for kv in kvs for a in ("--set", kv)]


# (case, arguments given the inputs' directory, what the one line must contain)
CASES = [
    ("norm_warmup", lambda d: sets("syncer.norm_warmup=65"), "config error: syncer.norm_warmup=65"),
    ("seed", lambda d: sets("seed=-1"), "config error: seed=-1"),
    ("seed_alias", lambda d: sets("seed=4294967296"), "seed=4294967296"),
    ("chaos_seed", lambda d: sets("chaos.seed=-1"), "chaos.seed=-1"),
    ("inf_lr", lambda d: sets("inner.lr=.inf"), "inner.lr=inf"),
    ("nan_outer_lr", lambda d: sets("outer.lr=.nan"), "outer.lr=nan"),
    ("inf_budget", lambda d: sets("budget.seconds=.inf"), "budget.seconds=inf"),
    ("inf_kill_time", lambda d: sets("chaos.store_kills_s=[.inf]"), "chaos.store_kills_s[0]=inf"),
    ("nan_resource", lambda d: sets("learners.resources={region: .nan}"), "learners.resources.region=nan"),
    ("vocab_below_bytes", lambda d: sets("model.vocab_size=10"), "model.vocab_size=10"),
    ("gpu_in_resources", lambda d: sets("learners.resources={GPU: 1}"), "learners.resources.GPU"),
    ("resource_precision", lambda d: sets("learners.num_cpus=0.00001"), "learners.num_cpus=1e-05"),
    ("fractional_gpus", lambda d: sets("learners.num_gpus=1.5"), "learners.num_gpus=1.5"),
    ("chaos_schedule", lambda d: sets("chaos.mtbf_s=0.000001"), "chaos.mtbf_s=1e-06"),
    (
        "gpu_batch_split",
        lambda d: sets("learners.groups=[{name: g, count: 2, num_gpus: 2, batch_size: 3}]"),
        "learners.groups[g].batch_size=3",
    ),
    ("unknown_key", lambda d: sets("sync.bogus=1"), "sync.bogus=1"),
    ("bad_type", lambda d: sets("sync.every=abc"), "sync.every='abc'"),
    ("bad_override", lambda d: sets("sync.every"), "override='sync.every'"),
    ("config_missing", lambda d: ["--config", str(d / "nope.yaml")], "nope.yaml: No such file"),
    ("config_is_dir", lambda d: ["--config", str(d / "confdir")], "confdir: Is a directory"),
    ("config_yaml_syntax", lambda d: ["--config", str(d / "bad.yaml")], "bad.yaml: not valid YAML"),
    ("config_not_mapping", lambda d: ["--config", str(d / "list.yaml")], "list.yaml"),
    ("config_json_syntax", lambda d: ["--config", str(d / "bad.json")], "bad.json: not valid JSON"),
    ("config_not_utf8", lambda d: ["--config", str(d / "binary.yaml")], "binary.yaml: not a YAML file"),
    (
        "parquet_without_text",
        lambda d: sets(f"data.source=parquet:{d}/pq/*.parquet"),
        "a.parquet: needs a 'text' (data.text_field) or 'tokens' column",
    ),
    ("max_bytes_tiny", lambda d: sets("data.max_bytes=10"), "data.max_bytes=10: max_bytes=10 is smaller"),
    ("tokenizer_unknown", lambda d: sets("data.tokenizer=wordpiece"), "data.tokenizer='wordpiece'"),
    ("tokenizer_file_missing", lambda d: sets(f"data.tokenizer=file:{d}/tok.json"), "tok.json: No such file"),
    ("tokenizer_file_not_json", lambda d: sets(f"data.tokenizer=file:{d}/afile"), "afile: not a tokenizer.json"),
    (
        "jsonl_without_field",
        lambda d: sets(f"data.source=jsonl:{d}/j/*.jsonl"),
        "a.jsonl line 1: field 'text' is missing",
    ),
    ("init_from_missing", lambda d: sets(f"model.init_from={d}/nowhere"), "nowhere: not a run directory or an export"),
    ("one_file_corpus", lambda d: sets(f"data.source=text:{d}/one/*.txt"), "the validation split"),
    ("no_files", lambda d: sets(f"data.source=text:{d}/none/*.txt"), "matches no files"),
    ("seq_len_huge", lambda d: sets("data.seq_len=100000"), "data.seq_len=100000"),
    ("batch_huge", lambda d: sets("inner.batch_size=1000000"), "inner.batch_size=1000000"),
    ("too_many_fragments", lambda d: sets("sync.every=32", "fragments.count=16"), "fragments.count=16"),
    ("cache_under_file", lambda d: sets(f"data.cache_dir={d}/afile/cache"), "data.cache_dir="),
    (
        "ids_above_vocab",
        lambda d: sets(
            f"data.source=parquet:{d}/tok/*.parquet",
            "model.vocab_size=280",
            "data.shards=4",
            "data.eval_batch_size=2",
        ),
        "model.vocab_size=280: below the pretokenized tokenizer's vocabulary of 300",
    ),
    ("run_dir_is_file", lambda d: ["--run-dir", str(d / "afile")], "afile is a file"),
    ("run_dir_under_file", lambda d: ["--run-dir", str(d / "afile" / "run")], "afile is a file"),
    ("cfg_run_dir_under_file", lambda d: sets(f"run_dir={d}/afile/runs"), "afile is a file"),
    ("run_dir_unwritable", lambda d: ["--run-dir", "/sys/dloco-run"], "/sys/dloco-run is not writable"),
    ("resume_missing", lambda d: ["--run-dir", str(d / "typo"), "--resume"], "typo holds no run to resume"),
    ("resume_empty", lambda d: ["--run-dir", str(d / "confdir"), "--resume"], "confdir holds no run to resume"),
    ("resume_default_dir", lambda d: ["--resume"], "holds no run to resume"),
]


@pytest.mark.parametrize(("args", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(dloco, inputs, args, needle):
    code, err = dloco(*args(inputs))
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("dloco: "), err
    assert needle in lines[0], lines[0]
    assert "Traceback" not in err


RESUME_CASES = [
    ("fragments", ("fragments.count=4",), "resume: fragments differ (fragments.count): run has 2, config has 4"),
    ("d_model", ("model.d_model=64",), "resume: parameter counts differ (model): run has 20608"),
    ("learners", ("learners.count=2",), "resume: learners differ (learners.count): run has 4, config has 2"),
    ("algorithm", ("algorithm=streaming",), "resume: algorithms differ (algorithm)"),
    ("seq_len", ("data.seq_len=16",), "resume: data differ (data.seq_len): run has 32, config has 16"),
    ("momentum", ("outer.momentum=0.9",), "resume: outer optimizer states differ"),
]


@pytest.mark.parametrize(("overrides", "needle"), [c[1:] for c in RESUME_CASES], ids=[c[0] for c in RESUME_CASES])
def test_resume_with_a_changed_config(dloco, tiny_run, tmp_path, overrides, needle):
    run = tmp_path / "run"
    make_run(tiny_run, run)
    code, err = dloco("--run-dir", str(run), "--resume", *sets(*overrides))
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert f"--config {run / 'config.json'}" in err


def test_a_matching_resume_reaches_ray_before_it_writes(monkeypatch, capsys, tiny_run, tmp_path):
    """Preflight passes, so `start` connects (here: fails to) before it writes config-resume-1.json."""
    import ray

    run = tmp_path / "run"
    make_run(tiny_run, run)
    calls = []

    def unreachable(*args, **kwargs):
        calls.append(kwargs)
        raise ConnectionError("no Ray in this test")

    monkeypatch.setattr(ray, "init", unreachable)
    assert main(["train", "--quiet", "--run-dir", str(run), "--resume", *sets(*tiny_run, "budget.tokens=999")]) == 2
    assert capsys.readouterr().err == "dloco: no Ray in this test\n" and len(calls) == 1
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "fingerprint.json", "store"]


def test_resume_of_a_run_from_before_fingerprints(dloco, tiny_run, tmp_path):
    run = tmp_path / "run"
    make_run(tiny_run, run, fingerprint=False)
    code, err = dloco("--run-dir", str(run), "--resume", *sets("fragments.count=4"))
    assert code == 2 and "resume: fragments differ" in err and len(err.strip().splitlines()) == 1, err


def test_resume_with_a_damaged_fingerprint(dloco, tiny_run, tmp_path):
    run = tmp_path / "run"
    make_run(tiny_run, run)
    (run / "fingerprint.json").write_text("[1, 2")
    code, err = dloco("--run-dir", str(run), "--resume")
    assert code == 2 and f"cannot resume from {run / 'fingerprint.json'}" in err, err


def test_a_fresh_run_into_a_run(dloco, tiny_run, tmp_path):
    run = tmp_path / "run"
    make_run(tiny_run, run)
    code, err = dloco("--run-dir", str(run))
    assert code == 2 and "already holds a run: pass --resume" in err, err
    assert json.loads((run / "fingerprint.json").read_text())["fragments"] == 2


def test_resume_while_another_store_holds_the_run(dloco, tiny_run, tmp_path):
    import fcntl

    run = tmp_path / "run"
    make_run(tiny_run, run)
    (run / "store" / "LOCK").write_text('{"pid": 7, "host": "elsewhere"}')
    fd = os.open(run / "store" / "LOCK", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, err = dloco("--run-dir", str(run), "--resume")
    finally:
        os.close(fd)
    assert code == 2 and "is in use by another store" in err and "elsewhere" in err, err


CHILD = """
import sys, ray
def no_ray(*a, **k):
    raise SystemExit("ray.init was called")
ray.init = no_ray
from actors.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_read_only_run_dir(tmp_path, tiny_run):
    """A real read-only filesystem: a read-only bind mount, in a mount namespace of this command only."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    ro = tmp_path / "ro"
    (ro / "exp").mkdir(parents=True)
    args = ["train", "--quiet", "--run-dir", str(ro / "exp" / "run"), *sets(*tiny_run)]
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" || exit 77; shift; exec "$@"'
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = ["unshare", "-m", "sh", "-c", script, str(ro), "-", sys.executable, "-c", CHILD, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    if out.returncode == 77 or "unshare failed" in out.stderr or "Operation not permitted" in out.stderr:
        pytest.skip(f"no private read-only mount here: {out.stderr.strip()[-200:]}")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "exp/run is not writable" in lines[0] and "Read-only file system" in lines[0], lines[0]
    assert list(ro.rglob("*")) == [ro / "exp"]


SUMMARY = {
    "eval_loss_start": 5.6,
    "eval_loss_end": 5.1,
    "tokens_trained": 1000,
    "tokens_merged": 800,
    "merges": 3,
    "rejected": 0,
    "learners": 2,
    "restarts": 0,
    "goodput": 0.5,
    "uptime": 1.0,
    "bytes_up": 10,
    "bytes_down": 20,
    "wall_time_s": 3.0,
    "run_dir": "runs/x",
}


@pytest.mark.parametrize(("error", "code"), [(None, 0), ("store: commits failing for 300 s:\n disk full", 1)])
def test_a_run_that_ends_on_an_error_exits_1_after_its_table(monkeypatch, capsys, error, code):
    """The supervisor's summary names an unrecoverable error: the table, then one line, exit 1."""
    import actors.launch

    class Handle:
        run_dir, resumed = Path("runs/x"), False

        def wait(self):
            return None

        def stop(self):
            return {**SUMMARY, "error": error}

    monkeypatch.setattr(actors.launch, "start", lambda cfg, **kw: Handle())
    assert main(["train", "--quiet"]) == code
    out = capsys.readouterr()
    assert "eval loss" in out.out
    first = "dloco: run dir runs/x (new run)"  # the first line of a run's log: where it writes
    if error:
        assert out.err.strip().splitlines() == [first, "dloco: run failed: store: commits failing for 300 s: disk full"]
    else:
        assert out.err == first + "\n"


def test_a_resubmitted_job_continues_its_run_dir_and_refuses_another_config(monkeypatch, capsys, tiny_run, tmp_path):
    """Under ``ray job submit`` (Ray sets RAY_JOB_CONFIG_JSON_ENV_VAR for the job's driver), a run dir
    that holds a run is continued without --resume if the config's fingerprint matches (here `start`
    gets as far as connecting), and refused in one line if it does not; outside a job, --resume is
    still needed."""
    import ray

    run = tmp_path / "run"
    make_run(tiny_run, run)
    monkeypatch.setattr(ray, "init", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("no Ray in this test")))
    train = ["train", "--quiet", "--run-dir", str(run)]
    assert main([*train, *sets(*tiny_run)]) == 2
    assert "already holds a run: pass --resume" in capsys.readouterr().err
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    assert main([*train, *sets(*tiny_run, "budget.tokens=999")]) == 2
    assert capsys.readouterr().err == "dloco: no Ray in this test\n"  # resumed: past the preflight
    assert main([*train, *sets(*tiny_run, "fragments.count=4")]) == 2
    err = capsys.readouterr().err
    assert "resume: fragments differ" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "fingerprint.json", "store"]


def test_under_a_job_the_default_run_dir_is_absolute_under_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = config.load()  # run_dir: runs (relative: under a job the working dir is Ray's temporary copy)
    path = preflight.resolve_run_dir(cfg, job=True)
    assert path.is_absolute() and path.parent == tmp_path / "runs"
    assert preflight.resolve_run_dir(cfg).parent == Path("runs")  # outside a job, as before
    assert preflight.resolve_run_dir(cfg, "here", job=True) == Path("here")  # --run-dir is the user's
    assert (
        preflight.resolve_run_dir(config.load(overrides=(f"run_dir={tmp_path}/r",)), job=True).parent == tmp_path / "r"
    )


def test_print_config_writes_a_config_file_that_loads_to_the_same_run(capsys, tmp_path):
    assert main(["train", "--print-config", "--set", "inner.lr=3e-4", "--set", "learners.count=3"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(text)
    cfg = config.load(overrides=("inner.lr=3e-4", "learners.count=3"))
    assert config.load(tmp_path / "printed.yaml") == cfg and "lr: 0.0003" in text


def test_help_lists_every_config_section(capsys):
    import dataclasses
    import typing

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    hints = typing.get_type_hints(config.RunConfig)
    sections = [f.name for f in dataclasses.fields(config.RunConfig) if dataclasses.is_dataclass(hints[f.name])]
    assert "config sections" in out and len(sections) == 16 and all(f"\n  {name} " in out for name in sections)
    assert "\n  data         Corpus, tokenizer and windows\n" in out
    assert "(top level)  preset, algorithm, seed, run_dir" in out
