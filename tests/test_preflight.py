"""`dloco.preflight`: checks before anything is written or Ray starts, the fingerprint, resume rules.

Expectations are computed by hand for the `micro` model (d_model 32, 2 heads, 1 layer, MLP ratio 4,
byte tokenizer: vocabulary 257): embedding 257·32 = 8224; qkv 32·96 = 3072; out 32·32 = 1024;
mlp_in and mlp_out 32·128 = 4096 each; three RMSNorm scales of 32: P = 20608.
"""

import fcntl
import inspect
import json
import math
import os
from pathlib import Path

import pytest

from dloco import config, preflight
from dloco.config import ConfigError
from dloco.policy import NormTracker
from dloco.preflight import PreflightError


def micro(tiny_run, *overrides):
    return config.load(overrides=(*tiny_run, *overrides))


def listing(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under `root`; a file with its size and mtime (a directory's mtime moves with the
    writability probe, which creates and removes a file)."""
    return {str(p): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_norm_warmup_bound_is_the_syncers_norm_window():
    window = inspect.signature(NormTracker).parameters["window"].default
    assert config.train.NORM_WINDOW == window == 64
    with pytest.raises(ValueError, match="could never be reached"):
        NormTracker(warmup=window + 1)  # what syncer.norm_warmup=65 did once the syncer started
    config.load(overrides=("syncer.norm_warmup=64",))
    with pytest.raises(ConfigError, match=r"syncer.norm_warmup=65 is invalid: must be in \[0, 64\]"):
        config.load(overrides=("syncer.norm_warmup=65",))


def test_fingerprint_of_the_micro_model(tiny_run, tmp_path):
    cfg = micro(tiny_run)  # fragments.count=2: the embedding, then everything else
    pf = preflight.check(cfg, tmp_path / "run")
    fp = pf.fingerprint
    assert fp["parameters"] == 20608 and fp["fragments"] == 2 and fp["vocab_size"] == 257
    assert fp["tokenizer"] == {"kind": "byte", "vocab_size": 257}
    assert fp["learners"] == [0, 1, 2, 3] and fp["algorithm"] == "decoupled"
    assert fp["data"] == {"key": pf.corpus.key, "seq_len": 32, "shards": 64}
    assert fp["outer_state"] == [0, 0]  # plain averaging: SGD without momentum keeps no state
    assert fp["plan"][0] == [["embed/embedding", [257, 32]]]
    assert dict((n, s) for n, s in fp["plan"][1]) == {
        "block_0/attn/out/kernel": [32, 32],
        "block_0/attn/qkv/kernel": [32, 96],
        "block_0/attn_norm/scale": [32],
        "block_0/mlp_in/kernel": [32, 128],
        "block_0/mlp_norm/scale": [32],
        "block_0/mlp_out/kernel": [128, 32],
        "final_norm/scale": [32],
    }
    assert json.loads(json.dumps(fp)) == fp  # what fingerprint.json reads back compares equal


def test_fingerprint_plan_and_outer_state_with_four_fragments(tiny_run, tmp_path):
    # LPT over the 7 non-embedding tensors into 3 bins: mlp_in, mlp_out, qkv; out joins qkv's bin
    # (3072 < 4096); the three scales go one to each bin by name. Delayed Nesterov (μ > 0, N = M = 4)
    # keeps momentum and buffer per tensor plus one counter.
    cfg = micro(tiny_run, "fragments.count=4", "outer.momentum=0.9")
    fp = preflight.check(cfg, tmp_path / "run").fingerprint
    sizes = [sum(math.prod(s) for _, s in f) for f in fp["plan"]]
    assert sizes == [8224, 4096 + 32, 4096 + 32, 3072 + 1024 + 32]
    assert [[n for n, _ in f] for f in fp["plan"][1:]] == [
        ["block_0/attn_norm/scale", "block_0/mlp_in/kernel"],
        ["block_0/mlp_norm/scale", "block_0/mlp_out/kernel"],
        ["block_0/attn/out/kernel", "block_0/attn/qkv/kernel", "final_norm/scale"],
    ]
    assert fp["outer_state"] == [2 * 1 + 1, 2 * 2 + 1, 2 * 2 + 1, 2 * 3 + 1]


def test_check_writes_nothing_and_record_writes_config_then_config_resume_n(tiny_run, tmp_path):
    cfg = micro(tiny_run)
    before = listing(tmp_path)
    pf = preflight.check(cfg, tmp_path / "a" / "run")
    assert listing(tmp_path) == before  # not even the run dir's parents
    assert preflight.record(pf, cfg) == tmp_path / "a" / "run" / "config.json"
    run = tmp_path / "a" / "run"
    assert json.loads((run / "fingerprint.json").read_text()) == pf.fingerprint
    original = (run / "config.json").read_text()
    assert json.loads(original) == json.loads(json.dumps(cfg.to_dict()))
    longer = micro(tiny_run, "budget.tokens=99999", "metrics.eval_every_s=3", "chaos.seed=5")  # may change
    for n in (1, 2):
        again = preflight.check(longer, run, resume=True)
        assert preflight.record(again, longer).name == f"config-resume-{n}.json"
    assert (run / "config.json").read_text() == original
    # the resume hint of every mismatch: the run's own config.json loads back as the config it was
    assert config.load(run / "config.json") == cfg
    preflight.check(config.load(run / "config.json", ["budget.tokens=5"]), run, resume=True)
    assert json.loads((run / "config-resume-2.json").read_text())["budget"]["tokens"] == 99999


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("fragments.count=4",), "resume: fragments differ (fragments.count): run has 2, config has 4"),
        (("learners.count=2",), "resume: learners differ (learners.count): run has 4, config has 2"),
        (("algorithm=streaming",), "resume: algorithms differ (algorithm): run has decoupled, config has streaming"),
        (("model.d_model=64",), "resume: parameter counts differ (model): run has 20608, config has "),
        (("data.seq_len=16",), "resume: data differ (data.seq_len): run has 32, config has 16"),
        (("data.shards=32",), "resume: data differ (data.shards): run has 64, config has 32"),
        (("data.max_bytes=300000",), "resume: data differ (data.source, data.max_bytes, data.val_fraction"),
        (("outer.momentum=0.9",), "resume: outer optimizer states differ (outer.momentum, outer.delay"),
    ],
)
def test_resume_names_the_first_difference(tiny_run, tmp_path, overrides, message):
    run = tmp_path / "run"
    cfg = micro(tiny_run)
    preflight.record(preflight.check(cfg, run), cfg)
    (run / "store").mkdir()
    before = listing(tmp_path)
    with pytest.raises(PreflightError) as e:
        preflight.check(micro(tiny_run, *overrides), run, resume=True)
    assert str(e.value).startswith(message), str(e.value)
    assert f"--config {run / 'config.json'}" in str(e.value) and "\n" not in str(e.value)
    assert listing(tmp_path) == before


def test_compare_names_the_first_tensor_that_moved():
    run = {"plan": [[["a", [2, 2]]], [["b", [3]]]], "parameters": 7}
    now = {"plan": [[["a", [2, 2]]], [["b", [4]]]], "parameters": 7}
    moved = r"fragment plans differ .*run has b \[3\] in fragment 1, config has b \[4\]"
    with pytest.raises(PreflightError, match=moved):
        preflight.compare(run, now)


def test_resume_of_a_run_from_before_fingerprints_uses_its_config_json(tiny_run, tmp_path):
    run = tmp_path / "run"
    cfg = micro(tiny_run)
    (run / "store").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    preflight.check(cfg, run, resume=True)
    with pytest.raises(PreflightError, match="resume: fragments differ"):
        preflight.check(micro(tiny_run, "fragments.count=4"), run, resume=True)
    (run / "config.json").write_text("{not json")
    with pytest.raises(PreflightError, match=r"cannot resume from .*config.json"):
        preflight.check(cfg, run, resume=True)


def test_run_dir_rules(tiny_run, tmp_path):
    cfg = micro(tiny_run)
    with pytest.raises(PreflightError, match="holds no run to resume: it does not exist"):
        preflight.check(cfg, tmp_path / "typo", resume=True)
    with pytest.raises(PreflightError, match="holds no run to resume: no fingerprint.json"):
        preflight.check(cfg, tmp_path, resume=True)
    (tmp_path / "store").mkdir()
    with pytest.raises(PreflightError, match="already holds a run: pass --resume"):
        preflight.check(cfg, tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(PreflightError, match="is a file, not a directory"):
        preflight.check(cfg, tmp_path / "file")
    with pytest.raises(PreflightError, match=r"cannot be created: .*file is a file"):
        preflight.check(cfg, tmp_path / "file" / "deeper" / "run")
    with pytest.raises(PreflightError, match="is not writable: cannot create a file in /sys"):
        preflight.check(cfg, Path("/sys/dloco-run"))


def test_resume_refuses_a_run_dir_another_store_holds(tiny_run, tmp_path):
    cfg = micro(tiny_run)
    preflight.record(preflight.check(cfg, tmp_path), cfg)
    (tmp_path / "store").mkdir()
    lock = tmp_path / "store" / "LOCK"
    lock.write_text('{"pid": 4242, "host": "h"}')
    preflight.check(cfg, tmp_path, resume=True)  # a lock file nobody holds: the store died
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(PreflightError, match=r"in use by another store \(\{\"pid\": 4242"):
            preflight.check(cfg, tmp_path, resume=True)
    finally:
        os.close(fd)


def corpus(train_tokens: int, val_tokens: int, vocab: int = 257):
    from dloco.data import Corpus

    return Corpus(Path("/nonexistent"), vocab, 256, "byte", train_tokens, val_tokens, "k" * 64, True)


def test_data_windows_at_their_bounds(tiny_run):
    # micro: T = 32, 64 shards, batch 4, 16 validation rows; W = ⌊(N − 1) / T⌋ windows
    cfg = micro(tiny_run)
    preflight.check_data(cfg, corpus(4 * 64 * 32 + 1, 16 * 32 + 1))  # 4 windows per shard, 16 for validation
    with pytest.raises(PreflightError, match=r"inner.batch_size=4: more than the 3 windows of each learner's"):
        preflight.check_data(cfg, corpus(4 * 64 * 32, 16 * 32 + 1))
    with pytest.raises(PreflightError, match=r"data.seq_len=32: .* holds 63 windows .*fewer than data.shards=64"):
        preflight.check_data(cfg, corpus(64 * 32, 10**6))
    with pytest.raises(PreflightError, match=r"holds 15 windows .* fewer than data.eval_batch_size=16"):
        preflight.check_data(cfg, corpus(10**6, 16 * 32))
    big = micro(tiny_run, "learners.groups=[{name: a, count: 2, batch_size: 5}, {name: b, count: 2}]")
    with pytest.raises(PreflightError, match=r"learners.groups\[a\].batch_size=5: more than the 4 windows"):
        preflight.check_data(big, corpus(4 * 64 * 32 + 1, 16 * 32 + 1))
    with pytest.raises(PreflightError, match=r"model.vocab_size=300: below the byte tokenizer's vocabulary of 320"):
        preflight.check_data(micro(tiny_run, "model.vocab_size=300"), corpus(10**6, 10**6, vocab=320))


def test_eval_batch_against_the_drivers_devices(tiny_run, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "device_count", lambda: 2)
    preflight.check_devices(micro(tiny_run, "data.eval_batch_size=4"))
    with pytest.raises(PreflightError, match="data.eval_batch_size=3: the driver evaluates on its 2 devices"):
        preflight.check_devices(micro(tiny_run, "data.eval_batch_size=3"))


def test_memory_lower_bound(tiny_run, monkeypatch):
    # driver: 2 copies of P float32 + max(scores B·h·T²·4, logits B·T·V·4) with B = 16, h = 2, T = 32
    cfg = micro(tiny_run)
    fp = {"parameters": 20608, "vocab_size": 257}
    driver = 2 * 20608 * 4 + max(16 * 2 * 32 * 32 * 4, 16 * 32 * 257 * 4)
    learner = 4 * 20608 * 4 + max(4 * 2 * 32 * 32 * 4, 4 * 32 * 257 * 4)
    monkeypatch.setattr(preflight, "physical_memory", lambda: driver + 4 * learner)
    preflight.check_memory(cfg, fp, local=True)
    monkeypatch.setattr(preflight, "physical_memory", lambda: driver + 4 * learner - 1)
    with pytest.raises(PreflightError, match="inner.batch_size=4, data.seq_len=32: the driver and the 4 local"):
        preflight.check_memory(cfg, fp, local=True)
    preflight.check_memory(cfg, fp, local=False)  # learners on other hosts
    monkeypatch.setattr(preflight, "physical_memory", lambda: driver - 1)
    with pytest.raises(PreflightError, match="data.eval_batch_size=16, data.seq_len=32: the driver's evaluation"):
        preflight.check_memory(cfg, fp, local=False)


HEAD = {"Alive": True, "Resources": {"CPU": 4.0, "memory": 1e9}}


def test_resources_each_group_fits_a_node_and_all_fit_the_cluster(tiny_run):
    cfg = micro(tiny_run)  # 4 learners of 1 CPU
    preflight.check_resources(cfg, [HEAD])
    with pytest.raises(PreflightError, match=r"^learners.num_gpus=1: no node of the Ray cluster has 1 GPU \(the most"):
        preflight.check_resources(micro(tiny_run, "learners.num_gpus=1"), [HEAD])
    with pytest.raises(PreflightError, match=r"learners.resources.region_x=1: no node .* has 1 region_x"):
        preflight.check_resources(micro(tiny_run, "learners.resources={region_x: 1}"), [HEAD])
    with pytest.raises(PreflightError, match="learners.count=4: the learners need 8 CPU in all, the Ray cluster has 4"):
        preflight.check_resources(micro(tiny_run, "learners.num_cpus=2"), [HEAD])
    gpu = {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}}
    preflight.check_resources(micro(tiny_run, "learners.count=1", "learners.num_gpus=1"), [HEAD, gpu])
    region = {"Alive": True, "Resources": {"CPU": 8.0, "region_x": 1.0}}
    both = micro(tiny_run, "learners.groups=[{name: g, count: 1, num_gpus: 1, resources: {region_x: 1}}]")
    with pytest.raises(PreflightError, match=r"^learners.groups\[g\]: no node of the Ray cluster has all of"):
        preflight.check_resources(both, [HEAD, gpu, region])
    dead = dict(HEAD, Alive=False)
    with pytest.raises(PreflightError, match="the Ray cluster has no live node"):
        preflight.check_resources(cfg, [dead])


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_gpu_learner_on_the_cpu_only_test_cluster_fails_fast(ray_cluster, tiny_run):
    import time

    import ray

    cfg = micro(tiny_run, "learners.num_gpus=1")
    t0 = time.monotonic()
    with pytest.raises(PreflightError) as e:
        preflight.check_resources(cfg, ray.nodes())
    assert time.monotonic() - t0 < 5
    assert str(e.value).startswith(
        "learners.num_gpus=1: no node of the Ray cluster has 1 GPU (the most any node has: 0)"
    )
    assert "\n" not in str(e.value)
    preflight.check_resources(micro(tiny_run), ray.nodes())  # 4 learners of 1 CPU on the 4-CPU cluster


def test_config_rejects_what_fails_after_ray_starts():
    for override, message in [
        ("seed=-1", "seed=-1 is invalid: must be in [0, 4294967296)"),
        ("chaos.seed=-1", "chaos.seed=-1 is invalid: must be >= 0"),
        ("inner.lr=.inf", "inner.lr=inf is invalid: must be a finite number"),
        ("learners.groups=[{name: g, count: 1, slowdown: .nan}]", "learners.groups[g].slowdown=nan is invalid"),
        ("model.vocab_size=256", "model.vocab_size=256 is invalid: must be 0 (the tokenizer's) or >= 257"),
        ("learners.resources={CPU: 1}", "learners.resources.CPU=1.0 is invalid: use learners.num_cpus"),
        ("learners.num_gpus=0.00001", "learners.num_gpus=1e-05 is invalid: must be 0 or >= 0.0001"),
    ]:
        with pytest.raises(ConfigError) as e:
            config.load(overrides=(override,))
        assert str(e.value).startswith(message), (override, str(e.value))
    # a pre-tokenized Parquet corpus brings its own vocabulary: preflight checks it against the ids
    config.load(overrides=("data.source=parquet:x/*.parquet", "model.vocab_size=10"))
