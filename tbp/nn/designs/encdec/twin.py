"""The encoder-decoder written the plain way (as reference.py and reference_variants.py write
the layers and the other variants): the whole model's loss and every gradient, one block and
one sublayer at a time. The tests hold EncoderDecoder to it in float64 (tests/test_twins.py)."""
from __future__ import annotations

import numpy as np

from ...reference import (cross_attention_backward, cross_attention_forward, embedding_backward, embedding_forward,
                        head_loss_and_backward, layernorm_backward, layernorm_forward)
from ...reference_variants import sublayer_backward, sublayer_forward


# --- the encoder-decoder (Vaswani et al. 2017, Figure 1, pre-LN) -------------------------------


def _encoder_attention(P, h, a, cfg, pad):
    """The encoder's self-attention of block ``h`` on a: non-causal, padded keys masked. It is
    cross-attention of a to itself ([q | k | v] split into c_q = [q] and c_kv = [k | v]): the
    same equations."""
    H, Dk = cfg.n_head, cfg.d_qk
    w, b = P[h + "attn.c_attn.weight"], P.get(h + "attn.c_attn.bias")
    return cross_attention_forward(a, a, w[:, :H * Dk], None if b is None else b[:H * Dk], w[:, H * Dk:],
                                   None if b is None else b[H * Dk:], P[h + "attn.c_proj.weight"],
                                   P.get(h + "attn.c_proj.bias"), H, Dk, pad)


def _encoder_attention_backward(dy, cache, h, grads):
    """The input's gradient, both paths summed (a asked and answered); the gradients into ``grads``."""
    dx, dm, dw_q, db_q, dw_kv, db_kv, dw_proj, db_proj = cross_attention_backward(dy, cache)
    grads[h + "attn.c_attn.weight"] = np.concatenate([dw_q, dw_kv], axis=1)
    grads[h + "attn.c_attn.bias"] = None if db_q is None else np.concatenate([db_q, db_kv])
    grads[h + "attn.c_proj.weight"], grads[h + "attn.c_proj.bias"] = dw_proj, db_proj
    return dx + dm


def encoder_decoder_loss_and_grads(P: dict, cfg, src, tgt_in, tgt_out):
    """The encoder-decoder's loss and every gradient. Encoder: embeddings (``enc.wte``,
    ``enc.wpe``), n_enc_layer pre-LN blocks of non-causal self-attention that no position may
    read a padded source key through, ``enc.ln_f``: the memory m. Decoder: embeddings, blocks
    x = x + attn(ln_1(x)); x = x + cross(ln_cross(x), m); x = x + mlp(ln_2(x)), ln_f and the
    head. The loss is the mean cross-entropy over targets that are not padding. Every decoder
    layer reads m, so m's gradient is the sum of their cross-attentions' dm. The causal
    attention and the MLPs are Attention Residuals' twin's sublayers (reference_variants)."""
    pad = src == cfg.pad_id if cfg.pad_id is not None else None
    grads: dict = {}
    x, enc_emb = embedding_forward(src, P["enc.wte"], P["enc.wpe"])
    enc = []
    for i in range(cfg.n_enc_layer):
        h = f"enc.h.{i}."
        a, ln1 = layernorm_forward(x, P[h + "ln_1.weight"], P.get(h + "ln_1.bias"), cfg.ln_eps)
        a, attn = _encoder_attention(P, h, a, cfg, pad)
        x = x + a
        f, mlp = sublayer_forward(P, h, i, "mlp", x, cfg)
        x = x + f
        enc.append((ln1, attn, mlp))
    m, enc_lnf = layernorm_forward(x, P["enc.ln_f.weight"], P.get("enc.ln_f.bias"), cfg.ln_eps)
    y, dec_emb = embedding_forward(tgt_in, P["wte"], P["wpe"])
    dec = []
    for i in range(cfg.n_layer):
        h = f"h.{i}."
        a, attn = sublayer_forward(P, h, i, "attn", y, cfg)
        y = y + a
        c, lnc = layernorm_forward(y, P[h + "ln_cross.weight"], P.get(h + "ln_cross.bias"), cfg.ln_eps)
        c, cross = cross_attention_forward(c, m, P[h + "cross.c_q.weight"], P.get(h + "cross.c_q.bias"),
                                           P[h + "cross.c_kv.weight"], P.get(h + "cross.c_kv.bias"),
                                           P[h + "cross.c_proj.weight"], P.get(h + "cross.c_proj.bias"),
                                           cfg.n_head, cfg.d_qk, pad)
        y = y + c
        f, mlp = sublayer_forward(P, h, i, "mlp", y, cfg)
        y = y + f
        dec.append((attn, lnc, cross, mlp))
    weights = (tgt_out != cfg.pad_id).astype(float) if cfg.pad_id is not None else None
    loss, dy = head_loss_and_backward(P, cfg, y, tgt_out, grads, weights)

    dm = np.zeros_like(m)
    for i in reversed(range(cfg.n_layer)):
        h = f"h.{i}."
        attn, lnc, cross, mlp = dec[i]
        dy = dy + sublayer_backward(dy, mlp, h, "mlp", grads)          # the residual's two paths
        dc, dm_i, *g = cross_attention_backward(dy, cross)
        for name, gi in zip(("cross.c_q.weight", "cross.c_q.bias", "cross.c_kv.weight", "cross.c_kv.bias",
                             "cross.c_proj.weight", "cross.c_proj.bias"), g):
            grads[h + name] = gi
        dm = dm + dm_i
        dln, grads[h + "ln_cross.weight"], grads[h + "ln_cross.bias"] = layernorm_backward(dc, lnc)
        dy = dy + dln
        dy = dy + sublayer_backward(dy, attn, h, "attn", grads)
    dwte, grads["wpe"] = embedding_backward(dy, dec_emb)
    grads["wte"] = grads.get("wte", 0) + dwte
    dx, grads["enc.ln_f.weight"], grads["enc.ln_f.bias"] = layernorm_backward(dm, enc_lnf)
    for i in reversed(range(cfg.n_enc_layer)):
        h = f"enc.h.{i}."
        ln1, attn, mlp = enc[i]
        dx = dx + sublayer_backward(dx, mlp, h, "mlp", grads)
        dln, grads[h + "ln_1.weight"], grads[h + "ln_1.bias"] = layernorm_backward(
            _encoder_attention_backward(dx, attn, h, grads), ln1)
        dx = dx + dln
    grads["enc.wte"], grads["enc.wpe"] = embedding_backward(dx, enc_emb)
    return loss, {key: v for key, v in grads.items() if v is not None}
