"""Weights out and back in (`dloco.export`, ``dloco export``, ``dloco eval``, `model.init_from`):
a run trained in process (the services the Ray actors wrap), exported in both formats, loaded into
a fresh model: the same parameters bit for bit and the same logits; evaluated on a second corpus;
used to start another run."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actors.cli import main
from dloco import build, config, export, model, preflight
from dloco.durable import RunDirLock
from dloco.fragments import flatten
from dloco.sim import run_local

SECOND = "All the world's a stage, and all the men and women merely players. " * 40


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory):
    """A finished 2-learner run directory (config.json, fingerprint.json, store/) and its Θ."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = config.load(overrides=(*tiny_run, "learners.count=2", "store.snapshot_every=2"))
    preflight.record(preflight.check(cfg, run_dir), cfg)
    sim = run_local(cfg, run_dir, steps=24)
    theta = {n: np.array(x) for p in range(cfg.fragments.count) for n, x in sim.store.fragment(p)[1].items()}
    versions = list(sim.store.versions)
    sim.store.close()
    assert min(versions) >= 2  # trained: every fragment merged
    return cfg, run_dir, theta, versions


def logits(m: export.Exported, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(m.module().apply({"params": m.params}, jnp.asarray(tokens)))


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_an_export_loads_into_a_fresh_model_with_the_same_parameters_and_logits(trained, tmp_path, fmt):
    cfg, run_dir, theta, versions = trained
    meta = export.export(run_dir, tmp_path / "out", fmt)
    assert (
        meta["format"] == fmt
        and meta["versions"] == versions
        and meta["parameters"] == sum(x.size for x in theta.values())
    )
    loaded = export.load(tmp_path / "out")
    flat = flatten(loaded.params)
    assert set(flat) == set(theta)
    for n, x in theta.items():
        assert flat[n].dtype == np.float32
        np.testing.assert_array_equal(flat[n], x)  # bit for bit
    assert loaded.cfg.model == cfg.model and loaded.vocab_size == 257 and loaded.versions == versions
    tokens = np.arange(2 * cfg.data.seq_len).reshape(2, -1) % 257
    ref = export.read_run(run_dir)  # what the store holds, read straight from the run directory
    np.testing.assert_array_equal(logits(loaded, tokens), logits(ref, tokens))
    if fmt == "safetensors":  # a file any safetensors reader takes, keyed by the model's tensor paths
        from safetensors.numpy import load_file

        raw = load_file(str(tmp_path / "out" / "model.safetensors"))
        assert "embed/embedding" in raw and raw["embed/embedding"].shape == (257, cfg.model.d_model)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model"]["d_model"] == cfg.model.d_model


def test_a_run_dir_is_read_without_its_lock_and_a_kept_snapshot_can_be_chosen(trained, tmp_path):
    _, run_dir, theta, _ = trained
    lock = RunDirLock(run_dir / "store")  # as a running store holds it
    lock.acquire(0)
    try:
        now = export.read_run(run_dir)
    finally:
        lock.release()
    assert all(np.array_equal(x, theta[n]) for n, x in flatten(now.params).items())
    snaps = sorted(int(p.name.split("-")[1]) for p in (run_dir / "store").glob("snap-*"))
    old = export.read_run(run_dir, snapshot=snaps[0])
    meta = json.loads((run_dir / "store" / f"snap-{snaps[0]:08d}" / "meta.json").read_bytes()[32:])
    assert old.versions == meta["versions"] and old.versions != export.read_run(run_dir).versions
    with pytest.raises(FileNotFoundError, match=re.escape(f"kept: {snaps}")):
        export.read_run(run_dir, snapshot=10**6)


def test_dloco_export_and_eval_on_a_second_corpus(trained, tmp_path, capsys):
    cfg, run_dir, _, _ = trained
    (tmp_path / "play.txt").write_text(SECOND)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "x")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "x"), "--data", f"text:{tmp_path}/*.txt", "--batches", "4"]) == 0
    out = dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines())
    loss, ppl = float(out["loss"].split()[0]), float(out["perplexity"])
    assert math.isclose(ppl, math.exp(loss), rel_tol=1e-3)
    # the same numbers by hand: the text, byte-tokenized with EOS, in windows of seq_len + 1
    m = export.load(tmp_path / "x")
    ids = np.append(np.frombuffer(SECOND.encode(), np.uint8).astype(np.int32), 256)
    T, B = cfg.data.seq_len, 16
    batches = [np.stack([ids[i * T : i * T + T + 1] for i in range(b * B, b * B + B)]) for b in range(4)]
    nll = []
    for b in batches:
        lp = jax.nn.log_softmax(logits(m, b[:, :-1]), axis=-1)
        nll.append(-np.take_along_axis(np.asarray(lp), b[:, 1:, None], axis=-1).mean())
    assert loss == pytest.approx(float(np.mean(nll)), abs=1e-4)
    # trained on Python sources, it still knows bytes better than uniform: < ln 257
    assert loss < math.log(257) - 0.5
    # the run directory itself evaluates the same model
    assert main(["eval", str(run_dir), "--data", f"text:{tmp_path}/*.txt", "--batches", "4"]) == 0
    assert f"{loss:.4f}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export", "{tmp}", "--out", "{tmp}/o"], "not a run directory or an export (no config.json)"),
        (["export", "{run}", "--out", "{tmp}/o", "--format", "pickle"], "format 'pickle' is not one of"),
        (["export", "{run}", "--out", "{tmp}"], "exists and is not an empty directory"),
        (["export", "{run}", "--out", "{tmp}/o", "--snapshot", "999999"], "no intact snapshot after 999999"),
        (["eval", "{run}", "--data", "text:{tmp}/none-*.txt"], "matches no files"),
    ],
)
def test_bad_export_and_eval_input_is_one_line(trained, tmp_path, capsys, argv, message):
    (tmp_path / "mine.txt").write_text("a file of the user's")
    run_dir = trained[1]
    argv = [a.format(tmp=tmp_path, run=run_dir) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dloco: ") and message in err and len(err.splitlines()) == 1
    assert (tmp_path / "mine.txt").read_text() == "a file of the user's" and not (tmp_path / "o").exists()


def test_init_from_starts_a_run_from_exported_weights_and_refuses_another_model(trained, tiny_run, tmp_path):
    cfg, run_dir, theta, _ = trained
    export.export(run_dir, tmp_path / "x", "orbax")
    again = config.load(overrides=(*tiny_run, "learners.count=2", f"model.init_from={tmp_path / 'x'}"))
    bp = build.blueprint(again)
    for n, x in flatten(bp.plan.join(list(bp.initial))).items():
        np.testing.assert_array_equal(x, theta[n])
    preflight.check(again, tmp_path / "run2")  # accepted
    other = config.load(overrides=(*tiny_run, "model.d_model=16", f"model.init_from={tmp_path / 'x'}"))
    with pytest.raises(ValueError, match=r"tensor block_0/attn/out/kernel is shape \(32, 32\) there, .* \(16, 16\)"):
        preflight.check(other, tmp_path / "run3")
    # the seed-initialized model differs: init_from really replaced it
    fresh = flatten(model.init_params(bp.model, again.seed, again.data.seq_len))
    assert not np.array_equal(fresh["embed/embedding"], theta["embed/embedding"])
