"""Corpora of any size: streamed in bounded pieces whose ids equal encoding the whole text at
once, in the formats corpora come in, with nothing half-written after a failure, and a start
that does not scan what prepare already checked."""
import bz2
import gzip
import json
import lzma
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import clean_fail, run

from tbp.data import corpus, datasets, pieces, texts
from tbp.errors import TbpError
from tbp.data.tokenizer import train_bpe, train_char

# multi-byte characters of 2, 3 and 4 bytes, CRLFs, runs of spaces and newlines, no-break spaces
ALPHABET = "ab cd\n\n  \t'sé€😀1.,\r\u00a0xyz\n"


def messy(n, seed=0, newlines=True):
    rng = random.Random(seed)
    letters = ALPHABET if newlines else ALPHABET.replace("\n", "").replace("\r", "")
    return "".join(rng.choice(letters) for _ in range(n))


@pytest.fixture
def small_pieces(monkeypatch):
    """Blocks of a few bytes and pieces of a few characters: every seam an awkward one."""
    monkeypatch.setattr(corpus, "READ_BYTES", 7)
    monkeypatch.setattr(pieces, "PIECE_CHARS", 11)
    monkeypatch.setattr(pieces, "BATCH_PIECES", 3)
    monkeypatch.setattr(texts, "CHUNK_CHARS", 50)


def _ids(ds, split):
    return np.asarray(getattr(ds, split), dtype=np.int64).tolist()


@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.parametrize("newlines", [True, False])
def test_streamed_ids_equal_the_whole_text_encoded_at_once(tmp_path, small_pieces, kind, newlines):
    text = messy(6000, seed=1, newlines=newlines) + ("word " * 400 if not newlines else "")
    (tmp_path / "c.txt").write_bytes(text.encode("utf-8"))
    meta = datasets.prepare_corpus(str(tmp_path / "c.txt"), tmp_path / "ds", kind, 300 if kind == "bpe" else None)
    ds = datasets.Dataset.load(tmp_path / "ds")
    train, val = datasets.split_text(text, 0.1)                 # the in-memory definition of the split
    assert _ids(ds, "train") == ds.tokenizer.hf.encode(train).ids
    assert _ids(ds, "val") == ds.tokenizer.hf.encode(val).ids
    assert ds.tokenizer.decode(_ids(ds, "train") + _ids(ds, "val")) == text
    assert meta["characters"] == len(text) and meta["seams"] == 0
    assert meta["train_bytes"] + meta["val_bytes"] == len(text.encode("utf-8"))


def test_a_stretch_with_no_safe_cut_is_a_counted_seam(monkeypatch, tmp_path):
    monkeypatch.setattr(pieces, "PIECE_CHARS", 100)
    monkeypatch.setattr(pieces, "SEAM_CHARS", 1000)
    tok = train_bpe(["abcdefgh" * 100], 300)
    text = "abcdefgh" * 2000                                # 16,000 letters: no space, no newline
    parts = []
    enc = pieces.PieceEncoder(tok, np.int64, parts.append)
    enc.feed(text)
    enc.finish()
    assert enc.seams == 15 and tok.decode(np.concatenate(parts)) == text


def test_the_same_files_as_preparing_in_memory(tmp_path):
    """The built-in corpus, streamed: the very files the in-memory path wrote (tokens, tokenizer)."""
    text = corpus.builtin_text()
    for kind in ("char", "bpe"):
        streamed = datasets.prepare_corpus(None, tmp_path / kind, kind, 512 if kind == "bpe" else None)
        tok = train_char(text) if kind == "char" else train_bpe(list(_whole_lines(datasets.split_text(text, 0.1)[0])), 512)
        assert streamed["tokenizer_sha256"] == tok.sha256()
        ds = datasets.Dataset.load(tmp_path / kind)
        assert _ids(ds, "val") == tok.hf.encode(datasets.split_text(text, 0.1)[1]).ids


def _whole_lines(text, size=texts.CHUNK_CHARS):
    start = 0
    while start < len(text):
        end = text.find("\n", min(start + size, len(text)) - 1)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def test_a_bpe_tokenizer_trains_on_a_spread_sample_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(texts, "CHUNK_CHARS", 1000)
    (tmp_path / "c.txt").write_text("".join(f"line {i} of the corpus, some words\n" for i in range(3000)))
    r = run(["prepare", "--data", tmp_path / "c.txt", "--out", tmp_path / "ds", "--tokenizer", "bpe",
             "--vocab-size", 300, "--tokenizer-sample", "10K"])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["tokenizer_sample"]["every"] == 10 and meta["tokenizer_sample"]["of_characters"] > 90000
    clean_fail(run(["prepare", "--data", tmp_path / "c.txt", "--out", tmp_path / "d2", "--tokenizer-sample", "1M"]),
               2, "--tokenizer-sample is for --tokenizer bpe")


# --- the formats corpora come in ------------------------------------------------------------
def _compress(path, how, data_bytes):
    if how == "gz":
        path.write_bytes(gzip.compress(data_bytes))
    elif how == "bz2":
        path.write_bytes(bz2.compress(data_bytes))
    elif how == "xz":
        path.write_bytes(lzma.compress(data_bytes))
    else:
        zstandard = pytest.importorskip("zstandard", reason="the zstd extra is not installed: pip install -e '.[zstd]'")
        path.write_bytes(zstandard.ZstdCompressor().compress(data_bytes))


@pytest.mark.parametrize("how", ["gz", "bz2", "xz", "zst"])
def test_compressed_text_prepares_as_the_plain_file_does(tmp_path, how):
    text = messy(5000, seed=2)
    (tmp_path / "plain.txt").write_bytes(text.encode())
    _compress(tmp_path / f"packed.txt.{how}", how, text.encode())
    a = datasets.prepare_corpus(str(tmp_path / "plain.txt"), tmp_path / "a")
    b = datasets.prepare_corpus(str(tmp_path / f"packed.txt.{how}"), tmp_path / "b")
    assert a["source_sha256"] == b["source_sha256"] and b["name"] == "packed"
    assert (tmp_path / "a" / "train.bin").read_bytes() == (tmp_path / "b" / "train.bin").read_bytes()


def test_json_lines_are_documents_of_their_text_field(tmp_path):
    docs = ["first document\nwith two lines", "second, ending in a newline\n", "é€😀 third"]
    lines = [json.dumps({"id": i, "body": d}, ensure_ascii=False) for i, d in enumerate(docs)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n\n")
    _compress(tmp_path / "c2.jsonl.gz", "gz", ("\n".join(lines) + "\n").encode())
    for name in ("c.jsonl", "c2.jsonl.gz"):
        r = run(["prepare", "--data", tmp_path / name, "--text-field", "body", "--out", tmp_path / name[:2]])
        assert r.exit_code == 0, r.output
        ds = datasets.Dataset.load(tmp_path / name[:2])
        assert ds.tokenizer.decode(_ids(ds, "train") + _ids(ds, "val")) == \
            "".join(d if d.endswith("\n") else d + "\n" for d in docs)


@pytest.mark.parametrize("line,message", [
    ('{"text": 3}', "c.jsonl:3: expected a JSON object with a string 'text' field"),
    ('{"text": "a"', "c.jsonl:3: not valid JSON"),
    ('["text"]', "c.jsonl:3: expected a JSON object"),
])
def test_a_malformed_record_is_one_line_and_nothing_is_written(tmp_path, line, message):
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"text": "fine"}\n' + line + "\n")
    clean_fail(run(["prepare", "--data", tmp_path / "c.jsonl", "--out", tmp_path / "ds"]), 1, message)
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds.*"))


def test_parquet_is_read_by_its_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the parquet extra is not installed: pip install -e '.[parquet]'")
    pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra is not installed: pip install -e '.[parquet]'")
    docs = [f"document {i}: some words é€" for i in range(500)]
    pq.write_table(pa.table({"id": list(range(500)), "content": docs}), tmp_path / "c.parquet", row_group_size=64)
    r = run(["prepare", "--data", tmp_path / "c.parquet", "--text-field", "content", "--out", tmp_path / "ds"])
    assert r.exit_code == 0, r.output
    ds = datasets.Dataset.load(tmp_path / "ds")
    assert ds.tokenizer.decode(_ids(ds, "train") + _ids(ds, "val")) == "".join(d + "\n" for d in docs)
    clean_fail(run(["prepare", "--data", tmp_path / "c.parquet", "--out", tmp_path / "d2"]), 1,
               "c.parquet: no column 'text' (it has id, content); pass --text-field NAME")
    pq.write_table(pa.table({"text": ["ok", None]}), tmp_path / "n.parquet")
    clean_fail(run(["prepare", "--data", tmp_path / "n.parquet", "--out", tmp_path / "d3"]), 1,
               "n.parquet: row 2: 'text' is not a string")


def test_a_folder_mixes_plain_compressed_and_records(tmp_path):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "a.txt").write_text("alpha")
    _compress(tmp_path / "f" / "b.md.gz", "gz", b"beta\n")
    (tmp_path / "f" / "c.jsonl").write_text('{"text": "gamma"}\n')
    (tmp_path / "f" / "d.bin").write_bytes(b"\x00\xff")                   # not text: skipped
    assert datasets.read_corpus(str(tmp_path / "f"))[0] == "alpha\nbeta\ngamma\n"


def test_text_field_is_refused_where_nothing_reads_it(tmp_path):
    clean_fail(run(["prepare", "--task", "copy", "--examples", 40, "--text-field", "x", "--out", tmp_path / "t"]),
               2, "--text-field is for --format text")


def test_stdin_is_spooled_then_removed(tmp_path):
    text = messy(3000, seed=4)
    r = subprocess.run([sys.executable, "-m", "tbp", "prepare", "--data", "-", "--out", str(tmp_path / "ds")],
                       input=text.encode(), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    ds = datasets.Dataset.load(tmp_path / "ds")
    assert ds.tokenizer.decode(_ids(ds, "train") + _ids(ds, "val")) == text
    assert not list(tmp_path.glob(".stdin.*"))


def test_undecodable_bytes_in_a_stream_are_named_by_offset_and_line(tmp_path, small_pieces):
    (tmp_path / "c.txt").write_bytes("é line one\nline two\nthree \xff".encode("utf-8").replace(b"\xc3\xbf", b"\xff"))
    clean_fail(run(["prepare", "--data", tmp_path / "c.txt", "--out", tmp_path / "ds"]), 1,
               "c.txt: byte 0xff at offset 27 (line 3) is not valid utf-8")


# --- long runs survive ------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_prepare_stopped_midway_leaves_no_dataset_and_the_rerun_starts_clean(tmp_path, sig):
    (tmp_path / "c.txt").write_text("".join(f"line {i}: {'word ' * 20}\n" for i in range(200000)))   # ~24 MB
    args = [sys.executable, "-m", "tbp", "prepare", "--data", str(tmp_path / "c.txt"), "--out", str(tmp_path / "ds"),
            "--tokenizer", "bpe", "--vocab-size", "300"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(3)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode in (143, -9), err.decode()
    assert not (tmp_path / "ds").exists()
    if sig == signal.SIGTERM:
        assert not [f for f in os.listdir(tmp_path) if f.startswith(".ds.")]
    small = tmp_path / "small.txt"
    small.write_text("a small corpus\n" * 200)
    r = subprocess.run([*args[:5], str(small), *args[6:]], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".ds.")]      # a killed one's staging, swept


# --- training starts fast on a big dataset --------------------------------------------------
def test_load_trusts_what_prepare_checked_and_batches_check_the_rest(tmp_path):
    from tbp.data.batches import TextBatches
    from tbp.nn.config import ModelConfig
    datasets.prepare("the cat sat on the mat\n" * 400, "t", "test", tmp_path / "ds")
    f = tmp_path / "ds" / "train.bin"
    st = f.stat()
    ids = np.fromfile(f, dtype=np.uint16)
    ids[:] = 999                                           # every id out of range, size and mtime kept
    ids.tofile(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    ds = datasets.Dataset.load(tmp_path / "ds")                # not scanned: prepare's stamp holds
    batches = TextBatches(ds, ModelConfig(vocab_size=ds.tokenizer.vocab_size, n_ctx=8))
    with pytest.raises(TbpError, match=r"train.bin: token id 999 is outside the vocabulary"):
        batches.sample("train", 2, np.random.default_rng(0))
    os.utime(f)                                            # touched: scanned again at load
    with pytest.raises(TbpError, match="token id 999 at position 0 is outside the vocabulary"):
        datasets.Dataset.load(tmp_path / "ds")


def test_text_without_spaces_is_cut_at_its_line_breaks_not_at_seams(small_pieces, monkeypatch):
    monkeypatch.setattr(pieces, "SEAM_CHARS", 40)
    tok = train_bpe(["中文的句子没有空格。\n" * 50, "وَالسَّلَامُ\n" * 50], 300)
    text = ("中文的句子没有空格。" * 3 + "\n" + "وَالسَّلَامُ عَلَيْكُمْ\n") * 30
    parts = []
    enc = pieces.PieceEncoder(tok, np.int64, parts.append)
    for i in range(0, len(text), 13):
        enc.feed(text[i:i + 13])
    enc.finish()
    assert enc.seams == 0 and np.concatenate(parts).tolist() == tok.hf.encode(text).ids


def test_a_truncated_zst_is_damage_not_a_short_corpus(tmp_path):
    zstandard = pytest.importorskip("zstandard", reason="the zstd extra is not installed: pip install -e '.[zstd]'")
    whole = zstandard.ZstdCompressor().compress(messy(200000, seed=5).encode())
    (tmp_path / "c.txt.zst").write_bytes(whole[:len(whole) // 3])
    clean_fail(run(["prepare", "--data", tmp_path / "c.txt.zst", "--out", tmp_path / "ds"]), 1,
               "c.txt.zst: damaged zstd data")
    assert not (tmp_path / "ds").exists()


def test_a_corpus_that_changes_while_prepared_is_refused(tmp_path, monkeypatch):
    (tmp_path / "c.txt").write_text("first text\n" * 500)
    real = texts._encode

    def rewriting(corpus, *a):
        (tmp_path / "c.txt").write_text("text first\n" * 900)
        return real(corpus, *a)
    monkeypatch.setattr(texts, "_encode", rewriting)
    clean_fail(run(["prepare", "--data", tmp_path / "c.txt", "--out", tmp_path / "ds"]), 1,
               "c.txt: changed while it was being prepared")
    assert not (tmp_path / "ds").exists()


def test_a_tokenizer_the_pieces_cannot_serve_is_refused(tmp_path):
    from tokenizers import pre_tokenizers
    tok = train_bpe(["some text " * 50], 300)
    tok.hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    with pytest.raises(TbpError, match="not one tbp can encode a corpus with in pieces"):
        datasets.prepare("some text\n" * 50, "t", "test", tmp_path / "ds", tokenizer=tok)


def test_a_corpus_of_empty_records_is_empty(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": ""}\n\n{"text": ""}\n')
    clean_fail(run(["prepare", "--data", tmp_path / "c.jsonl", "--out", tmp_path / "ds", "--tokenizer", "bpe",
                    "--vocab-size", 300]), 1, "corpus is empty")
