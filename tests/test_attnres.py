"""Attention Residuals: the mean at initialisation, blocks of one = full, the sources each
operation reads, cached decoding, data parallelism, LoRA and the command line."""
import functools
import json

import numpy as np
import pytest

from tbp.nn.gpt import GPT
from tbp.nn.lora import LORA_TARGETS, add_lora
from tbp.nn.config import ConfigError, ModelConfig
from tbp.nn.designs.attnres.depth import DepthAttention, Sources, rms_inverse
from tbp.nn.batch import Batch
from tbp.train.parallel import DataParallel
from tbp.nn.decode import Inference

BASE = dict(vocab_size=11, n_ctx=12, n_layer=3, n_head=2, d_model=8, residual="attention")


def randomize(model, rng, scale=0.3):
    for p in model.params.values():
        p += rng.standard_normal(p.shape) * scale


def ops(model):
    return model.residual.ops(model.blocks)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("blocks", [0, 2, 3])
def test_with_zero_queries_each_input_is_exactly_the_mean_of_its_sources(rng, dtype, blocks):
    model = GPT(ModelConfig.from_dict(dict(**BASE, residual_blocks=blocks)), seed=1, dtype=dtype)
    for name, p in model.params.items():              # everything random but the queries (zero)
        if not name.endswith("query"):
            p += (rng.standard_normal(p.shape) * 0.3).astype(dtype)
    model.forward(rng.integers(0, 11, (2, 12)))
    for op in ops(model):
        sources = [v for v, _ in op.cache[0]]
        mean = functools.reduce(np.add, sources) / dtype(len(sources))
        np.testing.assert_array_equal(op.mix(op.cache[0])[0], mean)
        np.testing.assert_array_equal(op.weights(), dtype(1) / dtype(len(sources)))


def test_one_block_per_sublayer_is_the_full_form(rng):
    full = GPT(ModelConfig.from_dict(dict(**BASE)), seed=1, dtype=np.float64)
    block = GPT(ModelConfig.from_dict(dict(**BASE, residual_blocks=6)), seed=1, dtype=np.float64)
    randomize(full, rng)
    for k, p in block.params.items():
        p[...] = full.params[k]
    idx, y = rng.integers(0, 11, (2, 12)), rng.integers(0, 11, (2, 12))
    assert abs(full.loss_and_backward(idx, y) - block.loss_and_backward(idx, y)) < 1e-12
    for k, g in full.grads.items():
        assert np.abs(block.grads[k] - g).max() < 1e-12, k


def test_blocks_read_the_embedding_the_finished_blocks_and_the_partial_sum(rng):
    # 3 layers = 6 sublayers in 2 blocks of 3: sources per operation, then the final one
    model = GPT(ModelConfig.from_dict(dict(**BASE, residual_blocks=2)), seed=1, dtype=np.float64)
    randomize(model, rng)
    weights = model.depth_weights(rng.integers(0, 11, (2, 12)))
    assert [w.shape[0] for w in weights] == [2, 2, 2, 3, 3, 3]         # the first attention reads x0 alone
    for w in weights:
        np.testing.assert_allclose(w.sum(0), 1.0, rtol=1e-12)
    # the bookkeeping on its own: embedding 1, a block of 3 sublayers (2 + 3 + 4), a partial sum (5)
    sources = Sources(np.ones((1, 1)), 3, 1e-5)
    for value in (2.0, 3.0, 4.0, 5.0):
        sources.add(np.full((1, 1), value))
    assert [v[0, 0] for v, _ in sources.current()] == [1.0, 9.0, 5.0]


def test_the_sources_rms_norm_is_scale_free_and_the_values_are_not(rng):
    op = DepthAttention(8, 0.0, np.float64)
    op.params["query"][...] = rng.standard_normal(8)
    a, b = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    h1, z1, _, _ = op.mix([(a, rms_inverse(a, 0.0)), (b, rms_inverse(b, 0.0))])
    h2, z2, _, _ = op.mix([(3 * a, rms_inverse(3 * a, 0.0)), (b, rms_inverse(b, 0.0))])
    np.testing.assert_allclose(z1, z2, rtol=1e-12)          # the same weights
    assert not np.allclose(h1, h2)                          # of a larger value


def test_every_operation_gets_a_query_gradient(rng):
    model = GPT(ModelConfig.from_dict(dict(**BASE)), seed=1, dtype=np.float64)
    randomize(model, rng)
    idx, y = rng.integers(0, 11, (2, 12)), rng.integers(0, 11, (2, 12))
    model.loss_and_backward(idx, y)
    assert all(np.abs(op.grads["query"]).max() > 1e-6 for op in ops(model))


@pytest.mark.parametrize("changes", [{}, dict(residual_blocks=2), dict(residual_blocks=3, positions="rope"),
                                     dict(attention="mta", mta_ck=3, residual_blocks=3)])
def test_cached_decoding_equals_the_full_forward_at_every_step(rng, changes):
    model = GPT(ModelConfig.from_dict(dict(**{**BASE, **changes})), seed=2, dtype=np.float64)
    randomize(model, rng)
    idx = rng.integers(0, 11, (3, 12))
    full = model.forward(idx)
    dec = Inference(model, 3)
    steps = [dec.forward(idx[:, :5]).copy()] + [dec.forward(idx[:, t:t + 1]).copy() for t in range(5, 12)]
    assert np.abs(np.concatenate(steps, 1) - full).max() < 1e-12


def test_threads_and_lora_give_the_one_thread_gradients(rng):
    model = GPT(ModelConfig.from_dict(dict(**BASE, residual_blocks=3)), seed=0, dtype=np.float64)
    randomize(model, rng)
    x, y = rng.integers(0, 11, (5, 12)), rng.integers(0, 11, (5, 12))
    loss = model.loss_and_backward(x, y)
    want = model.layout.grads.copy()
    dp = DataParallel(model, 2)
    model.zero_grad()
    assert dp.accumulate(Batch(x, y)) == pytest.approx(loss, rel=1e-13)
    np.testing.assert_allclose(model.layout.grads, want, rtol=1e-11, atol=1e-14)
    dp.close()
    add_lora(model, 2, 4.0, LORA_TARGETS[:4])
    assert not any("res" in k for k in model.grads)         # frozen with the rest of the base
    model.loss_and_backward(x, y)
    assert all(np.isfinite(g).all() for g in model.grads.values())


def test_the_sum_model_is_untouched():
    model = GPT(ModelConfig.from_dict(dict(**{**BASE, "residual": "sum"})))
    assert model.residual.ops(model.blocks) == [] and not any("res" in k for k in model.params)
    names = set(GPT(ModelConfig.from_dict(dict(**BASE))).params)
    assert {"h.0.mlp_res.query", "h.0.mlp_res.gain", "h.1.attn_res.query", "h.2.mlp_res.query", "res_f.query",
            "res_f.gain"} <= names
    assert "h.0.attn_res.query" not in names                  # it would read one source: nothing to learn


@pytest.mark.parametrize("changes,message", [
    (dict(residual="sum", residual_blocks=2), "pass --residual attention"),
    (dict(residual_blocks=4), "must divide the 6 sublayers"),
    (dict(arch="encoder-decoder"), "built for the GPT"),
])
def test_config_refuses_what_it_cannot_build(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(dict(**{**BASE, **changes}))


def test_attention_residuals_run_through_the_command_line(tmp_path, corpus_file, monkeypatch):
    from helpers import clean_fail, run, train_tiny
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "run", 6, "--residual", "attention",
                     "--residual-blocks", "2", "--n-layer", "2")
    r = run(["generate", "--checkpoint", out, "--prompt", "the", "--max-new-tokens", "5", "--seed", "1"])
    assert r.exit_code == 0, r.output
    r = run(["info", out])
    assert r.exit_code == 0, r.output
    assert "blocks: 2 blocks of 2 sublayers" in r.output
    clean_fail(run(["export", out, "--out", tmp_path / "hf"]), 1, "no softmax over depth")
    r = run(["train", "--out", out, "--resume", "--max-iters", 8, "-q"])
    assert r.exit_code == 0, r.output
    r = run(["attention", "--checkpoint", out, "--prompt", "the cat", "--depth", "--json"])
    assert r.exit_code == 0, r.output
    shown = json.loads(r.stdout)
    assert shown["operations"] == ["m0", "a1", "m1", "final"] and shown["sources"] == ["emb", "a0–m0", "a1–m1"]
    np.testing.assert_allclose(np.sum(shown["mean"], axis=1), 1.0, rtol=1e-5)
    r = run(["attention", "--checkpoint", out, "--prompt", "the cat", "--depth"])
    assert r.exit_code == 0 and "final" in r.output, r.output
    r = run(["bench", "--residual", "attention", "--n-layer", "2", "--n-ctx", "16", "--d-model", "16",
             "--n-head", "2", "--iters", "1", "--gen-tokens", "4", "--batch-size", "2", "--json"])
    assert r.exit_code == 0, r.output


def test_a_backward_that_treats_the_depth_weights_as_constants_fails_the_check(monkeypatch):
    """dv_i = alpha_i dh alone (the path through each source's key dropped) must fail gradcheck."""
    from tbp.check import gradcheck

    def broken(self, dh, dsources):
        for (v, _), alpha, d in zip(self.cache[0], self.cache[2], dsources):
            d += dh * alpha[:, None]

    monkeypatch.setattr(DepthAttention, "backward", broken)
    rng = np.random.default_rng(0)
    case = next(c for c in gradcheck.cases(rng) if c.layer.startswith("depth-attention"))
    rows = gradcheck.check_case(case, rng)
    assert [r.passed for r in rows if "source" in r.tensor] == [False] * 4


def test_the_fast_operation_equals_the_plain_one(rng):
    """DepthAttention (vectorised, deferred per-source terms) against its plain twin's
    token-by-token loops, forward and every gradient."""
    from tbp.nn.designs.attnres import twin as attnres_twin
    op = DepthAttention(8, 1e-5, np.float64)
    op.params["query"][...] = rng.standard_normal(8)
    op.params["gain"][...] = 1 + 0.3 * rng.standard_normal(8)
    vs = [rng.standard_normal((6, 8)) * s for s in (0.5, 1.0, 2.0)]
    dh = rng.standard_normal((6, 8))
    h = op.forward([(v, rms_inverse(v, 1e-5)) for v in vs])
    dvs = [np.zeros_like(v) for v in vs]
    op.backward(dh, dvs)
    h_ref, cache = attnres_twin.depth_attention_forward(vs, op.params["query"], op.params["gain"], 1e-5)
    dvs_ref, dw, dg = attnres_twin.depth_attention_backward(dh, cache)
    np.testing.assert_allclose(h, h_ref, rtol=1e-12, atol=1e-14)
    for d, d_ref in zip(dvs, dvs_ref):
        np.testing.assert_allclose(d, d_ref, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(op.grads["query"], dw, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(op.grads["gain"], dg, rtol=1e-10, atol=1e-13)
