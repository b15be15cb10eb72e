"""The encoder-decoder written the plain way (as reference.py and reference_variants.py write
the layers and the other variants): the whole model's loss and every gradient, one block and
one sublayer at a time. The tests hold EncoderDecoder to it in float64 (tests/test_twins.py)."""
from __future__ import annotations

import numpy as np

from .reference import (attention_backward, attention_forward, cross_attention_backward, cross_attention_forward,
                        embedding_backward, embedding_forward, layernorm_backward, layernorm_forward, mlp_backward,
                        mlp_forward)
from .reference_variants import head_loss_and_backward


# --- the encoder-decoder (Vaswani et al. 2017, Figure 1, pre-LN) -------------------------------


def _self_attention(P, h, a, cfg, causal, pad):
    """Self-attention of block ``h`` on a. Non-causal with padded keys is cross-attention of a
    to itself ([q | k | v] split into c_q = [q] and c_kv = [k | v]): the same equations."""
    H, Dk = cfg.n_head, cfg.d_qk
    w, b = P[h + "attn.c_attn.weight"], P.get(h + "attn.c_attn.bias")
    if causal:
        y, c = attention_forward(a, w, b, P[h + "attn.c_proj.weight"], P.get(h + "attn.c_proj.bias"), H, Dk)
        return y, ("causal", c)
    y, c = cross_attention_forward(a, a, w[:, :H * Dk], None if b is None else b[:H * Dk], w[:, H * Dk:],
                                   None if b is None else b[H * Dk:], P[h + "attn.c_proj.weight"],
                                   P.get(h + "attn.c_proj.bias"), H, Dk, pad)
    return y, ("self-cross", c)


def _self_attention_backward(dy, cache):
    """(da, dw_attn, db_attn, dw_proj, db_proj): the self-cross form sums both paths into a."""
    form, c = cache
    if form == "causal":
        return attention_backward(dy, c)
    dx, dm, dw_q, db_q, dw_kv, db_kv, dw_proj, db_proj = cross_attention_backward(dy, c)
    db = None if db_q is None else np.concatenate([db_q, db_kv])
    return dx + dm, np.concatenate([dw_q, dw_kv], axis=1), db, dw_proj, db_proj


def encoder_decoder_loss_and_grads(P: dict, cfg, src, tgt_in, tgt_out):
    """The encoder-decoder's loss and every gradient. Encoder: embeddings (``enc.wte``,
    ``enc.wpe``), n_enc_layer pre-LN blocks of non-causal self-attention that no position may
    read a padded source key through, ``enc.ln_f``: the memory m. Decoder: embeddings, blocks
    x = x + attn(ln_1(x)); x = x + cross(ln_cross(x), m); x = x + mlp(ln_2(x)), ln_f and the
    head. The loss is the mean cross-entropy over targets that are not padding. Every decoder
    layer reads m, so m's gradient is the sum of their cross-attentions' dm."""
    pad = src == cfg.pad_id if cfg.pad_id is not None else None
    grads: dict = {}
    x, enc_emb = embedding_forward(src, P["enc.wte"], P["enc.wpe"])
    enc = []
    for i in range(cfg.n_enc_layer):
        h = f"enc.h.{i}."
        a, ln1 = layernorm_forward(x, P[h + "ln_1.weight"], P.get(h + "ln_1.bias"), cfg.ln_eps)
        a, attn = _self_attention(P, h, a, cfg, False, pad)
        x = x + a
        f, ln2 = layernorm_forward(x, P[h + "ln_2.weight"], P.get(h + "ln_2.bias"), cfg.ln_eps)
        f, mlp = mlp_forward(f, P[h + "mlp.c_fc.weight"], P.get(h + "mlp.c_fc.bias"), P[h + "mlp.c_proj.weight"],
                             P.get(h + "mlp.c_proj.bias"), cfg.activation)
        x = x + f
        enc.append((ln1, attn, ln2, mlp))
    m, enc_lnf = layernorm_forward(x, P["enc.ln_f.weight"], P.get("enc.ln_f.bias"), cfg.ln_eps)
    y, dec_emb = embedding_forward(tgt_in, P["wte"], P["wpe"])
    dec = []
    for i in range(cfg.n_layer):
        h = f"h.{i}."
        a, ln1 = layernorm_forward(y, P[h + "ln_1.weight"], P.get(h + "ln_1.bias"), cfg.ln_eps)
        a, attn = _self_attention(P, h, a, cfg, True, None)
        y = y + a
        c, lnc = layernorm_forward(y, P[h + "ln_cross.weight"], P.get(h + "ln_cross.bias"), cfg.ln_eps)
        c, cross = cross_attention_forward(c, m, P[h + "cross.c_q.weight"], P.get(h + "cross.c_q.bias"),
                                           P[h + "cross.c_kv.weight"], P.get(h + "cross.c_kv.bias"),
                                           P[h + "cross.c_proj.weight"], P.get(h + "cross.c_proj.bias"),
                                           cfg.n_head, cfg.d_qk, pad)
        y = y + c
        f, ln2 = layernorm_forward(y, P[h + "ln_2.weight"], P.get(h + "ln_2.bias"), cfg.ln_eps)
        f, mlp = mlp_forward(f, P[h + "mlp.c_fc.weight"], P.get(h + "mlp.c_fc.bias"), P[h + "mlp.c_proj.weight"],
                             P.get(h + "mlp.c_proj.bias"), cfg.activation)
        y = y + f
        dec.append((ln1, attn, lnc, cross, ln2, mlp))
    weights = (tgt_out != cfg.pad_id).astype(float) if cfg.pad_id is not None else None
    loss, dy = head_loss_and_backward(P, cfg, y, tgt_out, grads, weights)

    dm = np.zeros_like(m)
    for i in reversed(range(cfg.n_layer)):
        h = f"h.{i}."
        ln1, attn, lnc, cross, ln2, mlp = dec[i]
        df, *g = mlp_backward(dy, mlp)
        for name, gi in zip(("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"), g):
            grads[h + name] = gi
        dln, grads[h + "ln_2.weight"], grads[h + "ln_2.bias"] = layernorm_backward(df, ln2)
        dy = dy + dln
        dc, dm_i, *g = cross_attention_backward(dy, cross)
        for name, gi in zip(("cross.c_q.weight", "cross.c_q.bias", "cross.c_kv.weight", "cross.c_kv.bias",
                             "cross.c_proj.weight", "cross.c_proj.bias"), g):
            grads[h + name] = gi
        dm = dm + dm_i
        dln, grads[h + "ln_cross.weight"], grads[h + "ln_cross.bias"] = layernorm_backward(dc, lnc)
        dy = dy + dln
        da, *g = _self_attention_backward(dy, attn)
        for name, gi in zip(("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias"), g):
            grads[h + name] = gi
        dln, grads[h + "ln_1.weight"], grads[h + "ln_1.bias"] = layernorm_backward(da, ln1)
        dy = dy + dln
    dwte, grads["wpe"] = embedding_backward(dy, dec_emb)
    grads["wte"] = grads.get("wte", 0) + dwte
    dx, grads["enc.ln_f.weight"], grads["enc.ln_f.bias"] = layernorm_backward(dm, enc_lnf)
    for i in reversed(range(cfg.n_enc_layer)):
        h = f"enc.h.{i}."
        ln1, attn, ln2, mlp = enc[i]
        df, *g = mlp_backward(dx, mlp)
        for name, gi in zip(("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"), g):
            grads[h + name] = gi
        dln, grads[h + "ln_2.weight"], grads[h + "ln_2.bias"] = layernorm_backward(df, ln2)
        dx = dx + dln
        da, *g = _self_attention_backward(dx, attn)
        for name, gi in zip(("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias"), g):
            grads[h + name] = gi
        dln, grads[h + "ln_1.weight"], grads[h + "ln_1.bias"] = layernorm_backward(da, ln1)
        dx = dx + dln
    grads["enc.wte"], grads["enc.wpe"] = embedding_backward(dx, enc_emb)
    return loss, {key: v for key, v in grads.items() if v is not None}
