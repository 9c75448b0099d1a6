"""Fragments (ALGORITHM.md §3): bin-packing balance, the send schedule, conversions."""

import numpy as np
import pytest

from dloco import fragments


def gpt_like(n_layers: int, d: int, vocab: int) -> dict:
    """A realistic parameter tree (shapes only matter): GPT-style blocks and a tied embedding."""
    z = np.zeros
    blocks = {
        f"block_{i}": {
            "attn": {"qkv": {"kernel": z((d, 3 * d))}, "out": {"kernel": z((d, d))}},
            "attn_norm": {"scale": z(d)},
            "mlp_in": {"kernel": z((d, 4 * d))},
            "mlp_out": {"kernel": z((4 * d, d))},
            "mlp_norm": {"scale": z(d)},
        }
        for i in range(n_layers)
    }
    return {"embed": {"embedding": z((vocab, d))}, "final_norm": {"scale": z(d)}, **blocks}


@pytest.mark.parametrize(
    ("n_layers", "d", "P"), [(12, 768, 4), (12, 768, 8), (12, 768, 24), (4, 256, 4), (24, 1024, 16)]
)
def test_bin_packing_balance(n_layers, d, P):
    params = gpt_like(n_layers, d, vocab=8192)
    plan = fragments.partition(params, P)
    assert plan.fragments[0].embedding and plan.fragments[0].names == ("embed/embedding",)
    rest = plan.fragments[1:]
    assert not any(f.embedding for f in rest)
    ideal = sum(f.size for f in rest) / len(rest)
    assert max(f.size for f in rest) <= 4 / 3 * ideal
    # every tensor is in exactly one fragment
    names = [n for f in plan.fragments for n in f.names]
    assert sorted(names) == sorted(plan.names) and len(names) == len(set(names))


def test_partition_hand_example_and_determinism():
    # sizes a=10, b=6, c=5, d=4 into 2 bins (no embedding): a→0, b→1, c→1 (6<10), d→0 (10<11)
    params = {"a": np.zeros(10), "b": np.zeros(6), "c": np.zeros(5), "d": np.zeros(4)}
    plan = fragments.partition(params, 2)
    assert [f.names for f in plan.fragments] == [("a", "d"), ("b", "c")]
    assert [f.size for f in plan.fragments] == [14, 11]
    assert fragments.partition(params, 2) == plan


def test_single_fragment_holds_everything():
    plan = fragments.partition(gpt_like(2, 64, 100), 1)
    assert plan.count == 1 and set(plan.fragments[0].names) == set(plan.names)
    assert fragments.embedding_names(plan.names) == {"embed/embedding"}


def test_too_many_fragments_is_a_clear_error():
    with pytest.raises(ValueError, match="fragments.count=6 is invalid: the model has only 4 non-embedding tensors"):
        fragments.partition({"embed": {"embedding": np.zeros(3)}, **{k: np.zeros(2) for k in "abcd"}}, 6)


@pytest.mark.parametrize(("H", "P"), [(24, 4), (24, 1), (24, 24), (12, 3), (48, 8)])
def test_due_sends_each_fragment_once_per_every_steps(H, P):
    plan = fragments.partition({f"t{i:02d}": np.zeros(1) for i in range(P)}, P)
    sends = {p: [] for p in range(P)}
    for t in range(1, 10 * H + 1):
        for p in plan.due(t, H):
            sends[p].append(t)
    for p in range(P):
        o = p * H // P
        assert sends[p] == [t for t in range(1, 10 * H + 1) if (t - o) % H == 0]
        for start in range(1, 9 * H + 1):  # every window of H consecutive steps holds exactly one send
            assert sum(start <= t < start + H for t in sends[p]) == 1
    assert plan.due(0, H) == ()


def test_due_offsets_evenly_spaced():
    plan = fragments.partition({f"t{i}": np.zeros(1) for i in range(4)}, 4)
    assert [plan.due(t, 24) for t in (6, 12, 18, 24, 30)] == [(1,), (2,), (3,), (0,), (1,)]


def test_extract_install_join_round_trip():
    rng = np.random.default_rng(0)
    params = {
        "embed": {"embedding": rng.normal(size=(5, 4))},
        "a": {"w": rng.normal(size=(4, 4))},
        "b": rng.normal(size=3),
    }
    plan = fragments.partition(params, 2)
    parts = plan.split(params)
    assert all(a.dtype == np.float32 for f in parts for a in f.values())
    rebuilt = plan.join(parts)
    np.testing.assert_allclose(rebuilt["a"]["w"], params["a"]["w"], rtol=1e-6)
    new = plan.install(params, {"b": np.ones(3)})
    np.testing.assert_array_equal(new["b"], np.ones(3))
    np.testing.assert_array_equal(new["a"]["w"], params["a"]["w"])
    np.testing.assert_allclose(plan.extract(new, 1)["b"], np.ones(3))
    with pytest.raises(KeyError):
        plan.install(params, {"nope": np.ones(1)})
    with pytest.raises(KeyError):
        plan.join(parts[:1])
