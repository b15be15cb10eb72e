"""SwiGLU (tbp/nn/designs/swiglu): the layer against its plain twin, a wrong backward caught,
its default width, its option and refusals, and the Llama family's block (RMSNorm, SwiGLU,
rotary positions, no biases, untied head) against the core's GPT twin with the designs' twins
plugged in. Cached decoding equal to the forward and the gradient rows of every declared case
are tests/test_designs.py's and tests/test_gradcheck.py's."""
import json

import numpy as np
import pytest
from helpers import clean_fail, mlp_against_twin, run, train_tiny

from tbp.check import gradcheck
from tbp.machine import memory
from tbp.nn import reference as ref
from tbp.nn.config import ModelConfig
from tbp.nn.designs.rmsnorm import twin as rms_twin
from tbp.nn.designs.rope import twin as rope_twin
from tbp.nn.designs.swiglu import swiglu as design
from tbp.nn.designs.swiglu import twin
from tbp.nn.gpt import GPT

B, T, C = 2, 7, 12


def _against_twin(rng, F, bias=True):
    layer = design.SwiGLU(C, F, rng, np.float64, bias)
    return (layer, *mlp_against_twin(layer, twin.swiglu_forward, twin.swiglu_backward, rng, B, T))


@pytest.mark.parametrize("F,bias", [(12, True), (5, False), (32, True)], ids=str)
def test_the_layer_equals_its_plain_twin_forward_and_backward(rng, F, bias):
    layer, y, dx, y_ref, (dx_ref, dw_fc, db_fc, dw_proj, db_proj) = _against_twin(rng, F, bias)
    tol = dict(rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(y, y_ref, **tol)
    np.testing.assert_allclose(dx, dx_ref, **tol)
    for name, want in (("c_fc.weight", dw_fc), ("c_fc.bias", db_fc), ("c_proj.weight", dw_proj),
                       ("c_proj.bias", db_proj)):
        assert (name in layer.grads) == (want is not None), name
        if want is not None:
            np.testing.assert_allclose(layer.grads[name], want, err_msg=name, **tol)


def swiglu_with_sigmoid_for_silu(self, dout):
    """SwiGLU's backward with silu'(a) taken as sigmoid(a): the a s (1 - s) term dropped."""
    F = self.hidden
    u2, s = self.cache
    a, b = u2[:, :F], u2[:, F:]
    dh = self.c_proj.backward(dout).reshape(-1, F)
    du = np.concatenate([dh * b * s, dh * a * s], axis=1)
    return self.c_fc.backward(du.reshape(*dout.shape[:-1], 2 * F))


def test_a_backward_without_the_gates_own_derivative_is_caught(rng, monkeypatch):
    monkeypatch.setattr(design.SwiGLU, "backward", swiglu_with_sigmoid_for_silu)
    layer, y, dx, y_ref, (dx_ref, *_) = _against_twin(rng, 12)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12)
    assert not np.allclose(dx, dx_ref, rtol=1e-6)
    grng = np.random.default_rng(0)
    case = next(c for c in gradcheck.cases(grng) if c.layer == "mlp [swiglu, F 12]")
    assert not all(r.passed for r in gradcheck.check_case(case, grng))


def test_no_input_overflows_the_gate():
    layer = design.SwiGLU(4, 3, np.random.default_rng(0), np.float32)
    layer.params["c_fc.weight"][...] = 1e4
    with np.errstate(all="raise"):
        y = layer.forward(np.full((1, 2, 4), -50.0, np.float32))
        layer.backward(np.ones_like(y))
    assert np.isfinite(y).all()


@pytest.mark.parametrize("C,F", [(128, 352), (384, 1024), (576, 1536), (768, 2048), (8, 32)])
def test_the_default_width_keeps_the_standard_mlps_parameters(C, F):
    cfg = ModelConfig(d_model=C, n_head=4, mlp="swiglu")
    assert design.hidden_width(cfg) == F
    assert design.hidden_width(cfg.replace(swiglu_hidden=100)) == 100
    standard, gated = 8 * C * C, 3 * C * F
    assert standard <= gated < standard + 3 * C * design.ROUND


def test_the_memory_estimate_counts_its_rows():
    base = ModelConfig(vocab_size=65, n_ctx=256, n_layer=6, n_head=6, d_model=384)
    gated = base.replace(mlp="swiglu")
    from tbp.train.config import TrainConfig
    tcfg = TrainConfig(batch_size=4, threads=1)
    diff = memory.step_activation_bytes(gated, tcfg) - memory.step_activation_bytes(base, tcfg)
    assert diff == 4 * 256 * 4 * 6 * (4 * 1024 - 12 * 384)


def test_the_llama_family_block_equals_the_core_twin_with_the_designs_twins(rng):
    """RMSNorm, SwiGLU, rotary positions, no biases, an untied head without one: the model's loss and every
    gradient against reference.gpt_loss_and_grads with the three designs' twins plugged in."""
    cfg = ModelConfig.from_dict(dict(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=8, norm="rms",
                                     mlp="swiglu", positions="rope", bias=False, tie_head=False, head_bias=False,
                                     swiglu_hidden=6))
    model = GPT(cfg, seed=3, dtype=np.float64)
    for k, p in model.params.items():
        p[...] = (1 if ".ln_" in k or k.startswith("ln_") else 0) + 0.5 * rng.standard_normal(p.shape)
    idx, targets = rng.integers(0, 11, (B, T)), rng.integers(0, 11, (B, T))
    loss = model.loss_and_backward(idx, targets)
    loss_ref, grads_ref = ref.gpt_loss_and_grads(
        model.params, cfg, idx, targets, rope_twin.rotation(cfg.designs["rope"].base),
        norm=(rms_twin.rmsnorm_forward, rms_twin.rmsnorm_backward), mlp=(twin.swiglu_forward, twin.swiglu_backward))
    assert loss == pytest.approx(loss_ref, rel=1e-12)
    assert set(grads_ref) == set(model.grads)
    for k, g in model.grads.items():
        np.testing.assert_allclose(g, grads_ref[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_train_a_llama_family_model_then_generate(tmp_path, corpus_file, monkeypatch):
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "l", 3, "--norm", "rms", "--mlp", "swiglu",
                     "--positions", "rope", "--attention", "gqa", "--n-kv-head", "1", "--no-bias",
                     "--untie-head", "--swiglu-hidden", "40")
    cfg = json.loads((out / "config.json").read_text())["model"]
    assert (cfg["norm"], cfg["mlp"], cfg["designs"]["swiglu"]) == ("rms", "swiglu", {"hidden": 40})
    r = run(["info", "--checkpoint", out])
    assert r.exit_code == 0 and "SwiGLU" in r.output and "F = 40" in r.output, r.output
    r = run(["generate", "--checkpoint", out, "--max-new-tokens", "5", "--seed", "1"])
    assert r.exit_code == 0, r.output
    r = run(["train", "--out", "l", "--resume", "--max-iters", 4, "-q"])
    assert r.exit_code == 0, r.output


def test_what_swiglu_cannot_take_is_refused_in_one_line(corpus_file):
    clean_fail(run(["train", "--data", corpus_file, "--mlp", "swiglu", "--activation", "relu"]), 2,
               "SwiGLU's gate is SiLU")
    clean_fail(run(["train", "--data", corpus_file, "--swiglu-hidden", "64"]), 2, "--mlp swiglu")
    clean_fail(run(["train", "--data", corpus_file, "--mlp", "swiglu", "--swiglu-hidden", "-1"]), 2, "-1")
