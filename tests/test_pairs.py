"""Paired datasets, their batches, and the runs trained on them: prepare, train, generate, eval."""
import json

import numpy as np
import pytest

from tbp.generate import sampling
from tbp.data import pairs
from tbp.data.batches import PairBatches, batches_for
from tbp.data.datasets import Dataset
from tbp.errors import TbpError
from tbp.nn.config import ModelConfig
from tbp.nn.build import build_model
from tbp.nn.batch import OneSequence
from tbp.nn.designs.encdec.seq2seq import SourceApart

from helpers import clean_fail, run, tiny, train_tiny


def prepared(tmp_path, task="reverse", examples=400, max_len=6):
    ps = pairs.make_task(task, examples, 1, max_len, seed=1)
    pairs.prepare_pairs(ps, task, f"task:{task}", tmp_path / task, val_fraction=0.1)
    return Dataset.load(tmp_path / task), ps


def test_tasks_make_distinct_sources_and_the_right_targets():
    for task, fn in (("reverse", lambda s: s[::-1]), ("sort", lambda s: "".join(sorted(s))), ("copy", str)):
        ps = pairs.make_task(task, 500, 2, 7, seed=3)
        assert len({s for s, _ in ps}) == 500
        assert all(t == fn(s) and 2 <= len(s) <= 7 and s.isdigit() for s, t in ps)
    assert pairs.make_task("reverse", 50, seed=4) == pairs.make_task("reverse", 50, seed=4)
    with pytest.raises(TbpError, match="more than half"):
        pairs.make_task("reverse", 60, 1, 1)


def test_a_prepared_pairs_dataset_holds_every_example_whole(tmp_path):
    ds, ps = prepared(tmp_path)
    assert ds.kind == "pairs" and len(ds.train) == 360 and len(ds.val) == 40
    tok = ds.tokenizer
    got = [tuple(tok.decode(x) for x in ds.train.example(i)) for i in range(len(ds.train))]
    got += [tuple(tok.decode(x) for x in ds.val.example(i)) for i in range(len(ds.val))]
    assert got == ps                                     # validation is the last examples
    assert tok.vocab_size == 13                          # ten digits and three special tokens
    assert ds.meta["val_target_tokens"] == sum(len(t) + 1 for _, t in ps[360:])


def test_damaged_lengths_are_refused(tmp_path):
    ds, _ = prepared(tmp_path)
    lengths = np.fromfile(ds.path / "train.idx", dtype=np.int64)
    lengths[0] += 1
    lengths.tofile(ds.path / "train.idx")
    with pytest.raises(TbpError, match="train.idx: example lengths do not add up"):
        Dataset.load(ds.path)


def test_gpt_batches_put_the_loss_on_the_target_and_its_end_only(tmp_path):
    ds, _ = prepared(tmp_path)
    b = PairBatches(ds, ModelConfig(vocab_size=13, n_ctx=16), OneSequence)
    batch = b.collate("train", [0, 1, 2])
    sep, eot, pad = ds.meta["sep_id"], ds.meta["eot_id"], ds.meta["pad_id"]
    for r, (s, t) in enumerate(b.examples("train", [0, 1, 2])):
        seq = np.concatenate([s, [sep], t, [eot]])
        n = len(seq) - 1
        assert list(batch.idx[r, :n]) == list(seq[:-1])
        assert list(batch.targets[r, :n]) == list(seq[1:])
        assert np.all(batch.idx[r, n:] == pad)
        scored = batch.targets[r][batch.weights[r] > 0]
        assert list(scored) == list(t) + [eot]


def test_encoder_decoder_batches_shift_the_target_behind_a_start_token(tmp_path):
    ds, _ = prepared(tmp_path)
    cfg = ModelConfig.from_dict(dict(arch="encoder-decoder", vocab_size=13, n_ctx=16, pad_id=ds.meta["pad_id"]))
    b = batches_for(ds, cfg, SourceApart)
    batch = b.collate("val", [0, 5])
    for r, (s, t) in enumerate(b.examples("val", [0, 5])):
        assert list(batch.source[r, :len(s)]) == list(s)
        assert list(batch.idx[r, :len(t) + 1]) == [ds.meta["sep_id"]] + list(t)
        assert list(batch.targets[r, :len(t) + 1]) == list(t) + [ds.meta["eot_id"]]
        assert batch.weights[r].sum() == len(t) + 1


def test_a_context_too_short_for_the_longest_example_is_named(tmp_path):
    ds, _ = prepared(tmp_path)
    with pytest.raises(TbpError, match="is 13 tokens as one sequence .* more than this model's context of 8$") as e:
        batches_for(ds, ModelConfig(vocab_size=13, n_ctx=8), OneSequence)
    assert e.value.new_run == "; pass --n-ctx 13 or more"         # what only a new run can do
    with pytest.raises(TbpError, match="trains on paired data"):
        from tbp.data import datasets
        datasets.prepare("some text\n" * 50, "t", "test", tmp_path / "text")
        batches_for(Dataset.load(tmp_path / "text"), ModelConfig(arch="encoder-decoder", vocab_size=13), SourceApart)


def test_cached_and_uncached_targets_are_the_same_tokens(rng):
    cfg = ModelConfig.from_dict(dict(arch="encoder-decoder", vocab_size=13, n_ctx=10, n_layer=2, n_head=2, d_model=16, pad_id=12))
    model = build_model(cfg, seed=0, dtype=np.float64)
    for p in model.params.values():
        p += rng.standard_normal(p.shape) * 0.3
    s = sampling.Sampling(temperature=1.0, top_k=5)
    runs = [list(sampling.generate_ids(model, [3, 4, 5], 20, s, np.random.default_rng(7), 3, use_cache, start=11))
            for use_cache in (True, False)]
    assert len(runs[0]) == 10                             # the target ends with the context
    np.testing.assert_array_equal(np.array(runs[0]), np.array(runs[1]))


# --- the command line -------------------------------------------------------------------------
def test_prepare_pairs_from_tsv_and_jsonl_and_name_bad_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.tsv").write_text("".join(f"q{i}\ta{i}\n" for i in range(30)))
    r = run(["prepare", "--format", "pairs", "--data", "p.tsv"])
    assert r.exit_code == 0, r.output
    assert Dataset.load(tmp_path / "data" / "p").meta["train_examples"] == 27
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"source": f"q{i}", "target": f"a{i}"}) + "\n"
                                              for i in range(30)))
    assert run(["prepare", "--format", "pairs", "--data", "p.jsonl", "--out", "j"]).exit_code == 0
    (tmp_path / "bad.tsv").write_text("a\tb\nno tab here\n")
    clean_fail(run(["prepare", "--format", "pairs", "--data", "bad.tsv"]), 1, "bad.tsv:2: expected source<TAB>target")
    (tmp_path / "bad.jsonl").write_text('{"source": "a", "target": "b"}\n{"source": 3}\n')
    clean_fail(run(["prepare", "--format", "pairs", "--data", "bad.jsonl"]), 1, "bad.jsonl:2: expected")
    (tmp_path / "empty.tsv").write_text("a\tb\n\tb\n")
    clean_fail(run(["prepare", "--format", "pairs", "--data", "empty.tsv"]), 1, "empty.tsv:2: empty source")
    clean_fail(run(["prepare", "--task", "sort", "--data", "p.tsv"]), 2, "not both")
    # a tokenizer reused: the same ids for the same text, and one without the special tokens refused
    r = run(["prepare", "--format", "pairs", "--data", "p.jsonl", "--out", "again", "--tokenizer-from", "data/p"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "again" / "tokenizer.json").read_text() == (tmp_path / "data" / "p" / "tokenizer.json").read_text()
    (tmp_path / "plain.txt").write_text("q a 0123456789\n" * 20)
    assert run(["prepare", "--data", "plain.txt"]).exit_code == 0
    clean_fail(run(["prepare", "--format", "pairs", "--data", "p.tsv", "--out", "x", "--tokenizer-from",
                    "data/plain"]), 1, "paired data needs its own")


@pytest.mark.parametrize("arch", ["encoder-decoder", "gpt"])
def test_train_generate_and_eval_a_pairs_run(tmp_path, monkeypatch, arch):
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--task", "reverse", "--examples", "300", "--max-len", "5"]).exit_code == 0
    r = run(["train", "--data", "data/reverse", "--arch", arch, "--out", "run", "--max-iters", "10",
             *tiny(n_ctx=12)])
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data_kind"] == "pairs" and config["model"]["arch"] == arch
    if arch == "encoder-decoder":
        assert config["model"]["designs"]["encoder-decoder"] == {"n_enc_layer": 1, "pad_id": 12}
    r = run(["generate", "--checkpoint", "run", "--prompt", "1234", "--temperature", "0"])
    assert r.exit_code == 0, r.output
    completion = r.stdout.splitlines()[0]
    assert "1234" not in completion or arch == "gpt"      # the target alone, not the source echoed
    assert set(completion) <= set("0123456789")
    r = run(["eval", "--checkpoint", "run", "--json"])
    assert r.exit_code == 0, r.output
    figures = json.loads(r.stdout)
    assert {"val_loss", "val_bpb", "exact_match", "examples", "token_accuracy"} <= set(figures)
    assert figures["examples"] == 15 and 0 <= figures["exact_match"] <= 1
    r = run(["info", "run"])
    assert r.exit_code == 0 and ("encoder-decoder" in r.output) == (arch == "encoder-decoder")


def test_what_an_encoder_decoder_run_refuses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--task", "copy", "--examples", "200", "--max-len", "4"]).exit_code == 0
    base = ["train", "--data", "data/copy", "--arch", "encoder-decoder", *tiny(n_ctx=8)]
    clean_fail(run(base + ["--positions", "rope", "--out", "a"]), 2, "learned positions")
    clean_fail(run(base + ["--n-ctx", "4", "--out", "b", "--max-iters", "2"]), 1, "pass --n-ctx 5 or more")
    assert run(base + ["--out", "run", "--max-iters", "2"]).exit_code == 0
    clean_fail(run(["export", "run", "--out", "hf"]), 1, "GPT-2 is decoder-only")
    r = run(["attention", "--checkpoint", "run", "--prompt", "12", "--json"])      # cross-attention
    assert r.exit_code == 0, r.output
    view = json.loads(r.stdout)
    assert view["kind"] == "cross-attention" and view["source"] == ["1", "2"]
    w = np.array(view["layers"]["0"])                          # (H, target + end, source)
    assert w.shape == (2, len(view["target"]), 2) and np.allclose(w.sum(-1), 1, atol=1e-5)
    clean_fail(run(["attention", "--checkpoint", "run", "--prompt", "12", "--sparse", "topk"]), 2, "--sparse")
    clean_fail(run(["train", "--init-from", "run", "--lora-rank", "2", "--data", "data/copy", "--out", "l"]),
               2, "LoRA adapters are for the GPT")
    clean_fail(run(["generate", "--checkpoint", "run", "--prompt", ""]), 1, "give one with --prompt")
    clean_fail(run(["eval", "--checkpoint", "run", "--zero-encoder", "--data", "data/copy", "--limit", "3",
                    "--json", "--best", "--checkpoint", "nope"]), 1, "nope")
    r = run(["eval", "--checkpoint", "run", "--zero-encoder", "--limit", "5", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["zero_encoder"] is True


def test_eval_of_a_text_run_covers_the_whole_validation_split(tmp_path, corpus_file, monkeypatch):
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "run", 5)
    r = run(["eval", "--checkpoint", out, "--json"])
    assert r.exit_code == 0, r.output
    figures = json.loads(r.stdout)
    assert "exact_match" not in figures
    from tbp.runs import disk
    model, _, cfg = disk.load_model(out)
    ds = Dataset.load(cfg["data"])
    T = model.config.n_ctx
    windows = (ds.val.size - 1) // T
    assert figures["val_tokens"] == windows * T
    val = np.asarray(ds.val[:windows * T + 1], np.int64)
    want = np.mean([model.loss(val[None, i * T:(i + 1) * T], val[None, i * T + 1:(i + 1) * T + 1])
                    for i in range(windows)])
    assert figures["val_loss"] == pytest.approx(want, rel=1e-5)
    assert figures["val_bpb"] == pytest.approx(want / np.log(2) / ds.bytes_per_loss_token, rel=1e-5)


def test_a_pairs_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--task", "sort", "--examples", "300", "--max-len", "5"]).exit_code == 0
    common = ["--data", "data/sort", "--arch", "encoder-decoder", *tiny(n_ctx=8, threads=2)]
    assert run(["train", *common, "--out", "straight", "--max-iters", "10"]).exit_code == 0
    assert run(["train", *common, "--out", "split", "--max-iters", "5"]).exit_code == 0
    r = run(["train", "--out", "split", "--resume", "--max-iters", "10", "-q"])
    assert r.exit_code == 0, r.output
    from tbp.runs import disk
    a, b = disk.load_model("straight")[0], disk.load_model("split")[0]
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k], err_msg=k)


def test_a_pairs_run_resumed_on_a_raw_file_is_refused(tmp_path, monkeypatch):
    """A raw file given to --resume would be prepared as plain text: a pairs run refuses it,
    naming how to prepare it as pairs, before anything is prepared or written."""
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--task", "sort", "--examples", "300", "--max-len", "5"]).exit_code == 0
    assert run(["train", "--data", "data/sort", *tiny(n_ctx=16), "--out", "p", "--max-iters", "5"]).exit_code == 0
    (tmp_path / "more.tsv").write_text("abc\tcba\nxy\tyx\n")
    before = (tmp_path / "p" / "state.json").read_text()
    clean_fail(run(["train", "--out", "p", "--resume", "--data", "more.tsv", "--max-iters", "8", "-q"]), 1,
               "tbp prepare --format pairs --data more.tsv --tokenizer-from p")
    assert (tmp_path / "p" / "state.json").read_text() == before and not (tmp_path / "data" / "more").exists()
