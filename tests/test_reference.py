"""The fast layers equal the plain reference (tbp/nn/reference.py), forward and backward, float64."""
import numpy as np
import pytest

from tbp import GPT, ModelConfig
from tbp.nn.attention import CausalSelfAttention
from tbp.nn.designs.encdec.cross import CrossAttention
from tbp.nn.loss import CrossEntropy
from tbp.nn.embedding import Embedding
from tbp.nn.layernorm import LayerNorm
from tbp.nn.linear import Linear, LoRA
from tbp.nn.mlp import MLP
from tbp.nn.kernels import padding_mask
from tbp.nn import reference as ref
from tbp.nn.designs.encdec import twin as encdec_twin
from tbp.nn.designs.rope import twin as rope_twin

B, T, C = 2, 5, 8
TOL = dict(rtol=1e-11, atol=1e-13)


def randomize(module, rng):
    """O(1) random values everywhere, so every term of every formula shows."""
    for p in module.params.values():
        p[...] = rng.standard_normal(p.shape) * 0.5


def fast_pass(layer, x, dy):
    layer.zero_grad()
    y = layer.forward(x)
    return y, layer.backward(dy.copy())


@pytest.mark.parametrize("bias", [True, False])
def test_linear(rng, bias):
    lin = Linear(C, 6, rng, np.float64, bias)
    randomize(lin, rng)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, 6))
    y, dx = fast_pass(lin, x, dy)
    y_ref, cache = ref.linear_forward(x, lin.params["weight"], lin.params.get("bias"))
    dx_ref, dw, db = ref.linear_backward(dy, cache)
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(dx, dx_ref, **TOL)
    np.testing.assert_allclose(lin.grads["weight"], dw, **TOL)
    if bias:
        np.testing.assert_allclose(lin.grads["bias"], db, **TOL)


def test_lora(rng):
    lora = LoRA(Linear(C, 6, rng, np.float64), rank=3, alpha=6.0, rng=rng)
    randomize(lora, rng)                                 # lora_up != 0, or dlora_down would be 0
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, 6))
    y, dx = fast_pass(lora, x, dy)
    p = lora.params
    y_ref, cache = ref.lora_forward(x, p["weight"], p["bias"], p["lora_down"], p["lora_up"], lora.scale)
    dx_ref, ddown, dup = ref.lora_backward(dy, cache)
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(dx, dx_ref, **TOL)
    np.testing.assert_allclose(lora.grads["lora_down"], ddown, **TOL)
    np.testing.assert_allclose(lora.grads["lora_up"], dup, **TOL)
    assert set(lora.grads) == {"lora_down", "lora_up"}   # the base is frozen


@pytest.mark.parametrize("eps,bias", [(1e-5, True), (0.0, True), (1e-5, False)])
def test_layernorm(rng, eps, bias):
    ln = LayerNorm(C, eps, np.float64, bias)
    randomize(ln, rng)
    x, dy = rng.standard_normal((B, T, C)) * 3 + 1, rng.standard_normal((B, T, C))
    y, dx = fast_pass(ln, x, dy)
    y_ref, cache = ref.layernorm_forward(x, ln.params["weight"], ln.params.get("bias"), eps)
    dx_ref, dw, db = ref.layernorm_backward(dy, cache)
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(dx, dx_ref, **TOL)
    np.testing.assert_allclose(ln.grads["weight"], dw, **TOL)
    if bias:
        np.testing.assert_allclose(ln.grads["bias"], db, **TOL)


@pytest.mark.parametrize("d_qk,bias,causal", [(4, True, True), (3, True, True), (4, False, True),
                                              (4, True, False)])
def test_attention(rng, d_qk, bias, causal):
    attn = CausalSelfAttention(C, 2, d_qk, C // 2, rng, np.float64, bias, causal)
    randomize(attn, rng)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    y, dx = fast_pass(attn, x, dy)
    p = attn.params
    y_ref, cache = ref.attention_forward(x, p["c_attn.weight"], p.get("c_attn.bias"), p["c_proj.weight"],
                                         p.get("c_proj.bias"), 2, d_qk, causal)
    dx_ref, dw_attn, db_attn, dw_proj, db_proj = ref.attention_backward(dy, cache)
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(dx, dx_ref, **TOL)
    np.testing.assert_allclose(attn.grads["c_attn.weight"], dw_attn, **TOL)
    np.testing.assert_allclose(attn.grads["c_proj.weight"], dw_proj, **TOL)
    if bias:
        np.testing.assert_allclose(attn.grads["c_attn.bias"], db_attn, **TOL)
        np.testing.assert_allclose(attn.grads["c_proj.bias"], db_proj, **TOL)


@pytest.mark.parametrize("d_qk,bias", [(4, True), (3, False)])
def test_cross_attention(rng, d_qk, bias):
    """Query length 5, key length 7, the last two source positions of row 0 padded."""
    attn = CrossAttention(C, 2, d_qk, C // 2, rng, np.float64, bias)
    randomize(attn, rng)
    x, m, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, 7, C)), rng.standard_normal((B, T, C))
    pad = np.zeros((B, 7), bool)
    pad[0, -2:] = True
    attn.zero_grad()
    y = attn.forward(x, m, padding_mask(pad, np.float64))
    dx, dm = attn.backward(dy.copy())
    p = attn.params
    y_ref, cache = encdec_twin.cross_attention_forward(x, m, p["c_q.weight"], p.get("c_q.bias"), p["c_kv.weight"],
                                               p.get("c_kv.bias"), p["c_proj.weight"], p.get("c_proj.bias"),
                                               2, d_qk, pad)
    dx_ref, dm_ref, *dws = encdec_twin.cross_attention_backward(dy, cache)
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(dx, dx_ref, **TOL)
    np.testing.assert_allclose(dm, dm_ref, **TOL)
    for name, want in zip(("c_q.weight", "c_q.bias", "c_kv.weight", "c_kv.bias", "c_proj.weight", "c_proj.bias"), dws):
        if want is not None:
            np.testing.assert_allclose(attn.grads[name], want, **TOL, err_msg=name)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_mlp(rng, activation):
    mlp = MLP(C, rng, np.float64, True, activation)
    randomize(mlp, rng)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    y, dx = fast_pass(mlp, x, dy)
    p = mlp.params
    y_ref, cache = ref.mlp_forward(x, p["c_fc.weight"], p["c_fc.bias"], p["c_proj.weight"], p["c_proj.bias"],
                                   activation)
    dx_ref, dw_fc, db_fc, dw_proj, db_proj = ref.mlp_backward(dy, cache)
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(dx, dx_ref, **TOL)
    for name, want in (("c_fc.weight", dw_fc), ("c_fc.bias", db_fc), ("c_proj.weight", dw_proj),
                       ("c_proj.bias", db_proj)):
        np.testing.assert_allclose(mlp.grads[name], want, **TOL, err_msg=name)


def test_embedding_with_repeated_tokens(rng):
    emb = Embedding(7, 8, C, rng, np.float64)
    idx = np.array([[1, 3, 3, 0, 6], [3, 1, 2, 2, 5]])
    dy = rng.standard_normal((B, T, C))
    emb.zero_grad()
    x = emb.forward(idx)
    emb.backward(dy)
    x_ref, cache = ref.embedding_forward(idx, emb.params["wte"], emb.params["wpe"])
    dwte, dwpe = ref.embedding_backward(dy, cache)
    np.testing.assert_allclose(x, x_ref, **TOL)
    np.testing.assert_allclose(emb.grads["wte"], dwte, **TOL)
    np.testing.assert_allclose(emb.grads["wpe"], dwpe, **TOL)


def test_cross_entropy(rng):
    logits, targets = rng.standard_normal((B, T, 7)) * 3, rng.integers(0, 7, (B, T))
    ce = CrossEntropy()
    loss = ce.forward(logits, targets)
    loss_ref, cache = ref.cross_entropy_forward(logits, targets)
    assert loss == pytest.approx(loss_ref, rel=1e-13)
    np.testing.assert_allclose(ce.backward(), ref.cross_entropy_backward(cache), **TOL)


@pytest.mark.parametrize("options", [{}, {"tie_head": False}, {"activation": "relu", "ln_eps": 0.0},
                                     {"attn_impl": "flash"}, {"positions": "rope"},
                                     {"positions": "rope", "attn_impl": "flash", "d_qk": 2},
                                     {"bias": False}, {"d_qk": 2}], ids=str)
def test_the_whole_model(rng, options):
    cfg = ModelConfig(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=8, **options)
    model = GPT(cfg, seed=3, dtype=np.float64)
    randomize(model, rng)
    idx, targets = rng.integers(0, 11, (B, T)), rng.integers(0, 11, (B, T))
    loss = model.loss_and_backward(idx, targets)
    rotate = rope_twin.rotation(cfg.designs["rope"].base) if cfg.positions == "rope" else None
    loss_ref, grads_ref = ref.gpt_loss_and_grads(model.params, cfg, idx, targets, rotate)
    assert loss == pytest.approx(loss_ref, rel=1e-12)
    assert set(grads_ref) == set(model.grads)
    for k, g in model.grads.items():
        np.testing.assert_allclose(g, grads_ref[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_the_reference_attention_equals_loops_over_queries(rng):
    """The reference itself, against one query and one key at a time (no matrix algebra)."""
    H, Dk, Dv = 2, 3, 4
    w_attn, b_attn = rng.standard_normal((C, H * (2 * Dk + Dv))), rng.standard_normal(H * (2 * Dk + Dv))
    w_proj = rng.standard_normal((H * Dv, C))
    x = rng.standard_normal((B, T, C))
    y, _ = ref.attention_forward(x, w_attn, b_attn, w_proj, None, H, Dk)
    heads = np.zeros((B, T, H * Dv))
    for b in range(B):
        qkv = x[b] @ w_attn + b_attn
        for h in range(H):
            for i in range(T):
                q = qkv[i, h * Dk:(h + 1) * Dk]
                scores = [q @ qkv[j, H * Dk + h * Dk:H * Dk + (h + 1) * Dk] / np.sqrt(Dk) for j in range(i + 1)]
                w = np.exp(np.array(scores) - max(scores))
                w /= w.sum()
                heads[b, i, h * Dv:(h + 1) * Dv] = sum(
                    wj * qkv[j, 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv] for j, wj in enumerate(w))
    np.testing.assert_allclose(y, heads @ w_proj, **TOL)


@pytest.mark.parametrize("d_qk,bias", [(4, True), (3, False)])
def test_the_plain_kv_cache_loop_gives_the_full_forward_row_by_row(rng, d_qk, bias):
    """ref.attention_decode, one token at a time from an empty cache, gives every row of the
    causal ref.attention_forward; and the fast layer's cached decoding equals both (test_generate)."""
    H, Dv = 2, 4
    w_attn = rng.standard_normal((C, H * (2 * d_qk + Dv)))
    b_attn = rng.standard_normal(H * (2 * d_qk + Dv)) if bias else None
    w_proj, b_proj = rng.standard_normal((H * Dv, C)), (rng.standard_normal(C) if bias else None)
    x = rng.standard_normal((B, T, C))
    full, _ = ref.attention_forward(x, w_attn, b_attn, w_proj, b_proj, H, d_qk)
    cache = ref.empty_cache(B, H, d_qk, Dv)
    rows = [ref.attention_decode(x[:, t:t + 1], cache, w_attn, b_attn, w_proj, b_proj, H, d_qk) for t in range(T)]
    np.testing.assert_allclose(np.concatenate(rows, axis=1), full, **TOL)
    assert cache["k"][0].shape == (B, T, d_qk) and cache["v"][1].shape == (B, T, Dv)
