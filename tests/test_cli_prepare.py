"""`tbp prepare` through click's CliRunner: outputs, and every bad input as one clear line."""
import json

import pytest
from helpers import clean_fail, run


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_prepare_writes_a_dataset(tmp_path, corpus_file, kind):
    out = tmp_path / "ds"
    r = run(["prepare", "--data", str(corpus_file), "--tokenizer", kind, "--vocab-size",
             "300" if kind == "bpe" else "40", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == kind and meta["source"] == str(corpus_file)
    assert "bytes per token" in r.output


def test_prepare_default_corpus_works_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(["prepare"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "data" / "pydoc" / "train.bin").stat().st_size > 500_000


def test_prepare_from_stdin(tmp_path, corpus_file):
    r = run(["prepare", "--data", "-", "--out", str(tmp_path / "s")], input=corpus_file.read_text())
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["source"] == "stdin"


def test_missing_path(tmp_path):
    clean_fail(run(["prepare", "--data", str(tmp_path / "nope.txt")]), 1, "nope.txt: no such file")


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    clean_fail(run(["prepare", "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o")]),
                         1, "corpus is empty")
    assert not (tmp_path / "o").exists()


def test_folder_without_text_files(tmp_path):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "a.bin").write_bytes(b"\x00")
    clean_fail(run(["prepare", "--data", str(tmp_path / "f")]), 1, "folder has no text files")


def test_invalid_utf8_names_the_place_and_offers_encoding(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"good line\nbad \xff byte\n")
    r = run(["prepare", "--data", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "o")])
    clean_fail(r, 1, "offset 14 (line 2) is not valid utf-8")
    assert "--encoding" in r.output
    r = run(["prepare", "--data", str(tmp_path / "bad.txt"), "--encoding", "latin-1", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output


def test_vocab_below_alphabet(tmp_path, corpus_file):
    clean_fail(run(["prepare", "--data", str(corpus_file), "--tokenizer", "bpe", "--vocab-size", "100",
                              "--out", str(tmp_path / "o")]), 1, "below the byte-level alphabet")
    clean_fail(run(["prepare", "--data", str(corpus_file), "--vocab-size", "5",
                              "--out", str(tmp_path / "o")]), 1, "below the corpus alphabet")
    assert not (tmp_path / "o").exists()


def test_existing_output_is_left_untouched_without_force(tmp_path, corpus_file):
    out = tmp_path / "ds"
    assert run(["prepare", "--data", str(corpus_file), "--out", str(out)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "other.txt").write_text("something else entirely\n" * 50)
    clean_fail(run(["prepare", "--data", str(tmp_path / "other.txt"), "--out", str(out)]),
                         1, "already exists (use --force")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert run(["prepare", "--data", str(tmp_path / "other.txt"), "--out", str(out), "--force"]).exit_code == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no leftovers


def test_usage_errors_exit_2(tmp_path, corpus_file):
    assert run(["prepare", "--tokenizer", "wordpiece"]).exit_code == 2
    assert run(["prepare", "--val-fraction", "1.5"]).exit_code == 2


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_a_bpe_vocabulary_smaller_than_asked_says_why(tmp_path, fmt):
    """BPE stops merging when no pair is left: the summary says so, rather than a silent 400 for 512."""
    if fmt == "chat":
        data = tmp_path / "d.jsonl"
        data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "hi there"},
                                                         {"role": "assistant", "content": "hello"}]}) + "\n"
                                for _ in range(20)))
    else:
        data = tmp_path / "d.txt"
        data.write_text("the cat sat on the mat\n" * 50)
    r = run(["prepare", "--format", fmt, "--data", data, "--tokenizer", "bpe", "--vocab-size", "2000", "--out",
             tmp_path / "ds"])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["vocab_size_asked"] == 2000 and meta["vocab_size"] < 2000
    import re
    said = " ".join(re.sub("[│┌┐└┘─┬┴├┤┼]", " ", r.output).split())        # the table's cells, read as text
    assert "of the 2,000 asked: the text has no pair of tokens left to merge" in said, said
