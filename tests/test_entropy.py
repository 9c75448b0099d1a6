"""Entropy-coded payloads (`compression.entropy: zstd`, `dloco.entropy`, ALGORITHM.md §7): lossless bit
for bit, raw where coding does not pay, a damaged frame rejected with its reason and never merged,
every byte count the length of what travels, and a run that trains the very same model."""

import pickle

import numpy as np
import pytest
import zstandard
from conftest import P

from dloco import compress, config, defence, entropy, merge
from dloco.policy import ACCEPTED, ContributionMeta, NormTracker
from dloco.publish import Copies
from dloco.sim import run_local


def gaussian(n, seed=0):
    return np.random.default_rng(seed).normal(size=n).astype(np.float32)


def frame_length(p: compress.Payload) -> int:
    """The zstd frame of `p`'s codes, written independently of `compress.pack`."""
    c = zstandard.ZstdCompressor(level=entropy.LEVEL, write_checksum=True, write_content_size=True)
    return len(c.compress(p.data.tobytes()))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4", "int2"])
def test_pack_unpack_is_bit_exact_and_counts_the_frame(dtype):
    p = compress.encode(gaussian(10_000).reshape(100, 100), dtype)
    q = compress.pack(p)
    assert q.entropy == "zstd" and q.dtype == dtype and q.shape == (100, 100)
    # what travels: the frame (header and checksum included) and the raw scales, nothing else
    assert q.nbytes == frame_length(p) + (0 if p.scales is None else p.scales.nbytes) < p.nbytes
    assert q.scales is p.scales
    r = compress.unpack(q)
    assert r.entropy == "none" and r.data.dtype == p.data.dtype
    np.testing.assert_array_equal(r.data, p.data)
    np.testing.assert_array_equal(compress.decode(q), compress.decode(p))
    again = pickle.loads(pickle.dumps(q))  # as Ray's object store carries it
    np.testing.assert_array_equal(compress.validate(again).data, p.data)


def test_int4_codes_of_gaussian_values_shrink_to_their_entropy():
    # q = rint(x / s), s = max|x| / 7 over 128 Gaussian values (max ≈ 2.6σ): a discretized
    # Gaussian of σ ≈ 2.7 steps, about 3.4 bits per 4-bit code
    p = compress.encode(gaussian(1 << 18), "int4")
    codes = np.stack([p.data & 15, p.data >> 4], axis=1).reshape(-1)
    freq = np.bincount(codes, minlength=16) / codes.size
    bits = -float(np.sum(freq[freq > 0] * np.log2(freq[freq > 0])))
    assert 3.3 < bits < 3.5
    q = compress.pack(p)
    assert q.scales is not None
    ratio = (q.nbytes - q.scales.nbytes) / p.data.nbytes
    assert bits / 4 < ratio < bits / 4 + 0.01  # Huffman coding of the packed bytes: within 1 % of the entropy


def test_incompressible_or_tiny_data_travels_raw():
    rng = np.random.default_rng(1)
    codes = rng.integers(-127, 128, 4096).astype(np.int8)  # uniform codes: 8 bits of information each
    p = compress.Payload("int8", (4096,), codes, np.ones(32, np.float16), 128)
    assert compress.pack(p) is p and p.entropy == "none"
    tiny = compress.encode(np.ones(2, np.float32), "int4", block=2)  # one byte of codes: any frame is larger
    assert compress.pack(tiny) is tiny
    empty = compress.encode(np.zeros(0, np.float32), "int4")
    assert compress.pack(empty) is empty
    assert compress.pack(compress.encode(gaussian(4096), "int4"), "none").entropy == "none"
    q = compress.pack(compress.encode(gaussian(4096), "int4"))
    assert compress.pack(q) is q  # packed once only
    with pytest.raises(ValueError, match="unknown entropy coding 'lz4'"):
        compress.pack(p, "lz4")


def test_a_packed_payload_is_refused_where_codes_are_read_and_checked_when_built():
    p = compress.encode(gaussian(4096), "int4")
    q = compress.pack(p)
    with pytest.raises(ValueError, match="unpack it before reading its codes"):
        compress.sq_norm(q)
    with pytest.raises(ValueError, match="unpack it before reading its codes"):
        compress.decode_range(q, 0, 128, np.empty(128, np.float32))
    assert compress.sq_norm(compress.validate(q)) == compress.sq_norm(p)
    # a "frame" as large as the codes it stands for is not one: pack sends those raw
    with pytest.raises(ValueError, match="uint8 frame of fewer than 2048 bytes"):
        compress.Payload("int4", p.shape, p.data, p.scales, p.block, "zstd")
    with pytest.raises(ValueError, match="entropy must be one of"):
        compress.Payload("int4", p.shape, p.data, p.scales, p.block, "gzip")


def damaged(q: compress.Payload, how: str) -> compress.Payload:
    frame = q.data.tobytes()
    if how == "bit flip":
        b = bytearray(frame)
        b[len(b) // 2] ^= 0x10
        frame = bytes(b)
    elif how == "truncated":
        frame = frame[:-9]
    elif how == "not zstd":
        frame = b"\x00" * len(frame)
    elif how == "claims 1 MiB":  # a frame that would decode to far more than the payload holds
        frame = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(1 << 20))
    bad = pickle.loads(pickle.dumps(q))
    object.__setattr__(bad, "data", np.frombuffer(frame, np.uint8))  # what a forged pickle can carry
    return bad


REASONS = {
    "bit flip": "zstd frame: decompression error",
    "truncated": "zstd frame: decompression error",
    "not zstd": "zstd frame: error when determining content size",
    "claims 1 MiB": "zstd frame declares 1048576 bytes, the payload has 2048",
}


@pytest.mark.parametrize("how", sorted(REASONS))
def test_a_damaged_frame_is_a_malformed_payload(how):
    q = compress.pack(compress.encode(gaussian(4096), "int4"))
    with pytest.raises(ValueError, match=REASONS[how]):
        compress.validate(damaged(q, how))
    with pytest.raises(ValueError, match=REASONS[how]):
        compress.decode(damaged(q, how))


def test_bytes_after_the_frame_are_refused():
    q = compress.pack(compress.encode(gaussian(4096), "int4"))
    bad = pickle.loads(pickle.dumps(q))
    object.__setattr__(bad, "data", np.concatenate([q.data, np.zeros(3, np.uint8)]))
    with pytest.raises(ValueError, match="3 bytes of unused data"):
        compress.validate(bad)


def meta(m):
    return ContributionMeta(m, 0, 0, 0, tokens=64 * (m + 1), steps=8, step=8, step_time=1.0)


def screen(items):
    return defence.screen(
        items,
        expected={"w": (64, 96), "b": (96,)},
        check=lambda m: ACCEPTED,
        norms=NormTracker(),
        max_norm_ratio=10.0,
        bound=None,
    )


@pytest.mark.parametrize("dtype", ["int4", "int8", "bf16"])
def test_screen_and_merge_give_the_same_bits_packed_or_not_and_count_the_frames(dtype):
    w = [gaussian(64 * 96, m).reshape(64, 96) for m in range(3)]
    pushes = [{"w": compress.encode(x, dtype), "b": compress.encode(gaussian(96, 9), dtype)} for x in w]
    packed = [{n: compress.pack(x) for n, x in d.items()} for d in pushes]
    assert all(d["w"].entropy == "zstd" for d in packed)
    plain, coded = (
        screen([(meta(m), d) for m, d in enumerate(pushes)]),
        screen([(meta(m), d) for m, d in enumerate(packed)]),
    )
    assert len(coded.metas) == 3 and not coded.rejections
    assert coded.nbytes_in == sum(x.nbytes for d in packed for x in d.values()) < plain.nbytes_in
    assert coded.norms == plain.norms
    weights = merge.token_weights([m.tokens for m in coded.metas], [m.steps for m in coded.metas])
    a = merge.merge_fragment(plain.deltas, weights, "rda", norms=plain.norms)
    b = merge.merge_fragment(coded.deltas, weights, "rda", norms=coded.norms)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n])


def test_screen_rejects_a_damaged_frame_with_its_reason_and_merges_the_rest():
    good = {"w": compress.pack(compress.encode(gaussian(64 * 96).reshape(64, 96), "int4"))}
    good["b"] = compress.encode(gaussian(96), "int4")
    bad = dict(good, w=damaged(good["w"], "bit flip"))
    out = screen([(meta(0), good), (meta(1), bad)])
    assert [m.learner_id for m in out.metas] == [0]
    (rej,) = out.rejections
    assert rej["learner"] == 1 and rej["reason"].startswith("malformed payload: zstd frame: decompression error")
    assert out.nbytes_in == good["w"].nbytes + good["b"].nbytes


def test_a_damaged_push_is_rejected_by_the_syncer_and_never_committed(rig):
    r = rig("compression.dtype=int4", "compression.entropy=zstd")
    before = r.theta()
    norm = r.honest() * 8

    def int4_push():
        return {n: compress.pack(compress.encode(x.data, "int4")) for n, x in r.payload(norm).items()}

    bad = int4_push()
    big = max(bad, key=lambda n: bad[n].nbytes)
    bad[big] = damaged(bad[big], "truncated")
    assert r.push(r.meta(0), bad).accept  # the metadata is fine: the frame is read at close
    events = r.close()
    (rej,) = [e for e in events if e["event"] == "rejection"]
    assert rej["learner"] == 0 and rej["reason"].startswith("malformed payload: zstd frame")
    assert not [e for e in events if e["event"] == "merge"] and r.store.core.versions[P] == 0
    for n, x in r.theta().items():
        np.testing.assert_array_equal(x, before[n])
    good = int4_push()
    assert r.push(r.meta(1), good).accept
    (m,) = [e for e in r.close() if e["event"] == "merge"]
    assert m["bytes_in"] == sum(x.nbytes for x in good.values()) and r.store.core.versions[P] == 1


def test_per_learner_delta_publish_is_the_same_copy_packed():
    target = {"w": gaussian(64 * 96).reshape(64, 96), "b": gaussian(96, 1)}
    held = {n: np.zeros_like(x) for n, x in target.items()}
    out = {}
    for coding in ("none", "zstd"):
        copies = Copies("int4", 128, 1 << 20, coding)
        copies.set(0, 0, 0, held)
        q = copies.delta(0, 0, 1, target)
        out[coding] = q, {n: held[n] + compress.decode(x) for n, x in q.items()}
    (q0, v0), (q1, v1) = out["none"], out["zstd"]
    assert q1["w"].entropy == "zstd" and q1["w"].nbytes < q0["w"].nbytes
    for n in target:
        np.testing.assert_array_equal(v0[n], v1[n])


def test_the_entropy_config_is_checked():
    assert config.load().compression.entropy == "none"
    assert config.load(overrides=["compression.entropy=zstd"]).compression.entropy == "zstd"
    with pytest.raises(ValueError, match="compression.entropy"):
        config.load(overrides=["compression.entropy=lz4"])


@pytest.fixture(scope="module")
def runs(tiny_run, tmp_path_factory):
    out = {}
    for coding in ("none", "zstd"):
        cfg = config.load(overrides=(*tiny_run, "learners.count=3", f"compression.entropy={coding}"))
        out[coding] = run_local(cfg, tmp_path_factory.mktemp(coding), steps=32, step_times=[1.0, 1.1, 1.3])
    return out


def test_a_run_with_zstd_trains_the_same_model_bit_for_bit_on_fewer_bytes(runs):
    a, b = runs["none"], runs["zstd"]
    assert min(a.store.versions) >= 3 and a.store.versions == b.store.versions
    for p in range(a.blueprint.plan.count):
        fa, fb = a.store.fragment(p)[1], b.store.fragment(p)[1]
        for n in fa:
            np.testing.assert_array_equal(fa[n], fb[n])
    assert a.evaluate() == b.evaluate()
    merges = {k: [e for e in r.events if e["event"] == "merge"] for k, r in runs.items()}
    assert len(merges["none"]) == len(merges["zstd"])
    for ea, eb in zip(merges["none"], merges["zstd"], strict=True):
        assert ea["fragment"] == eb["fragment"] and ea["version"] == eb["version"]
        assert eb["bytes_in"] < ea["bytes_in"] and eb["bytes_out"] < ea["bytes_out"]
    # every byte a learner sent or received is counted as it travelled
    up = {k: sum(s.bytes_out for s in r.services.values()) for k, r in runs.items()}
    down = {k: sum(r.bytes_down) for k, r in runs.items()}
    assert up["zstd"] < 0.95 * up["none"] and down["zstd"] < down["none"]
