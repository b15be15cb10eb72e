"""ReLU² (tbp/nn/designs/relu2): the layer against its plain twin, a wrong backward caught by the
twin and by the gradient check, a whole model against the core's GPT twin with the twin plugged
in, training and generation, and its refusals. Cached decoding equal to the forward and the
gradient rows of every declared case are tests/test_designs.py's and tests/test_gradcheck.py's."""
import numpy as np
import pytest
from helpers import clean_fail, mlp_against_twin, run, train_tiny

from tbp.check import gradcheck
from tbp.machine import memory
from tbp.nn import reference as ref
from tbp.nn.config import ModelConfig
from tbp.nn.designs.relu2 import relu2 as design
from tbp.nn.designs.relu2 import twin
from tbp.nn.gpt import GPT

B, T, C = 2, 7, 12


def _against_twin(rng, bias=True):
    layer = design.ReLU2MLP(C, rng, np.float64, bias)
    return (layer, *mlp_against_twin(layer, twin.relu2_forward, twin.relu2_backward, rng, B, T))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_layer_equals_its_plain_twin_forward_and_backward(rng, bias):
    layer, y, dx, y_ref, (dx_ref, dw_fc, db_fc, dw_proj, db_proj) = _against_twin(rng, bias)
    tol = dict(rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(y, y_ref, **tol)
    np.testing.assert_allclose(dx, dx_ref, **tol)
    for name, want in (("c_fc.weight", dw_fc), ("c_fc.bias", db_fc), ("c_proj.weight", dw_proj),
                       ("c_proj.bias", db_proj)):
        assert (name in layer.grads) == (want is not None), name
        if want is not None:
            np.testing.assert_allclose(layer.grads[name], want, err_msg=name, **tol)


def test_the_nonlinearity_is_the_square_of_relu(rng):
    u = rng.standard_normal((5, 9))
    np.testing.assert_array_equal(design.relu2(u, np.empty_like(u)), np.where(u > 0, u * u, 0.0))


def relu2_without_the_factor_two(self, dout):
    """ReLU²'s backward with d(r^2)/du taken as r: the chain rule's 2 dropped."""
    dg = self.c_proj.backward(dout)
    return self.c_fc.backward(dg * np.maximum(self.cache, 0))


def test_a_backward_without_the_squares_factor_is_caught(rng, monkeypatch):
    monkeypatch.setattr(design.ReLU2MLP, "backward", relu2_without_the_factor_two)
    layer, y, dx, y_ref, (dx_ref, *_) = _against_twin(rng)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12)
    assert not np.allclose(dx, dx_ref, rtol=1e-6)
    grng = np.random.default_rng(0)
    case = next(c for c in gradcheck.cases(grng) if c.layer == "mlp [relu2]")
    assert not all(r.passed for r in gradcheck.check_case(case, grng))


def test_the_memory_estimate_counts_one_array_fewer():
    base = ModelConfig(vocab_size=65, n_ctx=256, n_layer=6, n_head=6, d_model=384)
    from tbp.train.config import TrainConfig
    tcfg = TrainConfig(batch_size=4, threads=1)
    diff = memory.step_activation_bytes(base.replace(mlp="relu2"), tcfg) - memory.step_activation_bytes(base, tcfg)
    assert diff == -4 * 256 * 4 * 6 * 4 * 384


def test_a_model_of_relu2_blocks_equals_the_core_twin_with_its_twin(rng):
    """The model's loss and every gradient against reference.gpt_loss_and_grads with ReLU²'s twin as the MLP."""
    cfg = ModelConfig.from_dict(dict(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=8, mlp="relu2",
                                     bias=False, tie_head=False, head_bias=False))
    model = GPT(cfg, seed=3, dtype=np.float64)
    for k, p in model.params.items():
        p[...] = (1 if ".ln_" in k or k.startswith("ln_") else 0) + 0.5 * rng.standard_normal(p.shape)
    idx, targets = rng.integers(0, 11, (B, T)), rng.integers(0, 11, (B, T))
    loss = model.loss_and_backward(idx, targets)
    loss_ref, grads_ref = ref.gpt_loss_and_grads(model.params, cfg, idx, targets,
                                                 mlp=(twin.relu2_forward, twin.relu2_backward))
    assert loss == pytest.approx(loss_ref, rel=1e-12)
    assert set(grads_ref) == set(model.grads)
    for k, g in model.grads.items():
        np.testing.assert_allclose(g, grads_ref[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_train_a_relu2_model_then_generate_and_resume(tmp_path, corpus_file, monkeypatch):
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 3, "--mlp", "relu2")
    r = run(["info", "--checkpoint", out])
    assert r.exit_code == 0 and "ReLU²" in r.output, r.output
    r = run(["generate", "--checkpoint", out, "--max-new-tokens", "5", "--seed", "1"])
    assert r.exit_code == 0, r.output
    r = run(["train", "--out", "r", "--resume", "--max-iters", 4, "-q"])
    assert r.exit_code == 0, r.output


def test_what_relu2_cannot_take_is_refused_in_one_line(corpus_file):
    clean_fail(run(["train", "--data", corpus_file, "--mlp", "relu2", "--activation", "relu"]), 2,
               "leave --activation at its default")
