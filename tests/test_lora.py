"""LoRA fine-tuning end to end: frozen base, exact merge, resume, refusals."""
import json

import numpy as np
import pytest
from helpers import run, tiny

from tbp import GPT
from tbp.runs import disk
from tbp.train import launch
from tbp.train.config import TrainConfig
from tbp.nn.lora import merge_lora
from tbp.train.loop import Callbacks

TINY = tiny(n_layer=2, d_model=32, eval_batches=2, eval_interval=10)
NEW_TEXT = "".join(f"the log sat on the dog; the mat ate the cat. {i % 5}\n" for i in range(400))



@pytest.fixture
def base(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", "base", "--max-iters", 40, "--lr", 1e-2, "--warmup", 2, *TINY])
    assert r.exit_code == 0, r.output
    (tmp_path / "new.txt").write_text(NEW_TEXT)
    return tmp_path / "base"


def lora(args=(), out="ft", iters=30):
    return run(["train", "--init-from", "base", "--data", "new.txt", "--lora-rank", 4, "--out", out,
                "--max-iters", iters, "--lr", 1e-2, "--warmup", 2, "--eval-interval", 10, "--eval-batches", 2, "--batch-size", 4,
                "-q", *args])


def test_fine_tune_trains_adapters_only_and_leaves_the_base_bit_identical(base, tmp_path):
    base_weights = disk.weights_path(base)
    weights_before = base_weights.read_bytes()
    base_model = GPT.load(base)
    r = lora()
    assert r.exit_code == 0, r.output
    assert base_weights.read_bytes() == weights_before
    ft = tmp_path / "ft"
    adapter = disk.weights_path(ft)
    assert adapter.name.startswith("adapter-") and not list(ft.glob("model*"))
    arrays, _ = disk.read_arrays(adapter)
    assert arrays and all("lora_" in k for k in arrays)
    adapted = GPT.load(ft)
    for k, v in base_model.params.items():          # every base tensor inside the adapted model
        np.testing.assert_array_equal(adapted.params[k], v)
    ratio = adapter.stat().st_size / len(weights_before)
    assert ratio < 0.25, ratio
    cfg = json.loads((ft / "config.json").read_text())
    assert cfg["lora"]["rank"] == 4 and cfg["base"]["sha256"] == disk.file_sha256(base_weights)


def test_loss_on_the_new_data_falls(base, tmp_path):
    assert lora(iters=40).exit_code == 0
    evals = [json.loads(l) for l in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    val = [m["val_loss"] for m in evals if "val_loss" in m]
    assert val[-1] < val[0] - 0.1 and val == sorted(val, reverse=True), val


def test_merged_and_unmerged_give_the_same_logits(base, tmp_path):
    assert lora().exit_code == 0
    adapted = GPT.load(tmp_path / "ft", dtype=np.float64)
    idx = np.random.default_rng(0).integers(0, adapted.config.vocab_size, (2, 16))
    before = adapted.forward(idx)
    merge_lora(adapted)
    np.testing.assert_allclose(adapted.forward(idx), before, rtol=0, atol=1e-10)
    r = run(["merge", tmp_path / "ft", "--out", tmp_path / "merged"])
    assert r.exit_code == 0, r.output
    merged = GPT.load(tmp_path / "merged", dtype=np.float64)
    np.testing.assert_allclose(merged.forward(idx), before, rtol=0, atol=1e-5)   # stored as float32
    g = run(["generate", "--checkpoint", tmp_path / "merged", "--max-new-tokens", 5])
    assert g.exit_code == 0, g.output


def test_adapter_run_generates(base, tmp_path):
    assert lora().exit_code == 0
    g = run(["generate", "--checkpoint", tmp_path / "ft", "--prompt", "the", "--max-new-tokens", 10, "--seed", 1])
    assert g.exit_code == 0, g.output


class StopAt(Callbacks):
    def step(self, trainer, m):
        if m["step"] == 6:
            trainer.stop_requested = True


def test_adapter_run_resumes_exactly(base, tmp_path):
    from tbp.data.tokenizer import Tokenizer
    ds = launch.resolve_dataset("new.txt", Tokenizer.load(base / "tokenizer.json"))
    cfg = TrainConfig(batch_size=4, max_iters=12, lr=1e-2, warmup=2, eval_interval=4, eval_batches=1, seed=3)
    spec = launch.LoraSpec(4, 4.0, launch.lora_targets("all"))
    straight = launch.init_from(tmp_path / "s", base, cfg, ds, False, spec, {})
    straight.run_loop()
    split = launch.init_from(tmp_path / "p", base, cfg, ds, False, spec, {}, callbacks=StopAt())
    split.run_loop()
    assert split.interrupted and split.state.step == 6
    resumed = launch.resume(tmp_path / "p", {}, {}, None)
    resumed.run_loop()
    for k in straight.model.grads:
        np.testing.assert_array_equal(resumed.model.params[k], straight.model.params[k], err_msg=k)


@pytest.mark.parametrize("args,msg", [
    (["--lora-rank", 999], "LoRA rank must be in [1, 32]"),
    (["--lora-targets", "attn.c_attn,conv"], "unknown LoRA target 'conv'"),
    (["--lora-targets", "lm_head"], "needs an untied head"),
])
def test_bad_lora_options(base, args, msg):
    r = run(["train", "--init-from", "base", "--data", "new.txt", "--lora-rank", 4, "--out", "bad",
             "--max-iters", 2, "-q", *args])
    assert r.exit_code == 2, r.output
    assert "prepared" not in r.output               # refused before any data was prepared
    assert msg in r.output and "Traceback" not in r.output


def test_changed_or_missing_base_is_refused(base, tmp_path):
    assert lora(iters=5).exit_code == 0
    base_weights = disk.weights_path(base)
    data = bytearray(base_weights.read_bytes())
    data[-1] ^= 1                                  # one bit of one weight
    base_weights.write_bytes(bytes(data))
    g = run(["generate", "--checkpoint", tmp_path / "ft"])
    assert g.exit_code == 1 and "has changed since the adapter was trained" in g.output
    base_weights.unlink()
    g = run(["generate", "--checkpoint", tmp_path / "ft"])
    assert g.exit_code == 1 and "base model" in g.output and "is missing" in g.output


def test_the_base_is_recorded_relative_so_the_runs_move_together(base, tmp_path):
    """config.json names the base relative to the adapter run (../base); moved side by side,
    the pair still loads and generates; tbp info shows where the base is."""
    import shutil
    assert lora().exit_code == 0
    assert disk.read_config(tmp_path / "ft")["base"]["path"] == "../base"
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(str(tmp_path / "ft"), moved / "ft")
    shutil.move(str(tmp_path / "base"), moved / "base")
    r = run(["generate", "--checkpoint", moved / "ft", "--max-new-tokens", 5, "--seed", 1])
    assert r.exit_code == 0, r.output
    assert json.loads(run(["info", moved / "ft", "--json"]).stdout)["base"]["path"] == "../base"


def test_a_fine_tune_prints_no_loss_expected_at_init_and_a_resume_names_its_step(base, tmp_path):
    r = run(["train", "--init-from", "base", "--data", "new.txt", "--out", "full", "--max-iters", 3,
             "--eval-interval", 3, "--eval-batches", 1, "--batch-size", 4])
    assert r.exit_code == 0, r.output
    assert "step 1: loss" in r.stderr and "expected at init" not in r.stderr
    r = run(["train", "--out", "full", "--resume", "--max-iters", 5])
    assert r.exit_code == 0, r.output
    assert "resuming from step 3 of 5" in r.stderr


def test_fine_tuning_a_char_base_on_text_with_new_characters(base, tmp_path):
    """Every character the base lacks is named once, with its count, and the message says what
    can be done; --unknown-chars drop or space then encodes the text, and the dataset says so."""
    from helpers import clean_fail
    from tbp.data.datasets import Dataset
    text = NEW_TEXT + "café costs $3 — `é`\n" * 5
    (tmp_path / "new.txt").write_text(text)
    r = run(["train", "--init-from", "base", "--data", "new.txt", "--out", "ft2", "--max-iters", 2, "-q"])
    clean_fail(r, 1, "--unknown-chars drop")
    for c in ("'é' (U+00E9) x10", "'$' (U+0024) x5", "'—' (U+2014) x5", "'`' (U+0060) x10", "tokenizer bpe"):
        assert c in r.output.replace("\n", " ") or c in r.output, c
    for mode, kept in (("drop", len(text) - 35), ("space", len(text))):
        r = run(["train", "--init-from", "base", "--data", "new.txt", "--out", f"ft-{mode}", "--max-iters", 2,
                 "--unknown-chars", mode, "--eval-batches", 1, "--batch-size", 2, "-q"])
        assert r.exit_code == 0, r.output
        ds = Dataset.load(disk.read_config(tmp_path / f"ft-{mode}")["data"])
        assert ds.meta["unknown_chars"]["mode"] == mode and ds.meta["unknown_chars"]["count"] == 35
        assert ds.meta["train_tokens"] + ds.meta["val_tokens"] == kept
        # bits per byte are of what the tokens encode: the dropped characters' 55 bytes are not in it
        gone = 55 if mode == "drop" else 55 - 35
        assert ds.meta["train_bytes"] + ds.meta["val_bytes"] == len(text.encode()) - gone
    clean_fail(run(["train", "--data", "new.txt", "--out", "x", "--unknown-chars", "drop"]), 2,
               "--unknown-chars is for text encoded with another run's tokenizer")
