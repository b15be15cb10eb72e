"""The variants' fast code equals their plain twins (reference_variants.py, designs/*/twin.py), float64:
the whole Multi-Token Attention layer, the Attention Residuals stack, the encoder-decoder and
sparse decoding's selection rules."""
import numpy as np
import pytest

from tbp.nn.gpt import GPT
from tbp.nn.designs.encdec.seq2seq import EncoderDecoder
from tbp.nn.config import ModelConfig
from tbp.nn.designs.mta.mta import MultiTokenAttention
from tbp.nn.designs.encdec import twin as encdec_twin
from tbp.nn.designs.attnres import twin as attnres_twin
from tbp.nn.designs.mta.map import depth_scale
from tbp.nn.designs.mta import twin as mta_twin
from tbp.nn.designs.sparse.sparse import SELECTIONS, SparseRule, select
from tbp.nn.designs.sparse import twin as sparse_twin

B, T, C = 2, 6, 8


def randomize(module, rng, scale=0.5):
    for p in module.params.values():
        p[...] = rng.standard_normal(p.shape) * scale


def assert_grads_equal(model, grads_ref):
    assert set(grads_ref) == set(model.grads)
    for k, g in model.grads.items():
        np.testing.assert_allclose(g, grads_ref[k], rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("options", [dict(conv=(2, 3)),
                                     dict(conv=(3, 3), post=True, mix=True, group=2, norm=True),
                                     dict(conv=None, mix=True, group=4, norm=True),
                                     dict(conv=(1, 5), post=True),
                                     dict(conv=(2, 3), norm=True, layer=3)], ids=str)
def test_the_whole_mta_layer_equals_its_plain_twin(rng, options):
    options = dict(options)
    depth = options.pop("layer", None)
    scale = {} if depth is None else {"scale": depth_scale(depth)}
    layer = MultiTokenAttention(C, 4, 3, C // 4, rng, np.float64, **options, **scale)
    randomize(layer, rng)
    if "norm_gain" in layer.mta.params:
        layer.mta.params["norm_gain"] += 1
    x = rng.standard_normal((B, T, C))
    params = {k.removeprefix("mta."): v for k, v in layer.params.items()}
    want = mta_twin.mta_attention_forward(x, params, 4, 3, conv=options["conv"] is not None,
                                      post=options.get("post", False), mix=options.get("mix", False),
                                      group=options.get("group", 0), norm=options.get("norm", False), layer=depth)
    np.testing.assert_allclose(layer.forward(x), want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("blocks", [0, 2, 3, 6])
@pytest.mark.parametrize("options", [{}, {"tie_head": False, "bias": False}, {"residual_query_scale": 0.3}], ids=str)
def test_the_attention_residuals_stack_equals_its_plain_twin(rng, blocks, options):
    """Forward and every gradient: the deferred per-source bookkeeping (DepthGrad, Reads)
    against each source's readers summed one by one."""
    cfg = ModelConfig.from_dict(dict(vocab_size=11, n_ctx=8, n_layer=3, n_head=2, d_model=C, residual="attention",
                      residual_blocks=blocks, **options))
    model = GPT(cfg, seed=2, dtype=np.float64)
    randomize(model, rng, 0.3)
    idx, targets = rng.integers(0, 11, (B, T)), rng.integers(0, 11, (B, T))
    loss = model.loss_and_backward(idx, targets)
    loss_ref, grads_ref = attnres_twin.attnres_gpt_loss_and_grads(model.params, cfg, idx, targets)
    assert loss == pytest.approx(loss_ref, rel=1e-12)
    assert_grads_equal(model, grads_ref)


def test_attention_residuals_with_frozen_zero_queries_compute_the_sums_function(rng):
    """c = 0: every input is the mean of its sources, the running sum over their number, and
    layer norm does not see a positive factor (with epsilon 0): the sum model's logits, and no
    gradient reaches the pseudo-queries."""
    shape = dict(vocab_size=11, n_ctx=8, n_layer=3, n_head=2, d_model=C, ln_eps=0.0)
    summed = GPT(ModelConfig(**shape), seed=2, dtype=np.float64)
    frozen = GPT(ModelConfig.from_dict(dict(**shape, residual="attention", residual_query_scale=0.0)), seed=2, dtype=np.float64)
    randomize(summed, rng, 0.3)
    for k, p in frozen.params.items():
        if k in summed.params:
            p[...] = summed.params[k]
        else:
            p[...] = rng.standard_normal(p.shape)              # queries and gains: c = 0 ignores them
    idx, targets = rng.integers(0, 11, (B, T)), rng.integers(0, 11, (B, T))
    np.testing.assert_allclose(frozen.forward(idx), summed.forward(idx), rtol=1e-10, atol=1e-12)
    frozen.zero_grad()
    frozen.loss_and_backward(idx, targets)
    assert all(not frozen.grads[k].any() for k in frozen.grads if k.endswith("query"))


@pytest.mark.parametrize("options", [{}, {"tie_head": False, "n_enc_layer": 1}, {"bias": False, "d_qk": 2}], ids=str)
def test_the_encoder_decoder_equals_its_plain_twin(rng, options):
    cfg = ModelConfig.from_dict(dict(arch="encoder-decoder", vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=C, pad_id=0,
                      **options))
    model = EncoderDecoder(cfg, seed=2, dtype=np.float64)
    randomize(model, rng, 0.3)
    src = rng.integers(1, 11, (B, 7))
    tgt_in, tgt_out = rng.integers(1, 11, (B, T)), rng.integers(1, 11, (B, T))
    src[0, -2:] = 0                              # padded source keys
    tgt_out[1, -1] = 0                           # a padded target: no loss
    loss = model.loss_and_backward(src, tgt_in, tgt_out)
    loss_ref, grads_ref = encdec_twin.encoder_decoder_loss_and_grads(model.params, cfg, src, tgt_in, tgt_out)
    assert loss == pytest.approx(loss_ref, rel=1e-12)
    assert_grads_equal(model, grads_ref)


@pytest.mark.parametrize("kind", SELECTIONS)
@pytest.mark.parametrize("n,budget,recency", [(40, 12, 0.25), (9, 8, 0.5), (100, 30, 0.0)])
def test_the_selection_rules_equal_their_plain_twins(rng, kind, n, budget, recency):
    scores = rng.standard_normal((3, 4, n))
    rule = SparseRule(kind, budget=budget, layers=(1,), recency=recency)
    fast = select(scores, rule)
    plain = sparse_twin.select_positions(scores, kind, budget, rule.sinks, recency)
    np.testing.assert_array_equal(fast, np.array(plain))
