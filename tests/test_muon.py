"""Muon (tbp/train/muon.py): the Newton-Schulz iteration against its singular-value twin in
float64, the orthogonality of its update, which parameters it updates and which it leaves to
AdamW, an exact resume, and what it refuses in one line."""
import numpy as np
import pytest
from helpers import clean_fail, run, tiny

from tbp.nn.config import ModelConfig
from tbp.nn.gpt import GPT
from tbp.runs import disk
from tbp.train import muon
from tbp.train.optim import AdamW


def newton_schulz_twin(m: np.ndarray, steps: int = muon.NS_STEPS) -> np.ndarray:
    """The same map through the SVD: X = U S V^T, so a X + b (X X^T) X + c (X X^T)^2 X =
    U p(S) V^T with p(s) = a s + b s^3 + c s^5; scaled by the Frobenius norm first, then p applied
    ``steps`` times to each singular value, one step at a time, in float64."""
    a, b, c = muon.NS_COEFFICIENTS
    u, s, vt = np.linalg.svd(m, full_matrices=False)
    s = s / (np.linalg.norm(m) + 1e-7)
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return (u * s) @ vt


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8), (3, 24)])
def test_the_iteration_equals_its_singular_value_twin_in_float64(rng, shape):
    m = rng.standard_normal(shape)
    np.testing.assert_allclose(muon.newton_schulz(m), newton_schulz_twin(m), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(muon.newton_schulz(m.T), muon.newton_schulz(m).T, rtol=1e-12, atol=1e-14)


def test_a_wrong_coefficient_fails_the_twin(rng, monkeypatch):
    m = rng.standard_normal((6, 10))
    want = newton_schulz_twin(m)
    monkeypatch.setattr(muon, "NS_COEFFICIENTS", (3.4445, -4.7750, 2.2))
    assert not np.allclose(muon.newton_schulz(m), want, atol=1e-6)


def test_the_update_is_near_orthogonal_with_the_gradients_singular_vectors(rng):
    """float32, as in training: every singular value in the quintic's band (about 0.7 to 1.2),
    the singular vectors the momentum's. (Five steps lift a singular value at most 3.4445^5, about
    480-fold: one below 1/500 of the norm stays small -- the quintic's known trade.)"""
    u, _ = np.linalg.qr(rng.standard_normal((64, 64)))
    v, _ = np.linalg.qr(rng.standard_normal((192, 64)))
    s = np.geomspace(1e-1, 1e1, 64)                        # two decades of spread
    m = ((u * s) @ v.T).astype(np.float32)
    o = muon.newton_schulz(m)
    assert o.dtype == np.float32
    sv = np.linalg.svd(o.astype(np.float64), compute_uv=False)
    assert 0.6 < sv.min() and sv.max() < 1.25, (sv.min(), sv.max())
    np.testing.assert_allclose(u.T @ o @ v, np.diag(np.diag(u.T @ o @ v)), atol=2e-3)   # U^T O V diagonal


def _model(**kw):
    cfg = ModelConfig(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=8, tie_head=False, **kw)
    model = GPT(cfg, seed=0)
    rng = np.random.default_rng(1)
    model.layout.grads[...] = rng.standard_normal(model.layout.size).astype(np.float32)
    return model


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    ours, plain = _model(), _model()
    opt = muon.Muon(ours.layout, weight_decay=0.1, momentum=0.9)
    assert sorted(opt.hidden) == sorted(k for k in ours.params if k.startswith("h.") and ours.params[k].ndim == 2)
    AdamW(plain.layout, weight_decay=0.1).step(1e-2)
    g = {k: v.copy() for k, v in ours.grads.items()}
    before = {k: v.copy() for k, v in ours.params.items()}
    opt.step(1e-2)
    for k, p in ours.params.items():
        if k in opt.hidden:
            o = muon.newton_schulz(g[k] + 0.9 * g[k])                      # first step: the buffer is g
            want = before[k] * (1 - 1e-2 * 0.1) - 1e-2 * 0.2 * np.sqrt(max(p.shape)) * o
            np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-7, err_msg=k)
        else:                                                             # wte, lm_head, gains, biases
            np.testing.assert_array_equal(p, plain.params[k], err_msg=k)


def test_a_resumed_muon_run_is_the_uninterrupted_one(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = ["--data", corpus_file, "--optimizer", "muon", "--eval-interval", 2, *tiny()]
    assert run(["train", "--out", "whole", "--max-iters", 4, *common]).exit_code == 0
    r = run(["train", "--out", "split", "--max-iters", 2, *common])
    assert r.exit_code == 0, r.output
    r = run(["train", "--out", "split", "--resume", "--max-iters", 4, "-q"])
    assert r.exit_code == 0, r.output
    a, b = disk.load_model(tmp_path / "whole")[0], disk.load_model(tmp_path / "split")[0]
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k], err_msg=k)
    state, _ = disk.read_arrays(disk.checkpoint_files(tmp_path / "split")["optimizer"])
    assert any(k.startswith("momentum.h.0.") for k in state) and "m.wte" in state
    assert "m.h.0.attn.c_attn.weight" not in state and "v.h.0.mlp.c_fc.weight" not in state     # Muon's
    assert "m.h.0.mlp.c_fc.bias" in state                                                     # AdamW's


def test_what_muon_cannot_take_is_one_line(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clean_fail(run(["train", "--data", corpus_file, "--optimizer", "sgd"]), 2, "'sgd' is not one of")
    from tbp.nn.config import ConfigError
    from tbp.train.config import TrainConfig
    with pytest.raises(ConfigError, match="Muon orthogonalises whole matrices"):
        TrainConfig(optimizer="muon", shard_optimizer=True)
    assert run(["train", "--data", corpus_file, "--out", "base", "--max-iters", 2, *tiny()]).exit_code == 0
    clean_fail(run(["train", "--init-from", "base", "--data", corpus_file, "--out", "lora", "--lora-rank", 2,
                    "--optimizer", "muon", "--max-iters", 2, "-q"]), 2, "no hidden matrix")
    clean_fail(run(["train", "--out", "base", "--resume", "--max-iters", 4, "--optimizer", "muon", "-q"]), 2,
               "--optimizer muon differs from the run's adamw")
