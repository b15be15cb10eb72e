"""The encoder-decoder and the masked loss: identities, exact zeros, cached decoding."""
import numpy as np
import pytest

from tbp.check import gradcheck
from tbp.nn.gpt import GPT
from tbp.nn.attention import CausalSelfAttention
from tbp.nn.config import ConfigError, ModelConfig
from tbp.nn.designs.encdec.cross import CrossAttention
from tbp.nn.designs.encdec.seq2seq import EncoderDecoder
from tbp.nn.build import build_model
from tbp.nn.kernels import padding_mask
from tbp.nn.decode import Inference

F64 = np.float64


def s2s_cfg(**changes):
    base = dict(arch="encoder-decoder", vocab_size=13, n_ctx=12, n_layer=2, n_head=2, d_model=16, pad_id=0)
    return ModelConfig.from_dict(dict(**{**base, **changes}))


def randomize(model, rng, scale=0.3):
    for p in model.params.values():
        p[...] = rng.standard_normal(p.shape) * scale + (1.0 if p.ndim == 1 else 0.0)


def test_unit_weights_give_the_unweighted_loss_and_gradients_bit_for_bit(rng):
    cfg = ModelConfig(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=16)
    idx, tgt = rng.integers(0, 11, (3, 8)), rng.integers(0, 11, (3, 8))
    a, b = GPT(cfg, seed=1), GPT(cfg, seed=1)                   # float32, as training runs
    la = a.loss_and_backward(idx, tgt)
    lb = b.loss_and_backward(idx, tgt, weights=np.ones((3, 8), np.float32))
    assert la == lb
    assert np.array_equal(a.layout.grads, b.layout.grads)


def test_weighted_loss_is_the_weighted_mean_of_token_losses(rng):
    cfg = ModelConfig(vocab_size=11, n_ctx=8, n_layer=1, n_head=2, d_model=8)
    model = GPT(cfg, seed=2, dtype=F64)
    idx, tgt = rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))
    w = rng.random((2, 8)) * (rng.random((2, 8)) > 0.4)
    w[0, 0] = 1
    logits = model.forward(idx)
    z = logits - logits.max(-1, keepdims=True)
    ce = np.log(np.exp(z).sum(-1)) - np.take_along_axis(z, tgt[..., None], -1)[..., 0]
    assert model.loss(idx, tgt, w) == pytest.approx(float((w * ce).sum() / w.sum()), rel=1e-12)
    with pytest.raises(ValueError, match="positive sum"):
        model.loss(idx, tgt, np.zeros((2, 8)))


def test_cross_attention_on_its_own_input_is_non_causal_self_attention(rng):
    """With m = x, one set of weights and no masks, cross-attention is self-attention."""
    C, H, Dk = 16, 4, 4
    selfattn = CausalSelfAttention(C, H, Dk, C // H, rng, F64, causal=False)
    cross = CrossAttention(C, H, Dk, C // H, rng, F64)
    randomize(selfattn, rng)
    W, b = selfattn.c_attn.params["weight"], selfattn.c_attn.params["bias"]
    cross.c_q.params["weight"][...], cross.c_q.params["bias"][...] = W[:, :H * Dk], b[:H * Dk]
    cross.c_kv.params["weight"][...], cross.c_kv.params["bias"][...] = W[:, H * Dk:], b[H * Dk:]
    cross.c_proj.params["weight"][...] = selfattn.c_proj.params["weight"]
    cross.c_proj.params["bias"][...] = selfattn.c_proj.params["bias"]
    x = rng.standard_normal((2, 6, C))
    want = selfattn.forward(x)
    got = cross.forward(x, x)
    assert np.abs(got - want).max() < 1e-12
    # and the gradients: self-attention's dx is the sum of the two streams'
    dout = rng.standard_normal(want.shape)
    dx_self = selfattn.backward(dout)
    dx, dm = cross.backward(dout)
    assert np.abs(dx + dm - dx_self).max() < 1e-12


def test_padded_source_keys_get_exactly_zero_gradient(rng):
    C, H = 16, 2
    cross = CrossAttention(C, H, 8, 8, rng, F64)
    randomize(cross, rng)
    x, m = rng.standard_normal((2, 5, C)), rng.standard_normal((2, 7, C))
    pad = np.zeros((2, 7), bool)
    pad[0, 4:] = True
    cross.forward(x, m, padding_mask(pad, F64))
    _, dm = cross.backward(rng.standard_normal((2, 5, C)))
    assert np.all(dm[pad] == 0.0) and np.all(dm[~pad] != 0.0)
    # through the whole model: a pad token's embedding row learns nothing from the source side
    model = EncoderDecoder(s2s_cfg(), seed=0, dtype=F64)
    randomize(model, rng)
    src = np.array([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]])
    model.loss_and_backward(src, np.array([[1, 3, 4], [1, 6, 7]]), np.array([[3, 4, 2], [6, 7, 0]]))
    assert np.all(model.grads["enc.wte"][0] == 0.0)


def test_padding_changes_nothing_but_the_padded_positions(rng):
    """A source padded to a longer batch gives the same logits as the source alone."""
    model = EncoderDecoder(s2s_cfg(), seed=0, dtype=F64)
    randomize(model, rng)
    tgt = np.array([[1, 5, 6, 7]])
    alone = model.forward(np.array([[3, 4, 5]]), tgt)
    padded = model.forward(np.array([[3, 4, 5, 0, 0, 0]]), tgt)
    assert np.abs(alone - padded).max() < 1e-12


def test_the_decoder_reads_the_encoder(rng):
    model = EncoderDecoder(s2s_cfg(), seed=0, dtype=F64)
    randomize(model, rng)
    tgt = np.array([[1, 5, 6]])
    a = model.forward(np.array([[3, 4, 5]]), tgt)
    b = model.forward(np.array([[5, 4, 3]]), tgt)
    assert np.abs(a - b).max() > 1e-3
    model.source_scale = 0.0          # the ablation: the source no longer matters
    c = model.forward(np.array([[3, 4, 5]]), tgt)
    d = model.forward(np.array([[5, 4, 3]]), tgt)
    assert np.abs(c - d).max() < 1e-12


@pytest.mark.parametrize("batch_of_sources", [True, False])
def test_cached_decoding_equals_the_full_forward_at_every_step(rng, batch_of_sources):
    model = EncoderDecoder(s2s_cfg(tie_head=False), seed=0, dtype=F64)
    randomize(model, rng)
    src = np.array([[3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 11], [5, 5, 0, 0, 0, 0]])
    if not batch_of_sources:
        src = src[1:2]                 # one source, shared by every sample
    B = 3
    tgt = np.concatenate([np.ones((B, 1), int), rng.integers(2, 13, (B, 9))], 1)
    full = model.forward(np.broadcast_to(src, (B, src.shape[1])), tgt)
    dec = Inference(model, B)
    dec.encode(src)
    steps = [dec.forward(tgt[:, :3]).copy()]                   # a prefill of 3, then one at a time
    for t in range(3, tgt.shape[1]):
        steps.append(dec.forward(tgt[:, t:t + 1]).copy())
    cached = np.concatenate(steps, 1)
    assert np.abs(cached - full).max() < 1e-10
    with pytest.raises(ValueError, match="encode a source first"):
        Inference(model, 1).forward(tgt[:1, :1])


def test_model_builds_from_its_config_and_names_the_encoder_apart():
    model = build_model(s2s_cfg())
    assert isinstance(model, EncoderDecoder)
    names = list(model.params)
    assert "enc.wte" in names and "wte" in names and "h.1.cross.c_kv.weight" in names
    assert model.layout.size == model.num_params()
    shapes = EncoderDecoder.shapes(s2s_cfg())
    assert shapes == {k: v.shape for k, v in model.params.items()}


@pytest.mark.parametrize("changes,message", [
    ({"positions": "rope"}, "learned positions"),
    ({"attn_impl": "flash"}, "dense"),
    ({"arch": "gpt", "n_enc_layer": 2}, "encoder-decoder option"),
    ({"pad_id": 13}, "outside the vocabulary"),
])
def test_config_refuses_what_the_encoder_decoder_cannot_do(changes, message):
    with pytest.raises(ConfigError, match=message):
        s2s_cfg(**changes)


def cross_backward_without_the_value_path(self, dout):
    """Cross-attention's backward with dm missing its dv term."""
    dx, dm = CrossAttention_backward(self, dout)
    split = self.n_head * self.d_qk
    W = self.c_kv.params["weight"]
    qs, k, v, att, y = self.cache
    B, H, Tq, _ = qs.shape
    dy = (dout @ self.c_proj.params["weight"].T).reshape(B, Tq, H, self.d_v).transpose(0, 2, 1, 3)
    dv = att.transpose(0, 1, 3, 2) @ dy
    dv_flat = dv.transpose(0, 2, 1, 3).reshape(B, -1, H * self.d_v)
    return dx, dm - dv_flat @ W[:, split:].T


CrossAttention_backward = CrossAttention.backward


def test_a_cross_attention_backward_missing_a_path_fails_the_check(monkeypatch):
    monkeypatch.setattr(CrossAttention, "backward", cross_backward_without_the_value_path)
    rng = np.random.default_rng(0)
    layer = "cross-attention [Tq=5, Tk=7, padded key]"
    case = next(c for c in gradcheck.cases(rng) if c.layer == layer)
    rows = {r.tensor: r for r in gradcheck.check_case(case, rng)}
    assert not rows["m (memory)"].passed
    assert rows["x (input)"].passed          # the decoder's side is untouched
