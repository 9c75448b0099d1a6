"""The llama family as a Hugging Face checkpoint: out (``dloco export --format hf``) and back in
(``model.init_from=hf:DIR``), with numpy and safetensors alone (no torch).

An HF export is a directory that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` read:

    config.json             a LlamaConfig (a MixtralConfig for a mixture of experts)
    model.safetensors       float32 tensors under HF's names and layouts (below)
    generation_config.json  BOS, EOS and padding: the run's EOS
    tokenizer.json          the run's tokenizer: its BPE or pretrained file, or the byte tokenizer
                            written as a byte-level BPE without merges (ids = bytes, EOS 256)
    tokenizer_config.json   a PreTrainedTokenizerFast whose EOS (and BOS) is the run's EOS

Layouts. A Flax ``Dense`` kernel is [in, out], a torch ``Linear`` weight [out, in]: every kernel is
transposed. Rotary pairs differ: `dloco.model.rotary` rotates interleaved features (2i, 2i+1) by
θ_i = base^(−2i/d), HF's ``rotate_half`` rotates (i, i + d/2) by θ_i. So within each head the q and
k projection rows are permuted, HF row j = dloco feature π(j) with π = (0, 2, 4, …, 1, 3, 5, …):
q·k is unchanged when q and k are permuted alike, and the rotation acts on the same pairs. Experts
stacked [E, in, out] are E ``Linear`` weights each (Mixtral: w1 the gate, w3 the up, w2 the down
projection); the router kernel [d, E] is ``gate.weight`` [E, d]. Tied embeddings write no
``lm_head.weight``. Every conversion moves values without arithmetic: dloco → HF → dloco is the
same bits.

A mixture of experts is Mixtral's function exactly: router probabilities softmax(x·W_r) in float32,
the top k experts per token weighted by their renormalized probabilities, SwiGLU experts
(`dloco.model.MoE`; HF's ``MixtralSparseMoeBlock``). Only the balance loss, which inference does not
compute, is defined otherwise (`hf_config`).

The classic family (a GELU MLP, one fused qkv) and a model of your own (`model.factory`) match no
HF architecture and are refused, as is a run on a pre-tokenized corpus (no tokenizer to write).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors.numpy reads bf16 checkpoints with it)
import numpy as np

from dloco import model
from dloco.config import ModelConfig, RunConfig
from dloco.data.tokenizer import BPE_EOS_TOKEN, EOS_TOKENS
from dloco.fragments import flatten, unflatten

RMS_EPS = 1e-6  # flax's RMSNorm epsilon, which dloco's norms use
# what HF's configs take for a key they do not hold, by model_type
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": None},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8},
}
UNUSED = (".rotary_emb.inv_freq",)  # buffers older checkpoints saved: recomputed, not weights


def check_exportable(cfg: RunConfig, tokenizer_kind: str) -> None:
    """Raises a one-line `ValueError` saying why the run's model cannot be written as an HF
    checkpoint: not the llama family, a model of your own, or no tokenizer (a pre-tokenized corpus)."""
    mc = cfg.model
    if mc.factory:
        raise ValueError(
            f"--format hf writes dloco's llama family; this run's model is model.factory={mc.factory}, "
            "whose tensors have no Hugging Face layout: use --format safetensors"
        )
    if mc.family != "llama":
        raise ValueError(
            f"--format hf writes the llama family (as Llama or Mixtral); this run's model.family={mc.family} "
            "(a GELU MLP, fused qkv) matches no Hugging Face architecture: use --format safetensors"
        )
    if tokenizer_kind == "pretokenized":
        raise ValueError(
            "--format hf writes the run's tokenizer, and this run's corpus is pre-tokenized (a tokens column): "
            "it has none; use --format safetensors"
        )


def _rows(mc: ModelConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """(dloco name, HF names, how) for every tensor, in HF's order. How: ``same`` (as is), ``t``
    (transposed), ``rope`` (transposed, rows permuted per head: module docstring), ``experts``
    ([E, in, out] ↔ E transposed weights)."""
    rows: list[tuple[str, tuple[str, ...], str]] = [("embed/embedding", ("model.embed_tokens.weight",), "same")]
    for i in range(mc.n_layers):
        b, h = f"block_{i}", f"model.layers.{i}"
        rows += [
            (f"{b}/attn_norm/scale", (f"{h}.input_layernorm.weight",), "same"),
            (f"{b}/attn/q/kernel", (f"{h}.self_attn.q_proj.weight",), "rope"),
            (f"{b}/attn/k/kernel", (f"{h}.self_attn.k_proj.weight",), "rope"),
            (f"{b}/attn/v/kernel", (f"{h}.self_attn.v_proj.weight",), "t"),
            (f"{b}/attn/out/kernel", (f"{h}.self_attn.o_proj.weight",), "t"),
            (f"{b}/mlp_norm/scale", (f"{h}.post_attention_layernorm.weight",), "same"),
        ]
        if mc.n_experts:
            m = f"{h}.block_sparse_moe"
            rows.append((f"{b}/moe/router/kernel", (f"{m}.gate.weight",), "t"))
            for ours, w in (("w_gate", "w1"), ("w_out", "w2"), ("w_in", "w3")):
                rows.append(
                    (f"{b}/moe/{ours}", tuple(f"{m}.experts.{e}.{w}.weight" for e in range(mc.n_experts)), "experts")
                )
        else:
            for ours, theirs in (("mlp_gate", "gate_proj"), ("mlp_up", "up_proj"), ("mlp_down", "down_proj")):
                rows.append((f"{b}/{ours}/kernel", (f"{h}.mlp.{theirs}.weight",), "t"))
    rows.append(("final_norm/scale", ("model.norm.weight",), "same"))
    if not mc.tie_embeddings:
        rows.append(("lm_head/kernel", ("lm_head.weight",), "t"))
    return rows


def rope_order(head_dim: int) -> np.ndarray:
    """π: HF's rotary feature j is dloco's feature π(j) (pairs (2i, 2i+1) → (i, i + head_dim/2))."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def _per_head_rows(x: np.ndarray, order: np.ndarray) -> np.ndarray:
    """`x` [heads·hd, d] with the rows of each head in `order`."""
    return x.reshape(-1, len(order), x.shape[1])[:, order].reshape(x.shape)


def to_hf(params: dict, mc: ModelConfig) -> dict[str, np.ndarray]:
    """The model's parameters under HF's names and layouts (module docstring), float32, contiguous."""
    flat, hd = flatten(params), mc.d_model // mc.n_heads
    out: dict[str, np.ndarray] = {}
    for ours, theirs, how in _rows(mc):
        x = np.asarray(flat[ours], np.float32)
        if how == "experts":
            out.update({n: np.ascontiguousarray(w.T) for n, w in zip(theirs, x, strict=True)})
            continue
        if how == "rope":  # [d, heads·hd] → [heads·hd, d], rows permuted within each head
            x = _per_head_rows(x.T, rope_order(hd))
        out[theirs[0]] = np.ascontiguousarray(x.T if how == "t" else x)
    return out


def from_hf(tensors: dict[str, np.ndarray], mc: ModelConfig) -> dict:
    """The inverse of `to_hf`: the model's nested parameter tree, float32 (names and shapes checked
    by `read`)."""
    hd, flat = mc.d_model // mc.n_heads, {}
    for ours, theirs, how in _rows(mc):
        xs = [np.asarray(tensors[n], np.float32) for n in theirs]
        if how == "experts":
            flat[ours] = np.stack([w.T for w in xs])
        elif how == "rope":
            flat[ours] = np.ascontiguousarray(_per_head_rows(xs[0], np.argsort(rope_order(hd))).T)
        else:
            flat[ours] = np.ascontiguousarray(xs[0].T if how == "t" else xs[0])
    return unflatten(flat)


def _hf_shapes(mc: ModelConfig, vocab_size: int, seq_len: int) -> dict[str, tuple[int, ...]]:
    """The HF name → shape of every tensor of the model `mc` builds (from `jax.eval_shape`: nothing computed)."""
    init = functools.partial(model.init_params, model.build(mc, vocab_size), 0, seq_len)
    shapes = {n: tuple(s.shape) for n, s in flatten(jax.eval_shape(init)).items()}
    out = {}
    for ours, theirs, how in _rows(mc):
        s = shapes[ours]
        out.update({n: s if how == "same" else s[-2:][::-1] for n in theirs})
    return out


def hf_config(mc: ModelConfig, vocab_size: int, seq_len: int, eos_id: int) -> dict[str, Any]:
    """``config.json``: a LlamaConfig, or a MixtralConfig for a mixture of experts. The rotary base
    is written both ways HF has read it (``rope_theta``; ``rope_parameters`` from transformers 5).
    BOS is EOS: documents are joined by EOS, so EOS is what precedes each one (as GPT-2's)."""
    moe = bool(mc.n_experts)
    c: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "vocab_size": vocab_size,
        "hidden_size": mc.d_model,
        "intermediate_size": model.swiglu_hidden(mc),
        "num_hidden_layers": mc.n_layers,
        "num_attention_heads": mc.n_heads,
        "num_key_value_heads": mc.n_kv_heads or mc.n_heads,
        "head_dim": mc.d_model // mc.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": seq_len,  # trained at this length; the rotary has no limit of its own
        "rms_norm_eps": RMS_EPS,
        "rope_theta": mc.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope_base},
        "tie_word_embeddings": mc.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",  # the parameters' dtype, whatever `model.dtype` computed in
    }
    if moe:  # the same top-k softmax routing, renormalized (`dloco.model.MoE`)
        # HF's balance loss pools the layers and counts each of the k slots (k× dloco's per layer):
        # the weight only matters to training in HF, and is carried over as is
        c |= {
            "num_local_experts": mc.n_experts,
            "num_experts_per_tok": mc.experts_per_token,
            "router_aux_loss_coef": mc.moe_aux_weight,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    else:
        c["mlp_bias"] = False
    return c


def byte_tokenizer_json() -> str:
    """dloco's byte tokenizer as a ``tokenizer.json``: a byte-level BPE with no merges whose token
    for byte b (GPT-2's printable character for it) has id b, and ``<|eos|>`` as id 256."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(rest)}
    backend = HFTokenizer(models.BPE({char[b]: b for b in range(256)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([BPE_EOS_TOKEN])
    return backend.to_str()


def write_tokenizer(out: Path, tokenizer_json: str, vocab_size: int) -> int:
    """Writes `tokenizer_json` and a ``tokenizer_config.json`` naming its EOS, dloco's (the first of
    `EOS_TOKENS` it has), into `out`; returns the EOS id. A `ValueError` if it has no EOS or more ids
    than the model has rows."""
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_str(tokenizer_json)
    found = next(((t, i) for t in EOS_TOKENS if (i := backend.token_to_id(t)) is not None), None)
    if found is None:
        raise ValueError(f"the run's tokenizer has no end-of-sequence token: none of {', '.join(EOS_TOKENS)}")
    if (n := backend.get_vocab_size(with_added_tokens=True)) > vocab_size:
        raise ValueError(f"the run's tokenizer has {n} ids, more than the model's vocabulary of {vocab_size}")
    eos, eos_id = found
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": False,  # decode gives the text back as dloco's decode does
        "split_special_tokens": True,  # "<|eos|>" in a text is text, as dloco encodes it (`Tokenizer`)
    }
    (out / "tokenizer.json").write_text(tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return int(eos_id)


def write(out: Path, cfg: RunConfig, params: dict, vocab_size: int, tokenizer_file: Path | None, meta: dict) -> None:
    """Writes the HF export of `params` (the model `cfg` builds with `vocab_size` rows) into the
    existing directory `out`; `tokenizer_file` is the run's ``tokenizer.json`` (None: the byte
    tokenizer); `meta` goes into the safetensors header, as strings, beside HF's ``format: pt``."""
    from safetensors.numpy import save_file

    if tokenizer_file is None and cfg.data.tokenizer != "byte":
        raise ValueError(f"the run's tokenizer (data.tokenizer={cfg.data.tokenizer}) is not found: no tokenizer.json")
    tok = byte_tokenizer_json() if tokenizer_file is None else tokenizer_file.read_text()
    eos_id = write_tokenizer(out, tok, vocab_size)
    files = {
        "config.json": hf_config(cfg.model, vocab_size, cfg.data.seq_len, eos_id),
        "generation_config.json": {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id},
    }
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2))
    header = {"format": "pt", **{f"dloco_{k}": str(v) for k, v in meta.items()}}
    save_file(to_hf(params, cfg.model), str(out / "model.safetensors"), metadata=header)


def _json(file: Path, where: str) -> dict:
    """The JSON object in `file` of an HF checkpoint; one line naming `where` and the file if it is not one."""
    try:
        obj = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no {file.name} in {file.parent}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {file.name} is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: {file.name} is not a JSON object")
    return obj


def check_config(hf: dict, mc: ModelConfig, vocab_size: int, where: str) -> None:
    """Raises a one-line `ValueError` naming the first field of the HF config `hf` that differs
    from the model `mc` builds with `vocab_size` rows (and the setting of ours that decides it)."""
    kind = hf.get("model_type")
    moe = "mixtral" if mc.n_experts else "llama"
    got = DEFAULTS.get(str(kind), DEFAULTS["llama"]) | hf
    rope = got.get("rope_parameters") or got.get("rope_scaling") or {}  # transformers 5, else 4
    heads = got.get("num_attention_heads")
    fields: list[tuple[str, Any, Any, str]] = [
        ("model_type", kind, moe, "model.n_experts: 0 llama, > 0 mixtral"),
        ("vocab_size", got.get("vocab_size"), vocab_size, "model.vocab_size, else the tokenizer's: data.tokenizer"),
        ("hidden_size", got.get("hidden_size"), mc.d_model, "model.d_model"),
        ("num_hidden_layers", got.get("num_hidden_layers"), mc.n_layers, "model.n_layers"),
        ("num_attention_heads", heads, mc.n_heads, "model.n_heads"),
        ("num_key_value_heads", got["num_key_value_heads"] or heads, mc.n_kv_heads or mc.n_heads, "model.n_kv_heads"),
        ("head_dim", got.get("head_dim") or mc.d_model // mc.n_heads, mc.d_model // mc.n_heads, "model.d_model"),
        ("intermediate_size", got.get("intermediate_size"), model.swiglu_hidden(mc), "model.mlp_ratio"),
        ("tie_word_embeddings", bool(got.get("tie_word_embeddings", False)), mc.tie_embeddings, "model.tie_embeddings"),
        ("rope_type", rope.get("rope_type", rope.get("type", "default")), "default", "dloco's rotary"),
        ("rope_theta", rope.get("rope_theta", got["rope_theta"]), mc.rope_base, "model.rope_base"),
        ("rms_norm_eps", got["rms_norm_eps"], RMS_EPS, "dloco's RMSNorm"),
        ("hidden_act", got.get("hidden_act", "silu"), "silu", "the SwiGLU MLP"),
        ("attention_bias", got.get("attention_bias", False), False, "no biases"),
        ("mlp_bias", got.get("mlp_bias", False), False, "no biases"),
    ]
    if mc.n_experts:
        fields += [
            ("num_local_experts", got.get("num_local_experts"), mc.n_experts, "model.n_experts"),
            ("num_experts_per_tok", got.get("num_experts_per_tok"), mc.experts_per_token, "model.experts_per_token"),
            ("sliding_window", got.get("sliding_window"), None, "dloco's full causal attention"),
        ]
    for key, have, need, ours in fields:
        if have != need:
            raise ValueError(f"{where}: config.json's {key} is {have!r}, the config's model needs {need!r} ({ours})")


def _tensors(root: Path, where: str) -> dict[str, np.ndarray]:
    """The tensors of the checkpoint in `root`: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_json(index, where).get("weight_map", {}).values()))
    elif (root / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{where}: no model.safetensors (or its index) in {root}: only safetensors is read")
    out: dict[str, np.ndarray] = {}
    for name in names:
        try:
            out |= load_file(str(root / name))
        except (SafetensorError, TypeError, OSError) as e:
            raise ValueError(f"{where}: {name} is not a safetensors file of float tensors ({e})") from None
    return out


def read(root: str, cfg: RunConfig, vocab_size: int, seq_len: int) -> dict:
    """`model.init_from=hf:DIR`: the parameters of the HF llama (or Mixtral) checkpoint in `root`
    for the model `cfg` builds, float32. A one-line `ValueError` names the first config field
    (`check_config`), then the first tensor, that does not fit."""
    where, path = f"model.init_from=hf:{root}", Path(root).expanduser()
    check_config(_json(path / "config.json", where), cfg.model, vocab_size, where)
    have, want = _tensors(path, where), _hf_shapes(cfg.model, vocab_size, seq_len)
    for n, shape in want.items():
        got = "missing" if n not in have else f"shape {tuple(have[n].shape)}"
        if n not in have or tuple(have[n].shape) != shape:
            raise ValueError(f"{where}: tensor {n} is {got} there, the config's model needs shape {shape}")
    tied = {"lm_head.weight"} if cfg.model.tie_embeddings else set()  # some tied checkpoints hold it too
    if extra := sorted(n for n in set(have) - set(want) - tied if not n.endswith(UNUSED)):
        raise ValueError(f"{where}: tensor {extra[0]} is there, and the config's model has no such tensor")
    return from_hf(have, cfg.model)
