"""Config: defaults from ALGORITHM.md §2, presets, YAML + overrides, one-line errors."""

import re

import pytest

from dloco import config
from dloco.config import ConfigError


def test_one_truth_the_default_preset_is_the_dataclass_defaults():
    # `dloco train` with no arguments loads the tiny preset: it changes no field, so the documented
    # dataclass defaults are what runs (README's "What the default run does" is checked in test_docs)
    assert config.load().to_dict() == config.RunConfig().to_dict()
    c = config.load()
    assert (c.learners.count, c.fragments.count, c.sync.every, c.sync.overlap) == (4, 4, 24, 2)
    assert (c.syncer.quorum, c.syncer.grace_factor, c.syncer.max_grace_steps) == (1, 0.5, 1.0)
    assert c.preset == "tiny" and c.data.source == "stdlib" and c.algorithm == "decoupled"


def test_presets_change_the_model_and_data_never_the_algorithm():
    default = config.RunConfig()
    for preset in config.PRESETS:
        c = config.load(overrides=(f"preset={preset}",))
        for section in ("outer", "merge", "learner", "syncer", "compression", "fragments"):
            assert getattr(c, section) == getattr(default, section), (preset, section)


def test_overrides_and_types():
    c = config.load(overrides=("sync.every=48", "outer.lr=1", "learners.resources={region_a: 1}"))
    assert c.sync.every == 48
    assert c.outer.lr == 1.0 and isinstance(c.outer.lr, float)
    assert dict(c.learners.resources) == {"region_a": 1.0}


def test_small_preset_and_yaml(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("preset: small\nsync:\n  overlap: 3\nlearners:\n  count: 8\n")
    c = config.load(f, overrides=("syncer.quorum=2",))
    assert c.model.d_model == 256 and c.sync.every == 48 and c.sync.overlap == 3
    assert c.learners.count == 8 and c.syncer.quorum == 2


def test_replace_revalidates():
    c = config.replace(config.load(), "fragments.count=2")
    assert c.fragments.count == 2
    with pytest.raises(ConfigError, match="fragments.count=5"):
        config.replace(c, "fragments.count=5")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("sync.overlap=6",), r"sync.overlap=6 is invalid: must be < sync.every / fragments.count = 6"),
        (("syncer.quorum=5",), r"syncer.quorum=5 is invalid: must be <= learners.count=4"),
        (("sync.bogus=1",), r"sync.bogus=1 is invalid: unknown key; allowed keys here: dynamic, every, overlap"),
        (("nosection.x=1",), r"nosection=.* unknown key"),
        (("sync.every=25",), r"sync.every=25 is invalid: must be a multiple of fragments.count=4"),
        (("fragments.count=30",), r"fragments.count=30 is invalid: must be <= sync.every=24"),
        (
            ("compression.dtype=int3",),
            r"compression.dtype='int3' is invalid: must be one of fp32, bf16, int8, int4, int2",
        ),
        (
            ("compression.dtype=int2", "compression.block=6"),
            r"compression.block=6 is invalid: must be a multiple of 4 for int2",
        ),
        (("learner.receive=merge",), r"learner.receive='merge' is invalid: must be one of overwrite, blend, rebase"),
        (("sync.every=abc",), r"sync.every='abc' is invalid: must be an integer"),
        (("outer.momentum=1.0",), r"outer.momentum=1.0 is invalid: must be in \[0, 1\)"),
        (("model.d_model=100",), r"model.d_model=100 is invalid: must be a multiple of model.n_heads=4"),
        (("preset=huge",), r"preset='huge' is invalid: must be one of tiny, micro, mini, small"),
        (("algorithm=sgd",), r"algorithm='sgd' is invalid"),
        (("syncer.quorum=0",), r"syncer.quorum=0 is invalid: must be > 0"),
        (("inner.warmup_steps=400",), r"inner.warmup_steps=400 is invalid: must be < inner.total_steps=400"),
        (("budget.tokens=0",), r"budget.tokens=0 is invalid: set budget.tokens, budget.seconds or budget.steps > 0"),
        (("sync.every",), r"override='sync.every' is invalid: use dotted KEY=VALUE"),
        (
            ("algorithm=diloco", "sync.dynamic=true"),
            r"sync.dynamic=True is invalid: is for algorithm=decoupled only \(diloco's learners push on a fixed",
        ),
    ],
)
def test_invalid_values_name_field_value_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        config.load(overrides=overrides)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_yaml_must_be_mapping(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        config.load(f)


def test_frozen():
    c = config.load()
    with pytest.raises(AttributeError):
        c.sync.every = 3  # type: ignore[misc]


def test_baselines_install_merges_as_their_papers_do():
    receive = {a: config.load(overrides=(f"algorithm={a}",)).learner.receive for a in config.ALGORITHMS}
    assert receive == {
        "decoupled": "rebase",
        "diloco": "overwrite",
        "streaming": "blend",
        "dp": "overwrite",
        "elastic_dp": "overwrite",
    }


def test_only_decoupled_times_its_pushes_dynamically_by_default():
    dynamic = {a: config.load(overrides=(f"algorithm={a}",)).sync.dynamic for a in config.ALGORITHMS}
    assert dynamic == {"decoupled": True, "diloco": False, "streaming": False, "dp": False, "elastic_dp": False}


def test_numbers_in_any_notation_from_yaml_and_overrides(tmp_path):
    """PyYAML (YAML 1.1) reads ``3e-4`` and ``2e8`` as strings: they are numbers all the same, an
    integral one fits an int field, and anything else is still refused naming the field."""
    cfg = config.load(overrides=("inner.lr=3e-4", "budget.tokens=2e8", "sync.every=1_000", "outer.lr=.7"))
    assert (cfg.inner.lr, cfg.budget.tokens, cfg.sync.every, cfg.outer.lr) == (3e-4, 200_000_000, 1000, 0.7)
    assert type(cfg.budget.tokens) is int and type(cfg.inner.lr) is float
    (tmp_path / "run.yaml").write_text("inner: {lr: 3e-4, weight_decay: 1E-2}\nbudget: {tokens: 2.0e+6}\n")
    cfg = config.load(tmp_path / "run.yaml")
    assert (cfg.inner.lr, cfg.inner.weight_decay, cfg.budget.tokens) == (3e-4, 0.01, 2_000_000)
    for override, message in (
        ("budget.tokens=2.5e0", "budget.tokens='2.5e0' is invalid: must be an integer"),
        ("inner.lr=3e-4x", "inner.lr='3e-4x' is invalid: must be a number"),
        ("budget.tokens=true", "budget.tokens=True is invalid: must be an integer"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config.load(overrides=(override,))
