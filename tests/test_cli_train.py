"""`tbp train` through CliRunner: runs, resume, Ctrl-C, refusals and their exit codes."""
import json
import signal
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY, clean_fail, run, train_tiny

from tbp import GPT, ModelConfig
from tbp.runs import disk
from tbp.cli import train as cli_train


@pytest.fixture
def trained(tmp_path, corpus_file, monkeypatch):
    return train_tiny(tmp_path, corpus_file, monkeypatch, "checkpoints/a", 10)


def test_train_on_a_text_file_writes_a_complete_run(trained):
    names = sorted(p.name for p in trained.iterdir() if not p.name.startswith("."))
    assert names == ["best-model-000010.safetensors", "config.json", "metrics.jsonl", "model-000010.safetensors",
                     "optimizer-000010.safetensors", "state.json", "tokenizer.json"]
    assert json.loads((trained / "state.json").read_text())["files"] == {
        "weights": "model-000010.safetensors", "best": "best-model-000010.safetensors",
        "optimizer": "optimizer-000010.safetensors"}
    lines = [json.loads(l) for l in (trained / "metrics.jsonl").read_text().splitlines()]
    for key in ("step", "lr", "train_loss", "grad_norm", "tokens_per_s", "elapsed_s"):
        assert all(key in m for m in lines)
    evals = [m for m in lines if "val_loss" in m]
    assert [m["step"] for m in evals] == [5, 10] and all("val_bpb" in m for m in evals)
    assert json.loads((trained / "state.json").read_text())["step"] == 10
    assert (trained.parent.parent / "data" / "corpus" / "meta.json").is_file()   # prepared on the fly


def test_existing_run_without_resume_or_force_is_refused(trained, corpus_file):
    before = disk.weights_path(trained).read_bytes()
    clean_fail(run(["train", "--data", corpus_file, "--out", trained, *TINY]), 1, "already holds a run")
    assert disk.weights_path(trained).read_bytes() == before
    r = run(["train", "--data", corpus_file, "--out", trained, "--force", "--max-iters", 3, *TINY])
    assert r.exit_code == 0, r.output
    assert json.loads((trained / "state.json").read_text())["step"] == 3


def test_resume_continues_to_a_new_total(trained):
    r = run(["train", "--out", trained, "--resume", "--max-iters", 15, "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads((trained / "state.json").read_text())["step"] == 15


def _ctrl_c_at(monkeypatch, at_step: int, presses: int) -> None:
    """Press Ctrl-C ``presses`` times once the bar has shown step ``at_step`` (the real handler runs)."""
    orig = cli_train.Progress.step

    def step(self, trainer, m):
        orig(self, trainer, m)
        if m["step"] == at_step:
            for _ in range(presses):
                signal.raise_signal(signal.SIGINT)
    monkeypatch.setattr(cli_train.Progress, "step", step)


def test_ctrl_c_saves_and_exits_130_then_resume_finishes(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    orig = cli_train.Progress.step
    _ctrl_c_at(monkeypatch, 3, 1)
    r = run(["train", "--data", corpus_file, "--out", "run", "--max-iters", 10, *TINY])
    assert r.exit_code == 130, r.output
    assert "finishing this step and saving" in r.output
    assert json.loads((tmp_path / "run" / "state.json").read_text())["step"] == 3
    monkeypatch.setattr(cli_train.Progress, "step", orig)
    r = run(["train", "--out", "run", "--resume", "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "run" / "state.json").read_text())["step"] == 10


def test_nan_exits_1_naming_the_step(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", "run", "--max-iters", 30, "--lr", 1e4, "--grad-clip", 0,
             *TINY])
    clean_fail(r, 1, "is nan")
    assert "step" in r.output


@pytest.mark.parametrize("args,code,msg", [
    (["--d-model", 10, "--n-head", 4], 2, "divisible"),
    (["--batch-size", 0], 2, "--batch-size"),
    (["--lr", -1], 2, "--lr"),
    (["--min-lr", 1], 2, "must not exceed lr"),
    (["--resume"], 1, "r: no such checkpoint directory"),
    (["--lora-rank", 4], 2, "give it --init-from"),
    (["--n-ctx", 4096], 1, "fewer than one block"),
])
def test_nonsense_options_are_refused(tmp_path, corpus_file, monkeypatch, args, code, msg):
    monkeypatch.chdir(tmp_path)
    clean_fail(run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 2, *TINY[:-1], *args]), code, msg)
    assert not (tmp_path / "r").exists()                # a refused run leaves no folder


def test_resume_with_data_of_another_tokenizer_is_refused(trained, tmp_path):
    from tbp.data import datasets
    datasets.prepare("completely different alphabet XYZ\n" * 100, "o", "test", tmp_path / "other")
    clean_fail(run(["train", "--out", trained, "--resume", "--data", tmp_path / "other", "-q"]), 1,
               "tokenizer differs")


def test_resume_with_text_the_tokenizer_cannot_encode(trained, tmp_path):
    (tmp_path / "new.txt").write_text("Zebra ζ\n" * 100)
    clean_fail(run(["train", "--out", trained, "--resume", "--data", tmp_path / "new.txt", "-q"]), 1,
               "not in this char tokenizer's vocabulary")


def test_config_file_supplies_options(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps({"model": {"n_layer": 2, "d_model": 16, "n_head": 2,
                                                             "n_ctx": 16}, "max_iters": 4, "batch_size": 2}))
    r = run(["train", "--config", tmp_path / "cfg.json", "--data", corpus_file, "--out", "c", "-q",
             "--eval-batches", 1])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["model"]["n_layer"] == 2 and cfg["train"]["max_iters"] == 4 and cfg["train"]["batch_size"] == 2
    (tmp_path / "bad.json").write_text(json.dumps({"n_layers": 2}))
    assert run(["train", "--config", tmp_path / "bad.json"]).exit_code == 2


def test_a_config_file_names_each_option_as_its_flag_does(tmp_path, corpus_file, monkeypatch):
    """--data, --tokenizer and --tensorboard are set in a config file by their flags' names."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps({"data": str(corpus_file), "tokenizer": "char",
                                                   "tensorboard": str(tmp_path / "tb"), "n_layer": 1, "d_model": 16,
                                                   "n_head": 2, "n_ctx": 16, "max_iters": 2, "batch_size": 2}))
    r = run(["train", "--config", tmp_path / "cfg.json", "--out", "c", "-q", "--eval-batches", 1])
    if r.exit_code != 0 and "tensorboard" in r.output.lower() and "pip install" in r.output:
        pytest.skip("the tensorboard extra is not installed")
    assert r.exit_code == 0, r.output
    assert Path(json.loads((tmp_path / "c" / "config.json").read_text())["data"]).name == corpus_file.stem
    assert (tmp_path / "tb").is_dir()                  # the event files went where the file said


def test_loaded_model_reproduces_logits(trained):
    model = GPT.load(trained)
    idx = np.arange(16)[None] % model.config.vocab_size
    assert model.forward(idx).shape == (1, 16, model.config.vocab_size)
    again = GPT.load(trained)
    np.testing.assert_array_equal(again.forward(idx), model.forward(idx))


def test_resume_needs_out():
    clean_fail(run(["train", "--resume"]), 2, "--resume needs --out")


def test_the_final_val_loss_is_the_split_itself_and_eval_agrees(tmp_path, corpus_file, monkeypatch):
    """Two validation figures, each named: the fixed batches every eval reads (an estimate, the
    curve's), and at the end the whole split in order, the very number tbp eval reports."""
    import json as js
    from helpers import train_tiny
    from tbp.runs.disk import read_metrics
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 10)
    last = [m for m in read_metrics(out) if "val_loss" in m][-1]
    assert last["val_split_every"] == 1 and last["val_split_tokens"] > 0
    r = run(["eval", "--checkpoint", out, "--json"])
    assert r.exit_code == 0, r.output
    assert js.loads(r.stdout)["val_loss"] == last["val_split_loss"]
    assert js.loads(r.stdout)["val_tokens"] == last["val_split_tokens"]


def test_every_kth_window_reads_that_share_of_the_split(dataset):
    from tbp.train.evaluate import split_loss
    model = GPT(ModelConfig(vocab_size=dataset.tokenizer.vocab_size, n_ctx=16, n_layer=1, n_head=2, d_model=16))
    _, whole = split_loss(model, dataset)
    _, half = split_loss(model, dataset, every=2)
    windows = (dataset.val.size - 17) // 16 + 1
    assert whole == windows * 16 and half == -(-windows // 2) * 16


def test_a_large_split_is_read_every_kth_window():
    from types import SimpleNamespace
    import numpy as np
    from tbp.train.evaluate import split_stride
    ds = SimpleNamespace(kind="text", val=np.zeros(10_000_000))
    assert split_stride(ds) == 10 and split_stride(ds, limit=20_000_000) == 1
    assert split_stride(SimpleNamespace(kind="pairs", val=[0] * 10)) == 1


def test_a_second_ctrl_c_stops_at_once_and_says_which_step_is_kept(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _ctrl_c_at(monkeypatch, 7, 2)                   # finish the step and save ... no: out now
    r = run(["train", "--data", corpus_file, "--out", "run", "--max-iters", 20, *TINY])
    assert r.exit_code == 130, r.output
    assert "keeps its checkpoint of step 5" in " ".join(r.output.split())
    assert json.loads((tmp_path / "run" / "state.json").read_text())["step"] == 5
