"""Hugging Face checkpoints out and in (`dloco.hf`, ``dloco export --format hf``,
``model.init_from=hf:DIR``).

Without torch: the rotary layout by hand, the export's files and values, dloco → HF → dloco bit for
bit (llama with GQA, tied, a mixture of experts), bfloat16 and sharded checkpoints, the byte
tokenizer as a ``tokenizer.json``, and the one-line refusals. With the ``hf`` extra (torch,
transformers): HF's own models load every variant and give dloco's logits (max |Δ| ≤ 1e-4,
float32), AutoTokenizer loads every tokenizer kind, and a checkpoint ``save_pretrained`` wrote
starts a dloco model with HF's logits. Without the extra those tests are skipped with the reason."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from actors.cli import main
from dloco import build, config, export, hf, model, preflight
from dloco.config import ConfigError
from dloco.data import Tokenizer
from dloco.data.tokenizer import train_bpe
from dloco.fragments import flatten, unflatten
from dloco.store import StoreCore

TOL = 1e-4  # max |logits_HF − logits_dloco|, float32
VOCAB = 257  # the byte tokenizer's
TEXT = "héllo wörld, <|eos|> is text here\n\tdef f(x): return x ** 2  # €\n"
# llama-micro (d_model 32, 4 query heads, 2 key/value heads, untied) and variants of it
VARIANTS = {
    "gqa-untied": (),
    "tied": ("model.tie_embeddings=true",),
    "mqa-2-layers": ("model.n_kv_heads=1", "model.n_layers=2", "model.rope_base=500.0"),
    "moe": ("model.n_experts=4", "model.experts_per_token=2"),
}


def llama(*overrides: str) -> config.RunConfig:
    return config.load(overrides=("preset=llama-micro", *overrides))


def noisy(cfg: config.RunConfig, vocab: int = VOCAB, seed: int = 0) -> dict:
    """Parameters of the model drawn from N(0, 0.3²) (norm scales from N(1, 0.3²)): logits of order
    1–10, so that the tolerance means something, and every tensor's layout shows in them. Shapes
    from `jax.eval_shape`: nothing compiled."""
    init = functools.partial(model.init_params, model.build(cfg.model, vocab), seed, cfg.data.seq_len)
    rng = np.random.default_rng(seed)
    flat = flatten(jax.eval_shape(init))
    return unflatten(
        {n: (n.endswith("scale") + rng.normal(0, 0.3, s.shape)).astype(np.float32) for n, s in flat.items()}
    )


def logits(cfg: config.RunConfig, params: dict, tokens: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    """dloco's forward pass (jitted: one compiled program, not one per operation)."""
    return np.asarray(jax.jit(model.build(cfg.model, vocab).apply)({"params": params}, jnp.asarray(tokens)))


def tokens(cfg: config.RunConfig, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, (2, cfg.data.seq_len))


def same_bits(a: dict, b: dict) -> bool:
    fa, fb = flatten(a), flatten(b)
    return list(fa) == list(fb) and all(fa[n].dtype == np.float32 and np.array_equal(fa[n], fb[n]) for n in fa)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """variant → (config, Θ, HF export directory), written by `hf.write` with the byte tokenizer."""
    out = {}
    for name, overrides in VARIANTS.items():
        cfg, d = llama(*overrides), tmp_path_factory.mktemp(name)
        theta = noisy(cfg)
        hf.write(d, cfg, theta, VOCAB, None, {"versions": [3]})
        out[name] = (cfg, theta, d)
    return out


@pytest.fixture(scope="module")
def transformers():
    reason = "needs the hf extra (pip install -e '.[hf]'): {} is not installed"
    pytest.importorskip("torch", reason=reason.format("torch"))
    return pytest.importorskip("transformers", reason=reason.format("transformers"))


# ---- without torch ---------------------------------------------------------------------------


def test_the_rope_permutation_turns_interleaved_pairs_into_rotate_half():
    """dloco rotates features (2i, 2i+1), HF's rotate_half (i, i + d/2), both by θ_i: permuted by π,
    dloco's rotation of x is HF's rotation of x permuted."""
    hd, base, t = 8, 10000.0, 5
    order = hf.rope_order(hd)
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    x = np.random.default_rng(0).normal(size=(1, t, 1, hd)).astype(np.float32)
    ours = np.asarray(jax.jit(model.rotary, static_argnums=1)(jnp.asarray(x), base))[0, :, 0]
    inv = base ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(t)[:, None] * np.concatenate([inv, inv])[None]  # HF: cat(freqs, freqs)
    y = x[0, :, 0][:, order]
    theirs = y * np.cos(ang) + np.concatenate([-y[:, hd // 2 :], y[:, : hd // 2]], axis=1) * np.sin(ang)
    np.testing.assert_allclose(ours[:, order], theirs, atol=1e-6)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dloco_to_hf_to_dloco_is_bit_identical(exported, variant):
    cfg, theta, d = exported[variant]
    assert same_bits(export.initial_params(f"hf:{d}", cfg, VOCAB, cfg.data.seq_len), theta)
    names = set(load_file(str(d / "model.safetensors")))
    assert ("lm_head.weight" in names) == (not cfg.model.tie_embeddings)
    if cfg.model.n_experts:  # Mixtral's names: the router and each expert's w1 (gate), w2 (down), w3 (up)
        moe = "model.layers.0.block_sparse_moe"
        assert {f"{moe}.gate.weight", f"{moe}.experts.3.w1.weight", f"{moe}.experts.3.w2.weight"} <= names
        hf_w1 = load_file(str(d / "model.safetensors"))[f"{moe}.experts.3.w1.weight"]
        np.testing.assert_array_equal(hf_w1, theta["block_0"]["moe"]["w_gate"][3].T)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache):
    """A llama-micro run directory (config.json, fingerprint.json, a store snapshot) whose global
    model is a noisy Θ, made without training; and that Θ."""
    d = tmp_path_factory.mktemp("run")
    cfg = llama("fragments.count=2", f"data.cache_dir={data_cache}")
    preflight.record(preflight.check(cfg, d), cfg)
    bp = build.blueprint(cfg)
    theta = noisy(cfg)
    store = StoreCore(d / "store", bp.plan.split(theta), build.initial_outer(cfg, bp))
    store.snapshot()
    store.close()
    return cfg, d, theta


def test_dloco_export_format_hf_writes_hf_files_that_start_a_run_bit_for_bit(run_dir, tmp_path, capsys):
    cfg, d, theta = run_dir
    out = tmp_path / "hf"
    assert main(["export", str(d), "--format", "hf", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out} (hf, 28,064 parameters, fragment versions [0, 0]")
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in out.iterdir()) == files
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    expect = {
        "hidden_size": 32,
        "intermediate_size": 88,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "vocab_size": 257,
        "max_position_embeddings": 32,
        "torch_dtype": "float32",
        "bos_token_id": 256,
        "eos_token_id": 256,
    }
    assert {k: c[k] for k in expect} == expect
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|eos|>"
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert f.metadata()["format"] == "pt"  # transformers refuses a safetensors file without it
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert q.dtype == np.float32 and q.shape == (32, 32)
    np.testing.assert_array_equal(q[:8], theta["block_0"]["attn"]["q"]["kernel"][:, [0, 2, 4, 6, 1, 3, 5, 7]].T)
    # back in: the driver's and store's initial model (`build.blueprint`) is Θ bit for bit
    again = config.load(overrides=(*_overrides(cfg), f"model.init_from=hf:{out}"))
    preflight.check(again, tmp_path / "next")
    assert same_bits(unflatten({n: x for f in build.blueprint(again).initial for n, x in f.items()}), theta)


def _overrides(cfg: config.RunConfig) -> tuple[str, ...]:
    return ("preset=llama-micro", "fragments.count=2", f"data.cache_dir={cfg.data.cache_dir}")


def test_the_byte_tokenizer_as_a_tokenizer_json_encodes_as_dloco_does(exported):
    tok = Tokenizer.from_file(exported["tied"][2] / "tokenizer.json")
    byte = Tokenizer.byte()
    assert (tok.eos_id, tok.vocab_size) == (256, 257)
    np.testing.assert_array_equal(tok.encode(TEXT, eos=True), byte.encode(TEXT, eos=True))
    assert tok.decode(byte.encode(TEXT)) == TEXT


def _edit(src, dst, config_changes=None, drop=(), add=None):
    """A copy of the HF export `src` in `dst` with config.json fields changed and tensors dropped or added."""
    dst.mkdir()
    c = json.loads((src / "config.json").read_text()) | (config_changes or {})
    (dst / "config.json").write_text(json.dumps(c))
    tensors = {n: x for n, x in load_file(str(src / "model.safetensors")).items() if n not in drop}
    save_file(tensors | (add or {}), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_bfloat16_or_sharded_checkpoint_is_read_as_float32(exported, tmp_path):
    """HF checkpoints are often bfloat16, and large ones sharded under ``model.safetensors.index.json``."""
    cfg, theta, src = exported["gqa-untied"]
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_bytes((src / "config.json").read_bytes())
    tensors = {n: x.astype(ml_dtypes.bfloat16) for n, x in load_file(str(src / "model.safetensors")).items()}
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(d / file), metadata={"format": "pt"})
    index = {"weight_map": {n: file for file, part in shards.items() for n in part}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    got = export.initial_params(f"hf:{d}", cfg, VOCAB, cfg.data.seq_len)
    assert same_bits(
        got, unflatten({n: x.astype(ml_dtypes.bfloat16).astype(np.float32) for n, x in flatten(theta).items()})
    )


@pytest.mark.parametrize(
    "overrides, edit, message",
    [
        (("model.d_model=64",), {}, "config.json's hidden_size is 32, the config's model needs 64 (model.d_model)"),
        (
            ("model.n_kv_heads=4",),
            {},
            "config.json's num_key_value_heads is 2, the config's model needs 4 (model.n_kv_heads)",
        ),
        (
            (),
            {"config_changes": {"model_type": "mistral"}},
            "config.json's model_type is 'mistral', the config's model needs 'llama' (model.n_experts: 0 llama, "
            "> 0 mixtral)",
        ),
        (
            (),
            {"config_changes": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}},
            "config.json's rope_type is 'llama3', the config's model needs 'default' (dloco's rotary)",
        ),
        (
            (),
            {"config_changes": {"rms_norm_eps": 1e-5}},
            "config.json's rms_norm_eps is 1e-05, the config's model needs 1e-06 (dloco's RMSNorm)",
        ),
        (
            (),
            {"drop": ("model.layers.0.self_attn.k_proj.weight",)},
            "tensor model.layers.0.self_attn.k_proj.weight is missing there, the config's model needs shape (16, 32)",
        ),
        (
            (),
            {"add": {"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}},
            "tensor model.layers.0.self_attn.q_proj.bias is there, and the config's model has no such tensor",
        ),
    ],
)
def test_an_hf_checkpoint_that_does_not_fit_is_named_in_one_line(exported, tmp_path, overrides, edit, message):
    cfg, _, src = exported["gqa-untied"]
    d = _edit(src, tmp_path / "ckpt", **edit)
    other = llama(*overrides)
    with pytest.raises(ValueError) as e:
        export.initial_params(f"hf:{d}", other, VOCAB, other.data.seq_len)
    assert str(e.value) == f"model.init_from=hf:{d}: {message}"


def test_preflight_refuses_an_hf_checkpoint_of_another_model_in_one_line(exported, data_cache, tmp_path):
    d = exported["gqa-untied"][2]
    cfg = llama(f"data.cache_dir={data_cache}", "model.n_layers=2", f"model.init_from=hf:{d}")
    with pytest.raises(ValueError) as e:
        preflight.check(cfg, tmp_path / "run")
    assert str(e.value) == (
        f"model.init_from=hf:{d}: config.json's num_hidden_layers is 1, the config's model needs 2 (model.n_layers)"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.init_from='hf:'",), "model.init_from='hf:' is invalid: hf: needs a directory: hf:DIR"),
        (
            ("preset=micro", "model.init_from=hf:x"),
            "model.init_from='hf:x' is invalid: a Hugging Face checkpoint (hf:DIR) starts dloco's llama family: "
            "set model.family=llama, no model.factory",
        ),
    ],
)
def test_init_from_hf_is_validated_with_the_config(overrides, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        config.load(overrides=overrides)


def test_the_classic_family_and_a_pretokenized_corpus_are_refused_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config.load(overrides=("preset=micro",)).to_dict()))
    (run / "fingerprint.json").write_text(json.dumps({"tokenizer": {"kind": "byte"}}))
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "dloco: --format hf writes the llama family (as Llama or Mixtral); this run's model.family=classic "
        "(a GELU MLP, fused qkv) matches no Hugging Face architecture: use --format safetensors\n"
    )
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match=r"^--format hf writes the run's tokenizer, and this run's corpus is pre-"):
        hf.check_exportable(llama(), "pretokenized")
    with pytest.raises(ValueError, match=r"^--format hf writes dloco's llama family; this run's model is model.fa"):
        hf.check_exportable(llama("model.factory=m:f"), "byte")


# ---- against transformers (the hf extra) -----------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_loads_each_variant_with_dloco_logits(exported, transformers, variant):
    import torch

    cfg, theta, d = exported[variant]
    m = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert type(m).__name__ == ("MixtralForCausalLM" if cfg.model.n_experts else "LlamaForCausalLM")
    ids = tokens(cfg)
    with torch.no_grad():
        theirs = m(torch.as_tensor(ids)).logits.numpy()
    ours = logits(cfg, theta, ids)
    diff = float(np.abs(theirs - ours).max())
    print(f"{variant}: max |logits_HF - logits_dloco| = {diff:.2e} (max |logit| {np.abs(ours).max():.1f})")
    assert np.abs(ours).max() > 1.0 and diff <= TOL


@pytest.mark.parametrize("kind", ["byte", "bpe", "file"])
def test_autotokenizer_loads_every_tokenizer_kind_with_dloco_ids_and_eos(exported, transformers, tmp_path, kind):
    texts = [f"document {i}: the quick brown fox, the lazy dog {i * i}\n" for i in range(200)]
    if kind == "byte":
        d, tok = exported["tied"][2], Tokenizer.byte()
    else:
        d = tmp_path
        tok = train_bpe(texts, 300)
        if kind == "file":  # a pretrained tokenizer.json whose EOS is </s>
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import models

            backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "the", "fox"])}, "[UNK]"))
            backend.add_special_tokens(["</s>"])
            (tmp_path / "pretrained.json").write_text(backend.to_str())
            tok = Tokenizer.from_file(tmp_path / "pretrained.json")
        hf.write_tokenizer(d, tok._backend.to_str(), tok.vocab_size)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    text = TEXT if kind != "file" else "the fox the"
    assert theirs(text)["input_ids"] == tok.encode(text).tolist()
    assert theirs.eos_token_id == tok.eos_id and theirs.eos_token == {"file": "</s>"}.get(kind, "<|eos|>")
    assert theirs.decode(tok.encode(text).tolist()) == tok.decode(tok.encode(text))


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_save_pretrained_checkpoint_starts_a_dloco_model_with_its_logits(transformers, tmp_path, arch):
    import torch

    cfg = llama("model.n_experts=4") if arch == "mixtral" else llama()
    dims = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 88,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if arch == "mixtral":
        hf_cfg = transformers.MixtralConfig(**dims, num_local_experts=4, num_experts_per_tok=2)
        m = transformers.MixtralForCausalLM(hf_cfg)
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():  # away from HF's init (norms of 1, weights of 0.02): logits of order 1–10
            p.add_(torch.randn_like(p) * 0.3)
    m.save_pretrained(tmp_path)
    params = export.initial_params(f"hf:{tmp_path}", cfg, VOCAB, cfg.data.seq_len)
    ids = tokens(cfg)
    with torch.no_grad():
        theirs = m(torch.as_tensor(ids)).logits.numpy()
    ours = logits(cfg, params, ids)
    diff = float(np.abs(theirs - ours).max())
    print(f"{arch} save_pretrained: max |logits_HF - logits_dloco| = {diff:.2e}")
    assert np.abs(ours).max() > 1.0 and diff <= TOL
