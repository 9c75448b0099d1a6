"""`model.factory`: a model of the user's own (any Flax linen module mapping ids to logits) trains,
merges and exports like ours, without forking dloco."""

import textwrap

import numpy as np
import pytest

from dloco import build, config, export, inner, preflight
from dloco.config import ConfigError
from dloco.fragments import flatten
from dloco.sim import run_local

USER_MODEL = textwrap.dedent(
    '''
    import flax.linen as nn
    import jax.numpy as jnp

    class Bigram(nn.Module):
        """Logits from the previous token alone: an embedding and a bias."""
        vocab: int
        width: int

        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(self.vocab, self.width, name="embed")(tokens)
            return nn.Dense(self.vocab, name="out")(jnp.tanh(x))

    def build(cfg, vocab_size):
        return Bigram(vocab_size, cfg.d_model)

    def not_a_module(cfg, vocab_size):
        return "a string"
    '''
)


@pytest.fixture
def user_model(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_models:build"


def test_a_model_of_your_own_trains_merges_and_exports(user_model, tiny_run, tmp_path):
    cfg = config.load(overrides=(*tiny_run, f"model.factory={user_model}", "learners.count=2"))
    bp = build.blueprint(cfg)
    assert type(bp.model).__name__ == "Bigram" and set(flatten(bp.plan.join(list(bp.initial)))) == {
        "embed/embedding",
        "out/kernel",
        "out/bias",
    }
    assert bp.plan.fragments[0].embedding and bp.plan.fragments[0].names == ("embed/embedding",)
    run_dir = tmp_path / "run"
    preflight.record(preflight.check(cfg, run_dir), cfg)
    run = run_local(cfg, run_dir, steps=48)
    mesh = inner.make_mesh()
    step, batches = inner.make_eval_step(bp.model, mesh), build.eval_set(cfg, bp.corpus)
    before = inner.evaluate(step, inner.replicate(bp.plan.join(list(bp.initial)), mesh), batches, mesh)
    theta = bp.plan.join([run.store.fragment(p)[1] for p in range(bp.plan.count)])
    after = inner.evaluate(step, inner.replicate(theta, mesh), batches, mesh)
    assert after < before - 0.3  # a bigram model learns byte statistics
    run.store.close()
    export.export(run_dir, tmp_path / "x", "safetensors")
    loaded = export.load(tmp_path / "x")
    assert type(loaded.module()).__name__ == "Bigram"
    for n, x in flatten(theta).items():
        np.testing.assert_array_equal(flatten(loaded.params)[n], x)


def test_a_bad_factory_is_one_line(user_model, tiny_run):
    with pytest.raises(ConfigError, match=r"model.factory='my_models' is invalid: must be 'package.module:function'"):
        config.load(overrides=("model.factory=my_models",))
    for factory, message in [
        ("nowhere_module:build", "model.factory=nowhere_module:build: cannot load it (No module named"),
        ("my_models:missing", "model.factory=my_models:missing: cannot load it"),
        ("my_models:not_a_module", "returned str, not a flax.linen Module"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            build.blueprint(config.load(overrides=(*tiny_run, f"model.factory={factory}")))
