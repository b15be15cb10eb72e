"""The variants written the plain way, as reference.py writes the core layers: loops where the
papers have sums, every intermediate named, no buffer reused. Nothing here is used for
training; the tests hold the fast code to these in float64 (tests/test_twins.py).

- dropout on the attention weights;
- a pre-LN sublayer, forward and backward (the Attention Residuals twin's and the
  encoder-decoder twin's).

Shapes as in reference.py; N = B T rows. The designs of ``designs/`` keep their twins in their
folders (``designs/mta/twin.py``, ``designs/encdec/twin.py``, ...).
"""
from __future__ import annotations

import numpy as np

from .reference import (attention_backward, attention_forward, layernorm_backward, layernorm_forward,
                        linear_backward, linear_forward, mlp_backward, mlp_forward, softmax)


# --- dropout (Srivastava et al. 2014; GPT-2's placement) --------------------------------------


def dropout_attention_forward(x, w_attn, b_attn, w_proj, b_proj, n_head, d_qk, masks):
    """Causal attention with dropout on its weights, head by head: P_h = softmax(S_h), the
    weights dropped, y_h = (P_h * M_h) v_h. ``masks`` (B, H, T, T) of 0 and 1/(1 - p), the masks
    the layer drew. Returns y and what the backward needs."""
    B, T, _ = x.shape
    H, Dk = n_head, d_qk
    qkv, qkv_cache = linear_forward(x, w_attn, b_attn)
    Dv = (qkv.shape[-1] - 2 * H * Dk) // H
    future = np.triu(np.ones((T, T), bool), k=1)
    heads, per_head = [], []
    for h in range(H):
        q = qkv[..., h * Dk:(h + 1) * Dk]
        k = qkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk]
        v = qkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv]
        P = softmax(np.where(future, -np.inf, q @ k.transpose(0, 2, 1) / np.sqrt(Dk)))
        M = masks[:, h]
        heads.append((P * M) @ v)
        per_head.append((q, k, v, P, M))
    y, proj_cache = linear_forward(np.concatenate(heads, axis=-1), w_proj, b_proj)
    return y, (qkv_cache, proj_cache, per_head, H, Dk, Dv)


def dropout_attention_backward(dy, cache):
    """dv = (P * M)^T dy_h;  dP = (dy_h v^T) * M;  dS = P * (dP - rowsum(dP * P));
    dq = dS k / sqrt(Dk);  dk = dS^T q / sqrt(Dk). Returns dx, dw_attn, db_attn, dw_proj, db_proj."""
    qkv_cache, proj_cache, per_head, H, Dk, Dv = cache
    dy_cat, dw_proj, db_proj = linear_backward(dy, proj_cache)
    x = qkv_cache[0]
    dqkv = np.zeros(x.shape[:-1] + (H * (2 * Dk + Dv),), dy.dtype)
    for h, (q, k, v, P, M) in enumerate(per_head):
        dy_h = dy_cat[..., h * Dv:(h + 1) * Dv]
        dP = (dy_h @ v.transpose(0, 2, 1)) * M
        dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
        dqkv[..., h * Dk:(h + 1) * Dk] = dS @ k / np.sqrt(Dk)
        dqkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk] = dS.transpose(0, 2, 1) @ q / np.sqrt(Dk)
        dqkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv] = (P * M).transpose(0, 2, 1) @ dy_h
    dx, dw_attn, db_attn = linear_backward(dqkv, qkv_cache)
    return dx, dw_attn, db_attn, dw_proj, db_proj


# --- a pre-LN sublayer, as the Attention Residuals and encoder-decoder twins read it -----------


def sublayer_forward(P, h, i, kind, x, cfg):
    """Sublayer ``kind`` ("attn": causal self-attention, or "mlp") of the block whose parameters
    start with ``h`` on its input x: f(norm(x)), with caches."""
    norm = "ln_1" if kind == "attn" else "ln_2"
    a, ln = layernorm_forward(x, P[f"{h}{norm}.weight"], P.get(f"{h}{norm}.bias"), cfg.ln_eps)
    if kind == "attn":
        y, c = attention_forward(a, P[h + "attn.c_attn.weight"], P.get(h + "attn.c_attn.bias"),
                                 P[h + "attn.c_proj.weight"], P.get(h + "attn.c_proj.bias"), cfg.n_head, cfg.d_qk)
    else:
        y, c = mlp_forward(a, P[h + "mlp.c_fc.weight"], P.get(h + "mlp.c_fc.bias"), P[h + "mlp.c_proj.weight"],
                           P.get(h + "mlp.c_proj.bias"), cfg.activation)
    return y, (ln, c)


def sublayer_backward(dy, cache, h, kind, grads):
    ln, c = cache
    norm = "ln_1" if kind == "attn" else "ln_2"
    if kind == "attn":
        da, *g = attention_backward(dy, c)
        names = ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias")
    else:
        da, *g = mlp_backward(dy, c)
        names = ("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")
    for name, gi in zip(names, g):
        grads[h + name] = gi
    dx, grads[f"{h}{norm}.weight"], grads[f"{h}{norm}.bias"] = layernorm_backward(da, ln)
    return dx
