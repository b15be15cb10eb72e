"""Every handwritten gradient against centred finite differences (float64), and the checker's teeth."""
import numpy as np
import pytest

from tbp.check import gradcheck
from tbp.nn.layernorm import LayerNorm
from tbp.nn.mlp import MLP
from tbp.nn.attention import CausalSelfAttention
from tbp.nn.embedding import Embedding
from tbp.nn.loss import CrossEntropy

CASES = [c.layer for c in gradcheck.cases(np.random.default_rng(0))]


def _rows(layer, seed=0):
    rng = np.random.default_rng(seed)
    case = next(c for c in gradcheck.cases(rng) if c.layer == layer)
    return gradcheck.check_case(case, rng)


@pytest.mark.parametrize("layer", CASES)
def test_every_gradient_matches_finite_differences(layer):
    rows = _rows(layer)
    assert rows, "a case with no tensors checks nothing"
    for r in rows:
        assert r.passed, f"{r.layer} {r.tensor}: rel {r.max_rel:.2e} abs {r.max_abs:.2e}"
        if not r.note.startswith("zero"):
            assert r.max_rel < 1e-6
            assert r.note != "all zero", f"{r.tensor}: a zero gradient proves nothing"


def test_cases_cover_every_layer_and_option():
    names = " ".join(CASES)
    for needle in ("embedding", "linear [bias=off]", "lora", "layernorm [eps=0]", "layernorm [no bias]",
                   "d_qk=3 != d_v=4", "non-causal", "mlp [gelu]", "mlp [relu]", "block",
                   "cross-entropy", "tied head", "untied head", "gpt + lora", "cross-entropy [weights]",
                   "gpt [masked loss]", "key padding", "cross-attention [Tq=5, Tk=7, padded key]",
                   "decoder-block", "encoder-decoder [tied head, padding]", "1 enc + 2 dec",
                   "depth-attention", "attention residuals: full", "attention residuals: 2 blocks"):
        assert needle in names


def test_key_bias_gradient_is_zero_and_reported_as_expected():
    rows = [r for r in _rows("attention [causal]") if r.tensor.endswith("[k]")]
    assert len(rows) == 1 and rows[0].passed and "softmax shift" in rows[0].note
    assert rows[0].max_rel < gradcheck.ZERO_ATOL


def layernorm_without_projection(self, dout):
    """Layer norm's backward with the mean(dxhat * xhat) term dropped."""
    xhat, rstd = self.cache                             # rstd = 1 / sqrt(var + eps)
    dxhat = dout.reshape(xhat.shape) * self.params["weight"]
    return ((dxhat - dxhat.mean(-1, keepdims=True)) * rstd).reshape(dout.shape)


def gelu_with_a_flipped_sign(self, dout):
    """GELU's derivative with the tanh' term subtracted instead of added."""
    u, s = self.cache                                   # (N, 4C); s = (1 + tanh z) / 2, the gate
    tanh_z = 2 * s - 1
    dg = self.c_proj.backward(dout)
    k, a = np.sqrt(2 / np.pi), 0.044715
    dg_du = 0.5 * (1 + tanh_z) - 0.5 * u * (1 - tanh_z ** 2) * k * (1 + 3 * a * u * u)
    return self.c_fc.backward(dg * dg_du.reshape(dg.shape))


def softmax_without_row_sum(self, dout):
    """Attention's backward with dS = P * dP: the softmax Jacobian's row-sum term dropped."""
    qs, k, v, saved, y = self.cache
    att = self.kernel.weights(qs, k, saved)             # P (B, H, T, T), whatever the kernel kept
    B, H, T, D = qs.shape
    dy = self.c_proj.backward(dout).reshape(B, T, H, D).transpose(0, 2, 1, 3)
    dv = att.transpose(0, 1, 3, 2) @ dy
    dS = att * (dy @ v.transpose(0, 1, 3, 2))
    dq, dk = dS @ k * self.scale, dS.transpose(0, 1, 3, 2) @ qs
    merge = lambda g: g.transpose(0, 2, 1, 3).reshape(B, T, H * D)
    return self.c_attn.backward(np.concatenate([merge(dq), merge(dk), merge(dv)], -1))


@pytest.mark.parametrize("layer,cls,broken", [
    ("layernorm [eps=1e-05]", LayerNorm, layernorm_without_projection),
    ("mlp [gelu]", MLP, gelu_with_a_flipped_sign),
    ("attention [causal]", CausalSelfAttention, softmax_without_row_sum),
])
def test_a_broken_backward_fails_the_check(monkeypatch, layer, cls, broken):
    monkeypatch.setattr(cls, "backward", broken)
    rows = _rows(layer)
    assert not all(r.passed for r in rows)
    assert any(r.tensor == "x (input)" and not r.passed for r in rows)


def test_an_embedding_backward_that_overwrites_repeated_tokens_fails(monkeypatch):
    def broken(self, dout):
        idx = self.cache
        self.grads["wte"][idx.reshape(-1)] += dout.reshape(-1, dout.shape[-1])   # last write wins
        self.grads["wpe"][:idx.shape[-1]] += dout.sum(0)
    monkeypatch.setattr(Embedding, "backward", broken)
    rows = _rows("embedding [repeated ids]")
    assert [r.passed for r in rows if r.tensor == "wte"] == [False]


def test_a_loss_gradient_off_by_the_mean_fails(monkeypatch):
    orig = CrossEntropy.backward
    monkeypatch.setattr(CrossEntropy, "backward", lambda self: orig(self) * 2)
    assert not _rows("cross-entropy")[0].passed


def test_run_filters_by_layer_and_rejects_unknown():
    rows = gradcheck.run(layer="layernorm")
    assert rows and {r.layer.split(" ")[0] for r in rows} == {"layernorm"}
    with pytest.raises(ValueError, match="no gradcheck case"):
        gradcheck.run(layer="convolution")


def test_causal_blocks_that_drop_the_earlier_blocks_key_gradients_fail(monkeypatch):
    from tbp.nn import kernels

    def broken(dy, qs, k, v, blocks, y, out, rows, drop=None):
        dq, dk, dv = out
        a, b = kernels.query_blocks(qs.shape[2], rows)[-1]
        kernels.attend_backward(dy[:, :, a:], qs[:, :, a:], k, v, blocks[-1], y[:, :, a:], (dq[:, :, a:], dk, dv))
        dq[:, :, :a] = 0                                # the first blocks' terms never computed
    monkeypatch.setattr(kernels, "attend_causal_blocks_backward", broken)
    rows = _rows("attention [causal, query blocks]")
    assert any(r.tensor == "x (input)" and not r.passed for r in rows)


def test_the_table_fits_80_columns_with_every_column():
    """In an 80-column terminal or a log every line fits and no column is dropped."""
    from helpers import run
    r = run(["gradcheck", "--layer", "attention"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if line.startswith("tensor"))
    assert header.split() == ["tensor", "shape", "probed", "abs", "err", "rel", "err", "verdict"]
    assert sum(line.rstrip().endswith(("ok", "zero ok")) for line in lines) > 50


def test_layer_names_are_one_spelling_and_the_former_ones_still_read():
    assert all(" " not in name and "_" not in name for name in gradcheck.LAYERS)
    assert [r.layer for r in gradcheck.run(layer="cross_entropy")] == [r.layer for r in gradcheck.run(layer="cross-entropy")]
    from helpers import run
    r = run(["gradcheck", "--layer", "decoder block"])                 # the CLI reads the former name too
    assert r.exit_code == 0 and "decoder-block [pre-LN, cross]" in r.output
