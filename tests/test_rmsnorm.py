"""RMSNorm (tbp/nn/designs/rmsnorm): the layer against its plain twin, a wrong backward caught
by the twin and by the gradient checker, what it normalises (scale, not shift), its flag, its
row in tbp info and its refusals. Cached decoding equal to the forward and the gradient rows of
every declared case are tests/test_designs.py's and tests/test_gradcheck.py's."""
import json

import numpy as np
import pytest
from helpers import clean_fail, run, train_tiny

from tbp.check import gradcheck
from tbp.nn.config import ModelConfig
from tbp.nn.designs.rmsnorm import rmsnorm as design
from tbp.nn.designs.rmsnorm import twin
from tbp.nn.gpt import GPT

B, T, C = 2, 7, 12


def _against_twin(rng, eps, shape=(B, T, C)):
    layer = design.RMSNorm(shape[-1], eps, np.float64)
    layer.params["weight"][...] = 1 + 0.5 * rng.standard_normal(shape[-1])
    x, dy = rng.standard_normal(shape) * 3 + 1, rng.standard_normal(shape)
    layer.zero_grad()
    y = layer.forward(x)
    dx = layer.backward(dy.copy())
    y_ref, cache = twin.rmsnorm_forward(x, layer.params["weight"], None, eps)
    dx_ref, dw_ref, _ = twin.rmsnorm_backward(dy, cache)
    return layer, y, dx, y_ref, dx_ref, dw_ref


@pytest.mark.parametrize("eps,shape", [(1e-5, (B, T, C)), (0.0, (B, T, C)), (0.7, (B, T, C)), (1e-6, (5, 3))],
                         ids=str)
def test_the_layer_equals_its_plain_twin_forward_and_backward(rng, eps, shape):
    layer, y, dx, y_ref, dx_ref, dw_ref = _against_twin(rng, eps, shape)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(layer.grads["weight"], dw_ref, rtol=1e-11, atol=1e-13)


def rmsnorm_without_projection(self, dout):
    """RMSNorm's backward with -xhat mean(dxhat xhat) dropped: dx = r dxhat."""
    xhat, r = self.cache
    return (dout.reshape(xhat.shape) * self.params["weight"] * r).reshape(dout.shape)


def test_a_backward_without_its_projection_is_caught(rng, monkeypatch):
    """The twin and the gradient checker both have teeth: the term that removes the component
    along xhat (what the scale's dependence on x brings) is what a careless derivation drops."""
    monkeypatch.setattr(design.RMSNorm, "backward", rmsnorm_without_projection)
    layer, y, dx, y_ref, dx_ref, dw_ref = _against_twin(rng, 1e-5)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12)                   # the forward is untouched
    assert not np.allclose(dx, dx_ref, rtol=1e-6)
    grng = np.random.default_rng(0)
    case = next(c for c in gradcheck.cases(grng) if c.layer == "rmsnorm [eps 1e-5]")
    rows = gradcheck.check_case(case, grng)
    assert not all(r.passed for r in rows if r.tensor.startswith("x"))


def test_it_divides_out_the_scale_and_keeps_the_mean(rng):
    """rms(c x) = rms(x) for c > 0 (up to eps), and unlike a layer norm it does not centre: a
    constant row keeps its sign, and a shifted row is normalised differently."""
    layer = design.RMSNorm(C, 0.0, np.float64)
    x = rng.standard_normal((1, 3, C))
    np.testing.assert_allclose(layer.forward(1000.0 * x), layer.forward(x), rtol=1e-12)
    np.testing.assert_allclose(layer.forward(np.full((1, 1, C), -2.0)), -1.0, rtol=1e-12)
    assert not np.allclose(layer.forward(x + 1.0), layer.forward(x) + 0.0, atol=1e-3)
    y = layer.forward(x)
    np.testing.assert_allclose((y ** 2).mean(axis=-1), 1.0, rtol=1e-12)    # unit root mean square per row


def test_the_model_has_a_gain_and_no_shift_in_every_norm():
    cfg = ModelConfig(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=8, norm="rms")
    names = GPT(cfg).params
    norms = [k for k in names if ".ln_" in k or k.startswith("ln_")]
    assert sorted(norms) == ["h.0.ln_1.weight", "h.0.ln_2.weight", "h.1.ln_1.weight", "h.1.ln_2.weight",
                             "ln_f.weight"]
    assert all(isinstance(m, design.RMSNorm) for m in (GPT(cfg).ln_f, GPT(cfg).blocks[1].ln_2))


def test_train_with_rmsnorm_records_it_and_tbp_info_says_so(tmp_path, corpus_file, monkeypatch):
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 3, "--norm", "rms", "--ln-eps", "1e-6")
    cfg = json.loads((out / "config.json").read_text())["model"]
    assert cfg["norm"] == "rms" and cfg["ln_eps"] == 1e-6
    r = run(["info", "--checkpoint", out])
    assert r.exit_code == 0, r.output
    assert "RMSNorm" in r.output
    r = run(["generate", "--checkpoint", out, "--max-new-tokens", "5", "--seed", "1"])
    assert r.exit_code == 0, r.output


def test_an_unknown_norm_and_an_export_are_refused_in_one_line(tmp_path, corpus_file, monkeypatch):
    clean_fail(run(["train", "--data", corpus_file, "--norm", "batch"]), 2, "'batch' is not one of")
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 2, "--norm", "rms")
    clean_fail(run(["export", "--checkpoint", out, "--out", tmp_path / "hf"]), 1, "RMSNorm")
