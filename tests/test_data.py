"""Datasets: split at a line boundary, exact round trip, memmapped loading, shifted batches."""
import numpy as np
import pytest

from tbp.data import datasets
from tbp.errors import TbpError

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))


@pytest.mark.parametrize("kind,vocab", [("char", None), ("bpe", 300)])
def test_prepare_round_trips_the_corpus_exactly(tmp_path, kind, vocab):
    meta = datasets.prepare(TEXT, "t", "test", tmp_path / "d", kind, vocab, 0.1)
    ds = datasets.Dataset.load(tmp_path / "d")
    assert ds.tokenizer.decode(ds.train) + ds.tokenizer.decode(ds.val) == TEXT
    assert ds.train.dtype == np.uint16 and isinstance(ds.train, np.memmap)
    assert meta["train_tokens"] == ds.train.size and meta["val_tokens"] == ds.val.size
    assert ds.tokenizer.decode(ds.val).startswith("line ")          # cut at a line boundary
    assert 0.08 < meta["val_bytes"] / (meta["train_bytes"] + meta["val_bytes"]) < 0.12
    for key in ("tokenizer", "vocab_size", "dtype", "bytes_per_token", "source_sha256",
                "tokenizer_sha256", "versions", "val_fraction"):
        assert key in meta
    assert meta["tokenizer_sha256"] == ds.tokenizer.sha256()


def test_split_cuts_after_a_newline():
    train, val = datasets.split_text("aaaa\nbbbb\ncccc\n", 0.3)
    assert (train, val) == ("aaaa\nbbbb\n", "cccc\n")
    assert datasets.split_text("no newline at all", 0.5) == ("no newli", "ne at all")
    assert datasets.split_text("abc\n", 0.0) == ("abc\n", "")


def test_chunks_are_whole_lines_and_cover_the_text(monkeypatch):
    from tbp.data import texts
    from tbp.data.corpus import in_memory
    monkeypatch.setattr(texts, "CHUNK_CHARS", 100)
    text = "".join(f"{i}\n" for i in range(1000)) + "tail"
    pieces = list(texts._train_chunks(in_memory(text, "t", "t"), len(text), 1, lambda n: None))
    assert "".join(pieces) == text
    assert all(p.endswith("\n") and len(p) >= 100 for p in pieces[:-1])
    assert list(texts._train_chunks(in_memory(text, "t", "t"), len(text), 3, lambda n: None)) == pieces[::3]


def test_batches_are_shifted_by_one_and_reproducible():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = datasets.get_batch(tokens, 8, 16, np.random.default_rng(5))
    assert x.shape == y.shape == (8, 16) and x.dtype == np.int64
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    np.testing.assert_array_equal(y, x + 1)             # consecutive ids: y is x shifted by one
    x2, y2 = datasets.get_batch(tokens, 8, 16, np.random.default_rng(5))
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)


def test_batch_can_reach_the_last_token():
    tokens = np.arange(17)
    x, y = datasets.get_batch(tokens, 64, 16, np.random.default_rng(0))
    assert (y[:, -1] == 16).all()


def test_split_shorter_than_a_block_is_refused():
    with pytest.raises(TbpError, match="fewer than one block"):
        datasets.get_batch(np.arange(10), 2, 16, np.random.default_rng(0))


def test_builtin_corpus_is_offline_and_sizeable():
    text, name, source = datasets.read_corpus(None)
    assert name == "pydoc" and len(text) > 300_000


def test_folder_of_text_files(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.md").write_text("first\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".hidden.txt").write_text("hidden\n")
    text, name, _ = datasets.read_corpus(str(tmp_path))
    assert text == "first\nsecond\n"


def test_dataset_with_tampered_token_file(tmp_path):
    datasets.prepare(TEXT, "t", "test", tmp_path / "d")
    with open(tmp_path / "d" / "train.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(TbpError, match="train.bin: holds"):
        datasets.Dataset.load(tmp_path / "d")
