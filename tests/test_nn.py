"""Engine forward values against direct loop implementations, causality, equivariance, dtypes, API."""
import math

import numpy as np
import pytest

from tbp import GPT, ModelConfig
from tbp.nn.attention import CausalSelfAttention
from tbp.nn.layernorm import LayerNorm
from tbp.nn.mlp import MLP
from tbp.nn.linear import Linear, LoRA
from tbp.nn.loss import cross_entropy
from tbp.nn.lora import add_lora, merge_lora
from tbp.nn.decode import Inference

TINY = dict(vocab_size=13, n_ctx=16, n_layer=2, n_head=2, d_model=8)


def test_public_api_shapes_and_names():
    cfg = ModelConfig(vocab_size=65, n_ctx=64, n_layer=4, n_head=4, d_model=128)
    model = GPT(cfg, seed=0, dtype=np.float64)
    C, V = 128, 65
    expected = {"wte": (V, C), "wpe": (64, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(4):
        expected.update({
            f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
            f"h.{i}.attn.c_attn.weight": (C, 3 * C), f"h.{i}.attn.c_attn.bias": (3 * C,),
            f"h.{i}.attn.c_proj.weight": (C, C), f"h.{i}.attn.c_proj.bias": (C,),
            f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
            f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
            f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,)})
    assert {k: v.shape for k, v in model.params.items()} == expected
    assert {k: v.shape for k, v in model.grads.items()} == expected
    idx = np.random.default_rng(0).integers(0, V, (3, 10))
    assert model.forward(idx).shape == (3, 10, V)
    loss = model.loss_and_backward(idx[:, :-1], idx[:, 1:])
    assert isinstance(loss, float) and abs(loss - math.log(V)) < 0.3   # near uniform at init
    assert any(np.abs(g).sum() > 0 for g in model.grads.values())


def test_loss_and_backward_zeroes_before_filling():
    model = GPT(ModelConfig.from_dict(dict(**TINY)), dtype=np.float64)
    idx = np.random.default_rng(1).integers(0, 13, (2, 6))
    model.loss_and_backward(idx, idx)
    first = {k: g.copy() for k, g in model.grads.items()}
    model.loss_and_backward(idx, idx)
    for k in first:
        np.testing.assert_array_equal(model.grads[k], first[k])


def test_untied_head_has_lm_head_with_bias():
    model = GPT(ModelConfig.from_dict(dict(**TINY, tie_head=False)), dtype=np.float64)
    assert model.params["lm_head.weight"].shape == (8, 13)
    assert model.params["lm_head.bias"].shape == (13,)


def _attention_by_loops(attn, x):
    """Per sample, per head, per query: the textbook formulas, no vectorisation."""
    W, b = attn.params["c_attn.weight"], attn.params["c_attn.bias"]
    Wo, bo = attn.params["c_proj.weight"], attn.params["c_proj.bias"]
    H, Dk, Dv = attn.n_head, attn.d_qk, attn.d_v
    B, T, C = x.shape
    out = np.zeros((B, T, H * Dv))
    for s in range(B):
        qkv = x[s] @ W + b
        for h in range(H):
            q = qkv[:, h * Dk:(h + 1) * Dk]
            k = qkv[:, H * Dk + h * Dk:H * Dk + (h + 1) * Dk]
            v = qkv[:, 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv]
            for i in range(T):
                visible = range(i + 1) if attn.causal else range(T)
                scores = np.array([q[i] @ k[j] / math.sqrt(Dk) for j in visible])
                w = np.exp(scores - scores.max())
                w /= w.sum()
                out[s, i, h * Dv:(h + 1) * Dv] = sum(w[n] * v[j] for n, j in enumerate(visible))
    return out @ Wo + bo


@pytest.mark.parametrize("causal,dk", [(True, 4), (False, 4), (True, 3)])
def test_attention_forward_matches_loops(rng, causal, dk):
    attn = CausalSelfAttention(8, 2, dk, 4, rng, np.float64, True, causal)
    for p in attn.params.values():
        p[...] = rng.standard_normal(p.shape) * 0.5
    x = rng.standard_normal((2, 5, 8))
    np.testing.assert_allclose(attn.forward(x), _attention_by_loops(attn, x), rtol=1e-12, atol=1e-12)


def test_layernorm_forward_matches_formula(rng):
    ln = LayerNorm(6, eps=1e-5, dtype=np.float64)
    ln.params["weight"][...] = rng.standard_normal(6)
    ln.params["bias"][...] = rng.standard_normal(6)
    x = rng.standard_normal((2, 3, 6)) * 3 + 1
    y = ln.forward(x)
    for b in range(2):
        for t in range(3):
            row = x[b, t]
            mu = sum(row) / 6
            var = sum((r - mu) ** 2 for r in row) / 6
            want = [(r - mu) / math.sqrt(var + 1e-5) * w + c
                    for r, w, c in zip(row, ln.params["weight"], ln.params["bias"])]
            np.testing.assert_allclose(y[b, t], want, rtol=1e-12)


def test_gelu_is_gpt2_tanh_approximation(rng):
    mlp = MLP(4, rng, np.float64, activation="gelu")
    x = rng.standard_normal((1, 3, 4))
    u = x @ mlp.params["c_fc.weight"] + mlp.params["c_fc.bias"]
    g = np.vectorize(lambda z: 0.5 * z * (1 + math.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3))))(u)
    np.testing.assert_allclose(mlp.forward(x), g @ mlp.params["c_proj.weight"] + mlp.params["c_proj.bias"],
                               rtol=1e-12)


def test_cross_entropy_matches_definition(rng):
    logits = rng.standard_normal((2, 3, 5)) * 4
    targets = rng.integers(0, 5, (2, 3))
    want = np.mean([-math.log(math.exp(logits[b, t, targets[b, t]]) / sum(math.exp(z) for z in logits[b, t]))
                    for b in range(2) for t in range(3)])
    assert cross_entropy(logits, targets) == pytest.approx(want, rel=1e-12)


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[[1000.0, 0.0, -1000.0]]])
    assert cross_entropy(logits, np.array([[0]])) == pytest.approx(0.0, abs=1e-12)
    assert cross_entropy(logits, np.array([[2]])) == pytest.approx(2000.0)


def test_changing_a_future_token_changes_no_earlier_logit(rng):
    model = GPT(ModelConfig.from_dict(dict(**TINY)), dtype=np.float64)
    idx = rng.integers(0, 13, (2, 10))
    base = model.forward(idx)
    for t in (3, 9):
        changed = idx.copy()
        changed[:, t] = (changed[:, t] + 1) % 13
        out = model.forward(changed)
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        assert not np.allclose(out[:, t], base[:, t])


def test_non_causal_attention_is_permutation_equivariant(rng):
    attn = CausalSelfAttention(8, 2, 4, 4, rng, np.float64, True, causal=False)
    x = rng.standard_normal((2, 7, 8))
    perm = rng.permutation(7)
    np.testing.assert_allclose(attn.forward(x[:, perm]), attn.forward(x)[:, perm], rtol=1e-12, atol=1e-14)
    causal = CausalSelfAttention(8, 2, 4, 4, rng, np.float64, True, causal=True)
    assert not np.allclose(causal.forward(x[:, perm]), causal.forward(x)[:, perm])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype_is_kept_end_to_end(rng, dtype):
    model = GPT(ModelConfig.from_dict(dict(**TINY, tie_head=False, activation="relu")), dtype=dtype)
    assert all(p.dtype == dtype for p in model.params.values())
    idx = rng.integers(0, 13, (2, 6))
    assert model.forward(idx).dtype == dtype
    model.loss_and_backward(idx, idx)
    assert all(g.dtype == dtype for g in model.grads.values())
    decoder = Inference(model, 2)
    assert decoder.forward(idx).dtype == dtype
    assert {a.dtype for _, _, a in decoder.caches()} == {np.dtype(dtype)}


def test_same_seed_same_model_across_dtypes():
    a = GPT(ModelConfig.from_dict(dict(**TINY)), seed=7, dtype=np.float32)
    b = GPT(ModelConfig.from_dict(dict(**TINY)), seed=7, dtype=np.float64)
    for k in a.params:
        np.testing.assert_allclose(a.params[k], b.params[k], rtol=1e-6)


@pytest.mark.parametrize("idx,match", [
    (np.array([[1, 13]]), "token id 13 is outside the vocabulary"),
    (np.array([[-1, 2]]), "token id -1 is outside"),
    (np.zeros((1, 17), dtype=int), "longer than the context"),
    (np.array([[1.0, 2.0]]), "must be integers"),
    (np.zeros((1, 2, 3), dtype=int), r"shape \(B, T\)"),
])
def test_bad_tokens_raise_clear_value_errors(idx, match):
    model = GPT(ModelConfig.from_dict(dict(**TINY)))
    with pytest.raises(ValueError, match=match):
        model.forward(idx)


@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=10, n_head=4), "divisible"),
    (dict(activation="swish"), "activation"),
    (dict(n_layer=0), "n_layer"),
    (dict(ln_eps=-1.0), "ln_eps"),
    (dict(d_qk=0), "d_qk"),
])
def test_config_rejects_nonsense(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(dict(**{**TINY, **kwargs}))


def test_config_json_round_trip():
    cfg = ModelConfig.from_dict(dict(**TINY, d_qk=3, bias=False))
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown model config keys: colour"):
        ModelConfig.from_dict({**cfg.to_dict(), "colour": "red"})


def test_lora_starts_equal_to_base_and_merges_exactly(rng):
    model = GPT(ModelConfig.from_dict(dict(**TINY, tie_head=False)), seed=3, dtype=np.float64)
    idx = rng.integers(0, 13, (2, 9))
    before = model.forward(idx)
    add_lora(model, rank=2, alpha=4.0, targets=("attn.c_attn", "mlp.c_proj", "lm_head"), seed=1)
    np.testing.assert_array_equal(model.forward(idx), before)
    assert set(model.grads) == {k for k in model.params if "lora_" in k}
    for k in model.grads:
        if k.endswith("lora_up"):
            model.params[k][...] = rng.standard_normal(model.params[k].shape) * 0.1
    adapted = model.forward(idx)
    assert not np.allclose(adapted, before)
    merge_lora(model)
    assert not any("lora_" in k for k in model.params)
    np.testing.assert_allclose(model.forward(idx), adapted, rtol=0, atol=1e-10)


@pytest.mark.parametrize("rank", [0, 9])
def test_lora_rank_out_of_range(rng, rank):
    with pytest.raises(ValueError, match="LoRA rank"):
        LoRA(Linear(8, 8, rng), rank, 1.0, rng)


def test_lora_frozen_base_gets_no_gradient(rng):
    model = GPT(ModelConfig.from_dict(dict(**TINY)), dtype=np.float64)
    base = {k: v.copy() for k, v in model.params.items()}
    add_lora(model, rank=2, alpha=2.0, seed=0)
    idx = rng.integers(0, 13, (2, 6))
    model.loss_and_backward(idx, idx)
    assert all("lora_" in k for k in model.grads)
    for k, v in base.items():
        np.testing.assert_array_equal(model.params[k], v)


@pytest.mark.parametrize("T,rows", [(64, 64), (128, 64), (129, 64), (200, 64), (13, 4)])
def test_causal_query_blocks_equal_the_full_square(T, rows):
    """Causal dense attention in query blocks (which skip the masked part of S) gives the full
    square's output, weights and gradients, and the full square is what a split of 0 blocks is."""
    from tbp.nn.attention import CausalSelfAttention
    from tbp.nn.kernels import query_blocks
    spans = query_blocks(T, rows)
    assert spans[0][0] == 0 and spans[-1][1] == T and len(spans) == max(1, T // rows)
    results = []
    for split in (rows, 10 ** 9):
        layer = CausalSelfAttention(32, 4, 8, 8, np.random.default_rng(0), np.float64, split_rows=split)
        rng = np.random.default_rng(1)
        x, d = rng.standard_normal((2, T, 32)), rng.standard_normal((2, T, 32))
        y = layer.forward(x)
        assert len(layer.cache[3][1]) == len(query_blocks(T, split))     # P in that many query blocks
        P = layer.weights()
        dx = layer.backward(d)
        results.append((y, P, dx, {k: g.copy() for k, g in layer.grads.items()}))
    (y1, P1, dx1, g1), (y0, P0, dx0, g0) = results
    np.testing.assert_allclose(y1, y0, rtol=0, atol=1e-14)
    np.testing.assert_allclose(P1, P0, rtol=0, atol=1e-15)
    np.testing.assert_allclose(dx1, dx0, rtol=0, atol=1e-13)
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=0, atol=1e-12 * max(1.0, np.abs(g0[k]).max()))


@pytest.mark.parametrize("arch, per_block", [("gpt", 2), ("encoder-decoder", 3)])
def test_scaled_proj_init_shrinks_only_the_residual_projections(arch, per_block):
    """--proj-init scaled draws the same numbers as flat, the projections into the residual
    stream divided by sqrt(additions): 2 per block (3 in a decoder block, whose encoder has 2
    per encoder block); every other parameter is unchanged."""
    kw = dict(vocab_size=13, n_ctx=16, n_layer=3, n_head=2, d_model=8, arch=arch)
    if arch == "encoder-decoder":
        kw.update(n_enc_layer=2, pad_id=0)
    from tbp.nn.build import build_model
    flat = build_model(ModelConfig.from_dict(dict(**kw)), seed=0, dtype=np.float64).params
    scaled = build_model(ModelConfig.from_dict(dict(**kw, proj_init="scaled")), seed=0, dtype=np.float64).params
    assert flat.keys() == scaled.keys()
    shrunk = 0
    for name, w in flat.items():
        if name.endswith("c_proj.weight"):
            additions = 2 * 2 if name.startswith("enc.") else per_block * 3
            np.testing.assert_allclose(scaled[name], w / math.sqrt(additions), rtol=1e-12)
            shrunk += 1
        else:
            np.testing.assert_array_equal(scaled[name], w)
    assert shrunk == (3 * 3 + 2 * 2 if arch == "encoder-decoder" else 2 * 3)


def test_the_loss_in_place_gives_the_same_numbers_and_keeps_one_array():
    from tbp.nn.loss import CrossEntropy
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 5, 7)).astype(np.float32)
    targets, weights = rng.integers(0, 7, (2, 5)), rng.random((2, 5)).astype(np.float32)
    a, b = CrossEntropy(), CrossEntropy()
    la = a.forward(logits, targets, weights)
    mine = logits.copy()
    lb = b.forward(mine, targets, weights, overwrite=True)
    assert la == lb
    ga, gb = a.backward(), b.backward()
    np.testing.assert_array_equal(ga, gb)
    assert np.shares_memory(gb, mine)                   # the logits became the gradient
