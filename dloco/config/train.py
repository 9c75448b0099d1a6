"""The sections of `RunConfig` that define the training computation: model, data, inner and outer
optimizers, fragments, sync cadence, syncer, merge, compression and how a learner installs a merge."""

from __future__ import annotations

from dataclasses import dataclass

from dloco.config.check import choice, finite, positive, require

# The syncer's outlier check takes the median of the last NORM_WINDOW accepted norms
# (`dloco.policy.NormTracker`'s window, as `dloco.syncer` builds it): a longer warm-up is never reached,
# and NormTracker refuses it when the syncer starts.
NORM_WINDOW = 64


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer LM. `vocab_size=0` takes the tokenizer's vocabulary size.
    `init_from`: start from these weights (a `dloco export` directory, or a run directory's
    newest global model; ``hf:DIR``: a Hugging Face Llama or Mixtral checkpoint, for the llama
    family, `dloco.hf`) instead of a random init; they must be of this model.

    `family`: ``classic`` (GELU MLP, multi-head attention, tied embeddings) or ``llama`` (SwiGLU
    MLP of hidden size ⌈(2/3)·mlp_ratio·d_model / 8⌉·8, grouped-query attention with `n_kv_heads`
    key/value heads through `jax.nn.dot_product_attention`, the fused kernel on GPU; embeddings
    tied unless `tie_embeddings` is false). `dtype`: the compute dtype, float32 or bfloat16; the
    parameters (and so the optimizer and every fragment) stay float32. `n_experts` > 0: each
    block's MLP is a mixture of that many experts (the family's MLP each), `experts_per_token`
    chosen per token by a softmax router, with the load-balancing loss E·Σ_e f_e·P_e weighted by
    `moe_aux_weight` added to the training loss (`dloco.model.MoE`)."""

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    vocab_size: int = 0
    rope_base: float = 10000.0
    init_from: str = ""  # an export or run directory, or hf:DIR (a Hugging Face llama checkpoint)
    factory: str = ""  # your own model: "package.module:function" (see `dloco.model.build`)
    family: str = "classic"
    n_kv_heads: int = 0  # llama: key/value heads (0: n_heads); must divide n_heads
    tie_embeddings: bool = True
    dtype: str = "float32"
    n_experts: int = 0  # > 0: a mixture of experts replaces each block's MLP
    experts_per_token: int = 2  # top-k routing
    moe_aux_weight: float = 0.01  # weight of the load-balancing loss

    def __post_init__(self) -> None:
        finite("model", self)
        positive("model", self, "d_model", "n_layers", "n_heads", "mlp_ratio", "rope_base")
        require(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "must be >= 0 (0: from tokenizer)")
        require(
            self.d_model % self.n_heads == 0 and (self.d_model // self.n_heads) % 2 == 0,
            "model.d_model",
            self.d_model,
            f"must be a multiple of model.n_heads={self.n_heads} with an even head size (rotary)",
        )
        choice("model", self, "family", ("classic", "llama"))
        mod, colon, fn = self.factory.partition(":")
        require(
            not self.factory or bool(colon and mod and fn.isidentifier()),
            "model.factory",
            self.factory,
            "must be 'package.module:function' (a function returning a flax.linen Module)",
        )
        choice("model", self, "dtype", ("float32", "bfloat16"))
        hf = self.init_from.startswith("hf:")
        require(not hf or len(self.init_from) > 3, "model.init_from", self.init_from, "hf: needs a directory: hf:DIR")
        require(
            not hf or (self.family == "llama" and not self.factory),
            "model.init_from",
            self.init_from,
            "a Hugging Face checkpoint (hf:DIR) starts dloco's llama family: set model.family=llama, no model.factory",
        )
        require(self.n_experts >= 0, "model.n_experts", self.n_experts, "must be >= 0 (0: a dense MLP)")
        require(
            not self.n_experts or 1 <= self.experts_per_token <= self.n_experts,
            "model.experts_per_token",
            self.experts_per_token,
            f"must be in [1, model.n_experts={self.n_experts}]",
        )
        require(self.moe_aux_weight >= 0, "model.moe_aux_weight", self.moe_aux_weight, "must be >= 0")
        kv = self.n_kv_heads or self.n_heads
        require(
            self.n_kv_heads >= 0 and self.n_heads % kv == 0,
            "model.n_kv_heads",
            self.n_kv_heads,
            f"must divide model.n_heads={self.n_heads} (0: n_heads)",
        )
        require(
            self.family == "llama" or (kv == self.n_heads and self.tie_embeddings),
            "model.family",
            self.family,
            "must be llama for model.n_kv_heads or tie_embeddings: false",
        )


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and windows. `source`: stdlib | shakespeare | text:GLOB | jsonl:GLOB |
    parquet:GLOB | tokens:URI; `text_field`: the JSON field or Parquet column holding a document's text;
    `tokenizer`: byte | bpe (trained on the corpus, `vocab_size`) | file:PATH (a pretrained HF
    tokenizer.json, whose EOS is the first of <|eos|>, <|endoftext|>, <|end_of_text|>, </s>, <eos>).
    A GLOB may be a URI (gs://, s3://, hdfs://, file://). The driver prepares the corpus once (into
    `cache_dir`, keyed by content) and sends each learner its tokenizer and the corpus key: a
    learner's node tokenizes its own copy of the documents with the driver's tokenizer (no BPE of
    its own, no tokenizer file needed) and refuses to start if its key differs. Token splits are
    memory-mapped Arrow files, shared by the learners of a node.

    ``tokens:URI`` (a path or a URI) trains on the token shards ``dloco prepare SOURCE --out URI`` wrote
    there, for a corpus too large to tokenize at start-up: the manifest fixes the documents, split and
    tokenizer (`text_field`, `tokenizer`, `vocab_size`, `val_fraction` and `max_bytes` are not used),
    its digest is the corpus key the learners and ``--resume`` compare, and each learner streams its
    windows from a few shards at a time, verifying each shard's checksum as it opens it
    (`dloco.data.ShardStream`: stream m of `shards` takes a range of windows that moves every epoch)."""

    source: str = "stdlib"
    text_field: str = "text"
    tokenizer: str = "byte"
    vocab_size: int = 4096  # BPE only
    seq_len: int = 128
    val_fraction: float = 0.05
    max_bytes: int = 0  # 0: the whole corpus
    cache_dir: str = "~/.cache/dloco/data"
    eval_batches: int = 8
    eval_batch_size: int = 16  # rows per validation batch: the same held-out set whatever the batch size
    shards: int = 64  # disjoint data streams; learner m reads shard m, so at most this many learners

    def __post_init__(self) -> None:
        finite("data", self)
        require(
            self.source in ("stdlib", "shakespeare")
            or self.source.startswith(("text:", "jsonl:", "parquet:"))
            or (self.source.startswith("tokens:") and len(self.source) > len("tokens:")),
            "data.source",
            self.source,
            "must be stdlib, shakespeare, text:GLOB, jsonl:GLOB, parquet:GLOB or tokens:URI (dloco prepare's output)",
        )
        require(bool(self.text_field.strip()), "data.text_field", self.text_field, "must name a field, e.g. text")
        require(
            self.tokenizer in ("byte", "bpe") or (self.tokenizer.startswith("file:") and len(self.tokenizer) > 5),
            "data.tokenizer",
            self.tokenizer,
            "must be byte, bpe (trained on the corpus) or file:PATH (a pretrained tokenizer.json)",
        )
        require(self.vocab_size >= 260, "data.vocab_size", self.vocab_size, "must be >= 260 (BPE over bytes)")
        positive("data", self, "seq_len", "eval_batches", "eval_batch_size", "shards")
        require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")
        require(self.max_bytes >= 0, "data.max_bytes", self.max_bytes, "must be >= 0 (0: no limit)")


@dataclass(frozen=True)
class InnerConfig:
    """Inner optimizer: AdamW with linear warmup then cosine decay to `lr * min_lr_ratio`.

    `lr` 6e-3: the quality sweep's best inner lr for dp and every DiLoCo-family algorithm on the
    small presets (mini, M = 4: decoupled 1.4328 at 6e-3 against 1.4837 at 3e-3, seed 0;
    `docs/RESULTS.md`); the larger presets set their own."""

    lr: float = 6e-3
    warmup_steps: int = 20
    total_steps: int = 400  # horizon of the cosine schedule
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    batch_size: int = 16
    accum_steps: int = 1  # micro-batches per step: gradients averaged, then one AdamW step (1/accum the activations)

    def __post_init__(self) -> None:
        finite("inner", self)
        positive("inner", self, "lr", "total_steps", "eps", "grad_clip", "batch_size", "accum_steps")
        require(self.warmup_steps >= 0, "inner.warmup_steps", self.warmup_steps, "must be >= 0")
        require(
            self.warmup_steps < self.total_steps,
            "inner.warmup_steps",
            self.warmup_steps,
            f"must be < inner.total_steps={self.total_steps}",
        )
        require(0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        require(self.weight_decay >= 0, "inner.weight_decay", self.weight_decay, "must be >= 0")
        for n in ("b1", "b2"):
            v = getattr(self, n)
            require(0 <= v < 1, f"inner.{n}", v, "must be in [0, 1)")


@dataclass(frozen=True)
class OuterConfig:
    """Outer optimizer: SGD with Nesterov momentum, learning rate η, momentum μ, delay N.

    `delay` is N of Delayed Nesterov (Liu et al. 2024, *Asynchronous Local-SGD*, Algorithm 3;
    `dloco.outer`): each commit applies its pseudo-gradient as a plain SGD step, and the momentum
    is updated (and applied) once per N merged contributions. With quorum K < M one sync period of
    a fragment is committed in several partial merges; N = M updates the momentum about once per
    period, as synchronous DiLoCo does, instead of compounding it over every partial merge.
    1: per-commit Nesterov (momentum updated at every commit). 0: N = learners.count.

    Default: plain averaging (η 1, μ 0), the winner of the tuning sweep (`benchmarks/quality.py`,
    docs/RESULTS.md): under K = 1 every momentum setting tried, delayed or per commit, ended
    higher; with momentum, set `outer.momentum` and keep `outer.delay` at 0 (Delayed Nesterov).
    """

    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True
    delay: int = 0

    def __post_init__(self) -> None:
        finite("outer", self)
        positive("outer", self, "lr")
        require(0 <= self.momentum < 1, "outer.momentum", self.momentum, "must be in [0, 1)")
        require(self.delay >= 0, "outer.delay", self.delay, "must be >= 0 (0: learners.count, 1: per-commit Nesterov)")
        require(
            self.nesterov or self.delay == 1 or self.momentum == 0,
            "outer.delay",
            self.delay,
            "must be 1 with outer.nesterov=false (Delayed Nesterov needs the Nesterov form)",
        )


@dataclass(frozen=True)
class FragmentsConfig:
    """P disjoint parameter fragments (balanced tensor bin-packing, embedding on its own)."""

    count: int = 4

    def __post_init__(self) -> None:
        positive("fragments", self, "count")


@dataclass(frozen=True)
class SyncConfig:
    """H = `every` inner steps between two sends of one fragment; τ = `overlap`.

    `dynamic` (decoupled only; on by default): dynamic local updates (DyLU, Liu et al. 2024),
    phase-locked. The syncer keeps a beat per fragment, one period T = H·ξ_fastest apart (the
    fastest learner takes H steps a period), and tells each pusher in how many steps its next push
    of that fragment is due: ⌈(T − lateness)/ξ_m⌉ − 1, ξ_m its own seconds per step, so that it
    lands just before the next beat. Learners of different speeds take different numbers of steps
    but push together, and a round waits for its beat, so its merge holds every learner's push of
    the period instead of one each: on a fleet of speeds 1.0–1.2 this is what closes decoupled's gap
    to synchronous DiLoCo (`docs/RESULTS.md`, the ablation ladder; `dloco.policy.Beat`). Off, each
    learner pushes every H of its own steps.
    """

    every: int = 24
    overlap: int = 2
    dynamic: bool = True

    def __post_init__(self) -> None:
        positive("sync", self, "every")
        require(self.overlap >= 0, "sync.overlap", self.overlap, "must be >= 0")


@dataclass(frozen=True)
class SyncerConfig:
    """Quorum K, grace factor γ, grace cap (in steps) and contribution checks.

    `shards` S: the fragments are split over S syncer/store pairs (fragment p to shard p mod S),
    each with its own commit log, snapshots and process; `shard_resources`, one Ray custom resource
    name per shard (e.g. a region's), places each pair on a node that has it (empty: all on the
    driver's node).
    """

    quorum: int = 1
    grace_factor: float = 0.5
    max_grace_steps: float = 1.0
    max_staleness: int = 8
    max_norm_ratio: float = 10.0
    norm_warmup: int = 8  # 0: no warm-up bound; a fragment's first push is then checked at commit only
    ema_decay: float = 0.9
    elastic_timeout_s: float = 2.0  # elastic_dp: wait this long for a missing learner, then drop it
    shards: int = 1  # syncer/store pairs, each owning fragments p with p mod shards = its index
    shard_resources: tuple[str, ...] = ()  # one Ray custom resource per shard pair (empty: the driver's node)

    def __post_init__(self) -> None:
        finite("syncer", self)
        positive("syncer", self, "quorum", "max_norm_ratio", "elastic_timeout_s")
        require(self.grace_factor >= 0, "syncer.grace_factor", self.grace_factor, "must be >= 0")
        require(self.max_grace_steps >= 0, "syncer.max_grace_steps", self.max_grace_steps, "must be >= 0")
        require(self.max_staleness >= 0, "syncer.max_staleness", self.max_staleness, "must be >= 0")
        require(
            0 <= self.norm_warmup <= NORM_WINDOW,
            "syncer.norm_warmup",
            self.norm_warmup,
            f"must be in [0, {NORM_WINDOW}] (the outlier check's median is over the last {NORM_WINDOW} norms)",
        )
        require(0 <= self.ema_decay < 1, "syncer.ema_decay", self.ema_decay, "must be in [0, 1)")
        require(self.shards >= 1, "syncer.shards", self.shards, "must be >= 1 (1: one syncer and one store)")
        n = len(self.shard_resources)
        require(
            n in (0, self.shards),
            "syncer.shard_resources",
            list(self.shard_resources),
            f"must name one Ray resource per shard ({self.shards}) or none",
        )


@dataclass(frozen=True)
class MergeConfig:
    """Merge rule for non-embedding tensors and contribution weighting (ALGORITHM.md §6).

    `scale_by_share` (this project's decision, docs/ARCHITECTURE.md): a round that includes
    only some of the live learners applies Δ scaled by its share of their token weight, so that
    the rounds of one sync period together move Θ_p by the weighted mean of the learners'
    progress (as a full round does), not by its sum.
    """

    rule: str = "rda"
    weighting: str = "tokens"
    scale_by_share: bool = True

    def __post_init__(self) -> None:
        choice("merge", self, "rule", ("rda", "mean"))
        choice("merge", self, "weighting", ("tokens", "uniform"))


@dataclass(frozen=True)
class CompressionConfig:
    """Wire formats: learner→syncer `dtype`, syncer→learner `publish` (ALGORITHM.md §7).

    `publish: delta` sends each merged fragment as a difference quantized to `publish_dtype`:
    with `learner.install: own` against the copy the store knows the learner holds (one delta per
    delivery, `dloco.publish`), with `every` against the syncer's shadow Θ̂_p (what every
    up-to-date learner holds); `full` sends Θ_p in float32. `int2` (ternary, 4 values per byte)
    is the aggressive variant for ablations.

    Decision: `publish: delta` by default (decoupled; the baselines receive their merged model in
    full, as their papers do and as they were measured). The ablation ladder's delta rung reads
    +0.23 % against full publish over 5 seeds, inside the seed noise (per seed −0.43, +1.44, −0.01,
    −0.43, +0.55 %), for 7.8× fewer bytes down: 186× fewer in all than fp32 data-parallel at H = 24, against
    42.5× (`docs/RESULTS.md`, wire accounting).

    `entropy: zstd` codes every push and published delta losslessly (`dloco.entropy`, zstd level 1)
    where that makes it smaller; the receiver restores the same codes, so a run trains the same model
    bit for bit. Measured in the quality regime's default rung (`benchmarks/bandwidth.py`; M = 4,
    H = 24, int4 both ways): 14 % fewer bytes up and 13.5 % down (int4 codes carry 3.45 of their 4
    bits), 194× fewer than fp32 data-parallel instead of 167×, the same eval loss to the last digit.
    Decision: `none` by default. Each push costs a compression on the learner and a decompression
    at the syncer before its round merges, about 500 and 600 MB/s of codes on one core: for M pushes
    of a large model that is seconds per round where the merge kernels take a fraction of one. It
    pays on links slower than about 300 Mbit/s per learner (sending 14 % of a MB there takes longer
    than coding the MB); set it there.
    """

    dtype: str = "int4"
    block: int = 128
    error_feedback: bool = True
    publish: str = "delta"
    publish_dtype: str = "int4"
    entropy: str = "none"  # zstd: pushes and published deltas entropy-coded (lossless), where it pays

    def __post_init__(self) -> None:
        dtypes = ("fp32", "bf16", "int8", "int4", "int2")
        choice("compression", self, "dtype", dtypes)
        choice("compression", self, "publish_dtype", dtypes)
        choice("compression", self, "publish", ("full", "delta"))
        choice("compression", self, "entropy", ("none", "zstd"))
        require(self.block >= 2 and self.block % 2 == 0, "compression.block", self.block, "must be an even number >= 2")
        if "int2" in (self.dtype, self.publish_dtype):
            require(self.block % 4 == 0, "compression.block", self.block, "must be a multiple of 4 for int2")


@dataclass(frozen=True)
class LearnerConfig:
    """How a learner installs a merged fragment: overwrite | blend (α = blend_alpha) | rebase.

    `rebase` is the default. With K = 1 + grace and learners of different speeds most rounds hold
    one push; each then applies its share (≈ 1/M) of that learner's progress (`merge.scale_by_share`).
    rebase keeps every learner's own unmerged progress, so nothing trained is lost; overwrite
    throws it away and blend keeps half. In the compute-optimal quality runs (benchmarks/quality.py,
    docs/RESULTS.md, receive table) rebase has the lowest loss at M = 4, one seed, by less than
    the seed spread; earlier, shorter runs (up to 1000 steps) chose it as the only mode that beat
    synchronous DiLoCo on the longest run.

    `install` (`dloco.publish`): `every` sends each committed version of a fragment to every
    learner; `own` (default) sends it to a learner when it merges that learner's own push (once
    per sync period), or when the learner has fallen max(1, ⌈`syncer.max_staleness` / 2⌉) versions behind.
    Measured in an earlier, 160-step version of the quality benchmark (M = 4): own 2.404 vs every
    2.419 at 11.8 vs 42.9 MB received per learner; with int4 both ways the measured wire ratio to
    fp32 dp was 183× vs 78×.
    """

    receive: str = "rebase"
    blend_alpha: float = 0.5
    install: str = "own"

    def __post_init__(self) -> None:
        finite("learner", self)
        choice("learner", self, "receive", ("overwrite", "blend", "rebase"))
        choice("learner", self, "install", ("every", "own"))
        require(0 <= self.blend_alpha <= 1, "learner.blend_alpha", self.blend_alpha, "must be in [0, 1]")
