"""Activation recomputation: the same gradients, bit for bit, from one block's activations at a time."""
import dataclasses

import numpy as np
import pytest
from helpers import clean_fail, run, tiny

from tbp.machine import memory
from tbp.train.config import ConfigError, TrainConfig
from tbp.nn.gpt import GPT
from tbp.nn.config import ModelConfig

CASES = [dict(), dict(dropout=0.1), dict(positions="rope"), dict(attention="gqa", n_kv_head=1),
         dict(attention="mta"), dict(attn_impl="flash"), dict(tie_head=False), dict(bias=False)]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_recomputed_gradients_are_the_stored_ones_bit_for_bit(kw, dtype):
    cfg = ModelConfig.from_dict(dict(vocab_size=20, n_ctx=16, n_layer=3, n_head=2, d_model=16, **kw))
    stored, again = GPT(cfg, seed=1, dtype=dtype), GPT(dataclasses.replace(cfg, recompute=True), seed=1, dtype=dtype)
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, 20, (3, 16)), rng.integers(0, 20, (3, 16))
    noise = np.array([5, 6, 7]) if cfg.dropout else None
    assert stored.loss_and_backward(idx, tgt, noise=noise) == again.loss_and_backward(idx, tgt, noise=noise)
    for name, g in stored.grads.items():
        np.testing.assert_array_equal(again.grads[name], g, err_msg=name)


def test_the_forward_keeps_block_inputs_only():
    cfg = ModelConfig(vocab_size=20, n_ctx=16, n_layer=3, n_head=2, d_model=16, recompute=True)
    model = GPT(cfg, seed=1)
    model.loss(np.zeros((2, 16), np.int64), np.zeros((2, 16), np.int64))
    assert all(m.cache is None for _, m in model.blocks.modules())
    assert len(model._block_inputs) == 3 and model._block_inputs[0][0].shape == (2, 16, 16)


def test_what_cannot_recompute_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="Attention Residuals"):
        ModelConfig(residual="attention", recompute=True)
    with pytest.raises(ConfigError, match="GPT's one stack"):
        ModelConfig.from_dict(dict(arch="encoder-decoder", recompute=True, pad_id=0))


def test_the_memory_estimate_counts_one_block_and_the_inputs():
    tcfg = TrainConfig(batch_size=4, threads=1)
    cfg = ModelConfig(vocab_size=50257, n_ctx=1024, n_layer=12, n_head=12, d_model=768)
    full = memory.step_activation_bytes(cfg, tcfg)
    kept = memory.step_activation_bytes(dataclasses.replace(cfg, recompute=True), tcfg)
    weights = memory.model_bytes(cfg)
    per_block = 26 * 768 + 2 * 12 * 1024
    assert full - kept == 4 * 1024 * 4 * (12 * per_block - (per_block + 12 * 768))
    full, kept = memory.train_bytes(cfg, tcfg), memory.train_bytes(dataclasses.replace(cfg, recompute=True), tcfg)
    assert kept < weights * 4 + 4 * 2 ** 30 and full > 10 * 2 ** 30       # 4 GiB of activations at most
    for kw in (dict(attn_impl="flash"), dict(attention="mta"), dict(dropout=0.1), dict(attn_impl="flash", n_layer=1)):
        small = ModelConfig.from_dict(dict(vocab_size=65, n_ctx=1024, **kw))
        parts = memory.train_parts(dataclasses.replace(small, recompute=True), tcfg)
        plain = memory.train_parts(small, tcfg)["activations"]
        assert parts["activations"] > 0 and (parts["activations"] < plain or small.n_layer == 1), kw


def test_train_takes_recompute_and_a_resume_may_change_it(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", "a", "--max-iters", 4, "--recompute", *tiny()])
    assert r.exit_code == 0, r.output
    r = run(["train", "--out", "a", "--resume", "--max-iters", 6, "--no-recompute", "-q"])
    assert r.exit_code == 0, r.output
    clean_fail(run(["train", "--data", corpus_file, "--out", "b", "--recompute", "--residual", "attention", *tiny()]),
               2, "Attention Residuals' blocks read every earlier block")


def test_too_little_memory_names_what_takes_it_and_what_would_fit(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = {}
    real = memory.train_parts

    def parts(cfg, tcfg):
        seen["parts"] = out = real(cfg, tcfg)
        return out
    monkeypatch.setattr(memory, "train_parts", parts)
    # room for the weights, gradients and moments, and half the activations
    monkeypatch.setattr(memory, "available_bytes",
                        lambda: sum(seen["parts"].values()) - seen["parts"]["activations"] // 2)
    r = run(["train", "--data", corpus_file, "--out", "a", "--max-iters", 2, *tiny(d_model=64, n_ctx=64)])
    clean_fail(r, 1, "training this model needs about")
    said = " ".join(r.output.split())
    for part in ("GiB of memory", "weights", "gradients", "AdamW moments", "activations", "batch 4 x context 64",
                 "--recompute (activations", "a smaller --batch-size", "--lora-rank"):
        assert part in said, part
    assert not (tmp_path / "a").exists()
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)     # not even the weights fit
    r = run(["train", "--data", corpus_file, "--out", "a", "--max-iters", 2, *tiny(d_model=64, n_ctx=64)])
    said = " ".join(r.output.split())
    assert "a smaller model" in said and "--recompute" not in said and "--lora-rank" not in said
