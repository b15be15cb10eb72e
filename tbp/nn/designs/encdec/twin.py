"""The encoder-decoder written the plain way (as reference.py and reference_variants.py write
the layers and the other variants): the whole model's loss and every gradient, one block and
one sublayer at a time. The tests hold EncoderDecoder to it in float64 (tests/test_twins.py)."""
from __future__ import annotations

import numpy as np

from ...reference import (embedding_backward, embedding_forward, head_loss_and_backward, layernorm_backward,
                          layernorm_forward, linear_backward, linear_forward, softmax)
from ...reference_variants import sublayer_backward, sublayer_forward


# --- cross-attention (Vaswani et al. 2017, §3.2.3) ---------------------------------------------


def cross_attention_forward(x, m, w_q, b_q, w_kv, b_kv, w_proj, b_proj, n_head, d_qk, pad=None):
    """For each head h:  q_h = columns of x w_q + b_q (the decoder asks);  k_h, v_h = columns
    of m w_kv + b_kv (the encoder's output answers);  S_h = q_h k_h^T / sqrt(Dk), padded source
    keys masked to -inf (no causal mask);  y_h = softmax(S_h) v_h;  y = concat_h(y_h) w_proj + b_proj.
    x (B, Tq, C); m (B, Tk, C); pad (B, Tk) bool or None; w_kv (C, H (Dk + Dv)) ordered
    [all k | all v], each head-major.   [Vaswani et al. 2017, §3.2.3]"""
    H, Dk = n_head, d_qk
    q_all, q_cache = linear_forward(x, w_q, b_q)
    kv, kv_cache = linear_forward(m, w_kv, b_kv)
    Dv = (kv.shape[-1] - H * Dk) // H
    heads, per_head = [], []
    for h in range(H):
        q = q_all[..., h * Dk:(h + 1) * Dk]                             # (B, Tq, Dk)
        k = kv[..., h * Dk:(h + 1) * Dk]                                # (B, Tk, Dk)
        v = kv[..., H * Dk + h * Dv:H * Dk + (h + 1) * Dv]              # (B, Tk, Dv)
        S = q @ k.transpose(0, 2, 1) / np.sqrt(Dk)                     # (B, Tq, Tk)
        if pad is not None:
            S = np.where(pad[:, None, :], -np.inf, S)
        P = softmax(S)
        heads.append(P @ v)
        per_head.append((q, k, v, P))
    y, proj_cache = linear_forward(np.concatenate(heads, axis=-1), w_proj, b_proj)
    return y, (q_cache, kv_cache, proj_cache, per_head, H, Dk, Dv)


def cross_attention_backward(dy, cache):
    """Per head, as self-attention's (dv = P^T dy_h, dS = P * (dP - rowsum(dP * P)),
    dq = dS k / sqrt(Dk), dk = dS^T q / sqrt(Dk)), except that dq goes to the decoder's x and
    dk, dv to the encoder's m.  Returns dx, dm, dw_q, db_q, dw_kv, db_kv, dw_proj, db_proj."""
    q_cache, kv_cache, proj_cache, per_head, H, Dk, Dv = cache
    dy_cat, dw_proj, db_proj = linear_backward(dy, proj_cache)
    dq_all = np.zeros(q_cache[0].shape[:-1] + (H * Dk,), dy.dtype)
    dkv = np.zeros(kv_cache[0].shape[:-1] + (H * (Dk + Dv),), dy.dtype)
    for h, (q, k, v, P) in enumerate(per_head):
        dy_h = dy_cat[..., h * Dv:(h + 1) * Dv]                       # (B, Tq, Dv)
        dv = P.transpose(0, 2, 1) @ dy_h
        dP = dy_h @ v.transpose(0, 2, 1)
        dS = P * (dP - (dP * P).sum(-1, keepdims=True))
        dq_all[..., h * Dk:(h + 1) * Dk] = dS @ k / np.sqrt(Dk)
        dkv[..., h * Dk:(h + 1) * Dk] = dS.transpose(0, 2, 1) @ q / np.sqrt(Dk)
        dkv[..., H * Dk + h * Dv:H * Dk + (h + 1) * Dv] = dv
    dx, dw_q, db_q = linear_backward(dq_all, q_cache)
    dm, dw_kv, db_kv = linear_backward(dkv, kv_cache)
    return dx, dm, dw_q, db_q, dw_kv, db_kv, dw_proj, db_proj


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
    pad_id = cfg.designs["encoder-decoder"].pad_id
    pad = src == pad_id if pad_id is not None else None
    grads: dict = {}
    x, enc_emb = embedding_forward(src, P["enc.wte"], P["enc.wpe"])
    enc = []
    for i in range(cfg.designs["encoder-decoder"].n_enc_layer):
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
    weights = (tgt_out != pad_id).astype(float) if pad_id is not None else None
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
    for i in reversed(range(cfg.designs["encoder-decoder"].n_enc_layer)):
        h = f"enc.h.{i}."
        ln1, attn, mlp = enc[i]
        dx = dx + sublayer_backward(dx, mlp, h, "mlp", grads)
        dln, grads[h + "ln_1.weight"], grads[h + "ln_1.bias"] = layernorm_backward(
            _encoder_attention_backward(dx, attn, h, grads), ln1)
        dx = dx + dln
    grads["enc.wte"], grads["enc.wpe"] = embedding_backward(dx, enc_emb)
    return loss, {key: v for key, v in grads.items() if v is not None}
