"""`dloco prepare` (`dloco.data.prepare`, on Ray Data through `actors.prepare`) and the
``data.source=tokens:URI`` it feeds: exact manifests, resuming, today's windows, the cursor, damage.

One small synthetic corpus (~300 kB of text in 240 files) is prepared once in process and once
through Ray Data (one Ray start for the module); the other tests read those outputs or copies."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import xxhash

from dloco import build, config, data
from dloco.data import Cursor, ShardStream, Tokenizer, shards, split_mask, unit_hash
from dloco.data.encode import local_engine
from dloco.data.tokenizer import train_bpe

WORDS = np.array(list("abcdefghijklmnopqrstuvwxyz"))  # words of 1–6 letters drawn from these
SHARD = 20_000  # tokens per shard: ~8 train shards of the BPE corpus
VAL = 0.1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """240 documents of 60–2400 bytes (one per file) and a BPE tokenizer.json of 320 ids."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(7)
    for i in range(240):
        words = ["".join(rng.choice(WORDS, size=int(rng.integers(1, 7)))) for _ in range(int(rng.integers(12, 480)))]
        (root / "docs").mkdir(exist_ok=True)
        (root / "docs" / f"d{i:03d}.txt").write_text(f"document {i}: " + " ".join(words) + ".\n")
    tok = train_bpe([p.read_text() for p in sorted((root / "docs").glob("*.txt"))[:40]], 320)
    tok._backend.save(str(root / "tokenizer.json"))
    return {"source": f"text:{root}/docs/*.txt", "tokenizer": f"file:{root}/tokenizer.json", "root": root}


@pytest.fixture(scope="module")
def local_out(corpus, tmp_path_factory):
    """The corpus prepared in this process (`local_engine`)."""
    out = tmp_path_factory.mktemp("local") / "tokens"
    m = data.prepare(corpus["source"], str(out), tokenizer=corpus["tokenizer"], shard_tokens=SHARD, val_fraction=VAL)
    return out, m


@pytest.fixture(scope="module")
def today(corpus, tmp_path_factory):
    """Today's path for the same documents and tokenizer: `prepare_corpus`'s memory-mapped splits."""
    cache = tmp_path_factory.mktemp("cache")
    c = data.prepare_corpus(corpus["source"], tokenizer=corpus["tokenizer"], val_fraction=VAL, cache_dir=cache)
    return c, cache


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _flip(path, at=200):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def test_the_manifest_is_exact_against_direct_tokenization_and_todays_split(corpus, local_out, today):
    out, m = local_out
    docs = data.read_documents(corpus["source"])
    tok = Tokenizer.from_file(corpus["tokenizer"][5:])
    ids = [tok.encode(content.decode("utf-8"), eos=True) for _, content in docs]
    is_val = split_mask([unit_hash(hashlib.blake2b(c, digest_size=16).digest()) for _, c in docs], VAL)
    assert 0 < is_val.sum() < len(docs)  # the rule needed no fix-up here
    for split, mask in (("train", ~is_val), ("val", is_val)):
        flat = np.concatenate([ids[i] for i in np.flatnonzero(mask)])
        assert m.tokens(split) == len(flat) == sum(s.tokens for s in m.shards(split))
        assert m.splits[split]["documents"] == int(mask.sum())
        got = data.ShardedTokens(shards.Location(str(out)), m.shards(split), np.dtype(m.dtype)).read(0, len(flat))
        np.testing.assert_array_equal(got, flat)
        np.testing.assert_array_equal(got, np.asarray(today[0].load_split(split)))  # today's path, same tokens
        sizes = [s.tokens for s in m.shards(split)]
        assert all(n == SHARD for n in sizes[:-1]) and 0 < sizes[-1] <= SHARD
        for s in m.shards(split):
            assert xxhash.xxh3_128_hexdigest((out / s.name).read_bytes()) == s.checksum
    raw = (out / "tokenizer.json").read_bytes()
    assert raw == (corpus["root"] / "tokenizer.json").read_bytes()
    assert m.tokenizer == {
        "kind": "bpe",
        "from": "file",
        "digest": hashlib.blake2b(raw, digest_size=16).hexdigest(),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "asked": {"file": hashlib.blake2b(raw, digest_size=16).hexdigest()},
        "sample": [],
    }
    assert (m.source, m.files, m.dtype, m.shard_tokens, m.val_fraction) == (corpus["source"], 240, "uint16", SHARD, VAL)
    assert data.Manifest.from_json((out / "manifest.json").read_text(), "here") == m


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_data_writes_the_same_shards_and_a_rerun_redoes_only_the_damaged_ones(
    corpus, local_out, ray_cluster, tmp_path, capsys
):
    from actors.cli import main
    from actors.prepare import prepare

    out = tmp_path / "ray"
    m = prepare(corpus["source"], f"file://{out}", tokenizer=corpus["tokenizer"], shard_tokens=SHARD, val_fraction=VAL)
    assert m.digest == local_out[1].digest  # shards, checksums, split and counts: those of the in-process run
    (out / "train-00001.npy").unlink()
    _flip(out / "train-00003.npy")
    _flip(out / "val-00000.npy")
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    args = ["--tokenizer", corpus["tokenizer"], "--shard-tokens", str(SHARD), "--val-fraction", str(VAL), "--quiet"]
    assert main(["prepare", corpus["source"], "--out", f"file://{out}", *args]) == 0  # the command, on Ray Data
    assert capsys.readouterr().out.startswith(f"dloco: file://{out}: {m.tokens('train'):,} training tokens in ")
    again = data.Manifest.from_json((out / "manifest.json").read_text(), "here")
    assert again.digest == m.digest
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    redone = {"train-00001.npy", "train-00003.npy", "val-00000.npy"}
    assert {n for n in after if after[n] != before.get(n)} == redone  # the intact ones were left alone
    for s in m.shards("train") + m.shards("val"):
        assert xxhash.xxh3_128_hexdigest((out / s.name).read_bytes()) == s.checksum


def test_a_run_cut_short_resumes_past_the_files_it_finished(corpus, local_out, tmp_path):
    """A kill after 180 of 240 files: the rerun reads the source again from a later file, keeps the
    shards the first run wrote (mtime unchanged) and ends with the uninterrupted run's manifest."""
    out, calls = tmp_path / "cut", []

    def dying(kind, paths, fs, field, udf, kwargs):
        calls.append(len(paths))
        for n, batch in enumerate(local_engine(kind, paths, fs, field, udf, kwargs)):
            if n == 180 and len(calls) == 1:  # one file per batch here
                raise KeyboardInterrupt
            yield batch

    kw = {"tokenizer": corpus["tokenizer"], "shard_tokens": SHARD, "val_fraction": VAL, "engine": dying}
    with pytest.raises(KeyboardInterrupt):
        data.prepare(corpus["source"], str(out), **kw)
    assert not (out / "manifest.json").exists()
    first = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    assert len(first) >= 2
    m = data.prepare(corpus["source"], str(out), **kw)
    assert m.digest == local_out[1].digest
    assert calls[0] == 240 and 0 < calls[1] < 240  # the rerun skipped the files whose shards were intact
    assert {n: (out / n).stat().st_mtime_ns for n in first} == first


def _cfg(out, cache, *extra):
    return config.load(
        None,
        [
            "preset=micro",
            f"data.source=tokens:{out}",
            f"data.cache_dir={cache}",
            "data.seq_len=16",
            "data.shards=3",
            "learners.count=2",
        ]
        + list(extra),
    )


def test_tokens_source_reads_todays_windows_disjoint_per_epoch_and_todays_eval_set(local_out, today, tmp_path):
    out, m = local_out
    cfg = _cfg(out, tmp_path)
    c = build.corpus(cfg)
    assert isinstance(c, data.TokenCorpus) and c.key == m.digest and (c.path / "tokenizer.json").exists()
    assert build.corpus_identity(c)["tokenizer"] == m.tokenizer["digest"]
    flat = np.asarray(today[0].load_split("train"))
    T, S = 16, 3
    W = (len(flat) - 1) // T
    seen = []
    for learner in range(S):
        s = build.stream(cfg, c.load_split("train"), learner, batch_size=4)
        assert isinstance(s, ShardStream) and s.windows_per_epoch == W // S
        ids = s.epoch_windows(0)
        rows = np.concatenate([s.next_batch() for _ in range(3)])
        expect = np.stack([flat[w * T : w * T + T + 1] for w in ids[:12]]).astype(np.int32)
        np.testing.assert_array_equal(rows, expect)  # the tokens of the shards, window by window
        seen.append(ids)
    allw = np.concatenate(seen)
    assert len(allw) == len(set(allw.tolist())) == S * (W // S) and allw.max() < W
    got, want = build.eval_set(cfg, c), build.eval_set(cfg, today[0])  # the first validation windows, in order
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_new_stream_from_a_saved_cursor_yields_exactly_the_next_windows(local_out, tmp_path):
    out, _ = local_out
    cfg = _cfg(out, tmp_path, "data.seq_len=64")
    tokens = build.corpus(cfg).load_split("train")
    s = build.stream(cfg, tokens, 2, batch_size=8)
    n = s.windows_per_epoch // 8 + 2  # past the end of epoch 0
    for _ in range(n):
        s.next_batch()
    saved = json.loads(json.dumps(s.cursor.to_dict()))  # as a push carries it to the store's ledger
    assert saved["epoch"] == 1
    resumed = build.stream(cfg, build.corpus(cfg).load_split("train"), 2, Cursor.from_dict(saved), batch_size=8)
    for _ in range(5):
        np.testing.assert_array_equal(resumed.next_batch(), s.next_batch())
    assert resumed.cursor == s.cursor


@pytest.mark.slow
def test_a_learner_killed_mid_run_resumes_its_tokens_stream_at_its_merged_cursor(local_out, tmp_path):
    """The existing machinery on a ``tokens:`` corpus (in process, `dloco.sim`): learner 1 is killed,
    registers again at the oldest cursor its merged pushes carried (the store's ledger), and its
    stream goes on from there: after its last step it stands where a new stream from that cursor
    stands after as many batches (no window skipped, none read twice past the merged point)."""
    from dloco.sim import Sim

    out, _ = local_out
    cfg = _cfg(out, tmp_path, "algorithm=decoupled", "sync.every=8", "fragments.count=2", "sync.overlap=1")
    sim = Sim.start(cfg, tmp_path / "run", step_times=[1.0, 1.3], restart_s=3.0)
    sim.at(16.0, "kill_learner", 1)
    sim.run(24)
    (restart,) = [e for e in sim.events if e["event"] == "learner_restart" and e["learner"] == 1]
    assert restart["cursor"] is not None and restart["step"] > 0  # it resumed from merged pushes, not from 0
    svc = sim.services[1]
    assert isinstance(svc.core.stream, ShardStream) and svc.core.step_count == 24
    fresh = build.stream(cfg, build.corpus(cfg).load_split("train"), 1, Cursor.from_dict(restart["cursor"]))
    for _ in range(24 - restart["step"]):
        fresh.next_batch()
    assert fresh.cursor == svc.core.stream.cursor
    assert fresh.where() == svc.core.stream.where() and fresh.where()["shard"].startswith("train-")


def test_a_damaged_or_missing_shard_is_one_line_naming_it_and_never_read(local_out, tmp_path):
    out = _copy(local_out[0], tmp_path / "copy")
    _flip(out / "train-00001.npy", at=5000)
    tokens = data.open_tokens(str(out), tmp_path / "cache").load_split("train")
    intact = data.open_tokens(str(local_out[0]), tmp_path / "cache").load_split("train")
    np.testing.assert_array_equal(tokens.read(0, 100), intact.read(0, 100))  # shard 0 is intact
    with pytest.raises(ValueError, match=r"shard .*train-00001\.npy is damaged") as e:
        tokens.read(SHARD + 10, SHARD + 20)
    assert "\n" not in str(e.value)
    (out / "train-00002.npy").unlink()
    with pytest.raises(ValueError, match=r"shard .*train-00002\.npy is missing") as e:
        data.open_tokens(str(out), tmp_path / "cache")
    assert "\n" not in str(e.value)


def test_prepare_refuses_other_data_an_unreadable_source_and_a_bad_tokens_uri_in_one_line(
    corpus, local_out, tmp_path, capsys
):
    from actors.cli import main

    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("another corpus\n")
    out = _copy(local_out[0], tmp_path / "copy")
    assert main(["prepare", f"text:{other}/*.txt", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dloco: --out {out} holds a manifest of other data (source {corpus['source']!r}")
    assert err.count("\n") == 1
    assert main(["prepare", f"text:{tmp_path}/none/*.txt", "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"dloco: corpus source 'text:{tmp_path}/none/*.txt' matches no files\n"
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="no manifest.json there: write it with dloco prepare"):
        build.corpus(_cfg(tmp_path / "nothing", tmp_path))
    with pytest.raises(config.ConfigError, match=r"data.source='tokens:' is invalid: .* or tokens:URI"):
        config.DataConfig(source="tokens:")


def test_a_bpe_is_trained_on_a_bounded_sample_of_training_documents(corpus, tmp_path):
    out = tmp_path / "bpe"
    m = data.prepare(corpus["source"], str(out), tokenizer="bpe", vocab_size=300, tokenizer_sample_bytes=30_000)
    used, documents = m.tokenizer["sample"]
    assert 0 < used <= 30_000 and documents > 0 and m.tokenizer["from"] == "trained"
    tok = Tokenizer.from_file(out / "tokenizer.json")
    assert tok.vocab_size == m.tokenizer["vocab_size"] == 300
    direct = sum(len(tok.encode(c.decode("utf-8"), eos=True)) for _, c in data.read_documents(corpus["source"]))
    assert m.tokens("train") + m.tokens("val") == direct


def test_prepared_files_are_private_and_a_planted_link_is_replaced_not_followed(local_out, tmp_path):
    out, _ = local_out
    assert out.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in out.iterdir()), sorted(p.name for p in out.iterdir())
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    loc = shards.Location(str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").symlink_to(victim)
    loc.write("manifest.json", b"{}")
    assert victim.read_bytes() == b"keep" and not (tmp_path / "out" / "manifest.json").is_symlink()
