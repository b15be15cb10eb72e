"""The plain twin of attention with linear biases: a loop over heads, the bias written out
(alibi.py states the method). The engine's layer (any kernel) must equal it."""
from __future__ import annotations

import numpy as np

from ...reference import linear_backward, linear_forward, softmax
from .alibi import slopes


def alibi_attention_forward(x, w_attn, b_attn, w_proj, b_proj, n_head, d_qk, window=None):
    """For each head h: q_h, k_h, v_h = columns of x w_attn + b_attn;
    S_h[i, j] = q_h[i] . k_h[j] / sqrt(Dk) - m_h (i - j), keys after i (or ``window`` or more
    positions back) masked to -inf; P_h = softmax(S_h); y = concat_h(P_h v_h) w_proj + b_proj.
    x (B, T, C); w_attn (C, H (2 Dk + Dv)) ordered [all q | all k | all v], each head-major."""
    B, T, _ = x.shape
    H, Dk = n_head, d_qk
    m = slopes(H)
    qkv, qkv_cache = linear_forward(x, w_attn, b_attn)
    Dv = (qkv.shape[-1] - 2 * H * Dk) // H
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    hidden = j > i
    if window is not None:
        hidden |= j <= i - window
    heads, per_head = [], []
    for h in range(H):
        q = qkv[..., h * Dk:(h + 1) * Dk]
        k = qkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk]
        v = qkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv]
        S = q @ k.transpose(0, 2, 1) / np.sqrt(Dk) - m[h] * (i - j)   # (B, T, T): the linear bias
        S = np.where(hidden, -np.inf, S)
        P = softmax(S)
        heads.append(P @ v)
        per_head.append((q, k, v, P))
    y, proj_cache = linear_forward(np.concatenate(heads, axis=-1), w_proj, b_proj)
    return y, (qkv_cache, proj_cache, per_head, H, Dk, Dv)


def alibi_attention_backward(dy, cache):
    """The standard closed form, per head: the bias is a constant of the positions, so dS is
    what it is without it. dv = P^T dy_h; dP = dy_h v^T; dS = P (dP - rowsum(dP P));
    dq = dS k / sqrt(Dk); dk = dS^T q / sqrt(Dk). Returns dx, dw_attn, db_attn, dw_proj, db_proj."""
    qkv_cache, proj_cache, per_head, H, Dk, Dv = cache
    dy_cat, dw_proj, db_proj = linear_backward(dy, proj_cache)
    x = qkv_cache[0]
    dqkv = np.zeros(x.shape[:-1] + (H * (2 * Dk + Dv),), dy.dtype)
    for h, (q, k, v, P) in enumerate(per_head):
        dy_h = dy_cat[..., h * Dv:(h + 1) * Dv]
        dv = P.transpose(0, 2, 1) @ dy_h
        dP = dy_h @ v.transpose(0, 2, 1)
        dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
        dqkv[..., h * Dk:(h + 1) * Dk] = dS @ k / np.sqrt(Dk)
        dqkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk] = dS.transpose(0, 2, 1) @ q / np.sqrt(Dk)
        dqkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv] = dv
    dx, dw_attn, db_attn = linear_backward(dqkv, qkv_cache)
    return dx, dw_attn, db_attn, dw_proj, db_proj


def alibi_attention_decode(x_t, t, cache, w_attn, b_attn, w_proj, b_proj, n_head, d_qk, window=None):
    """One new token at position ``t`` through the layer with a growing cache of every earlier
    position's key and value (a plain loop; ``window``: read only the last that many).
    cache: {"k": [H arrays (B, t, Dk)], "v": [H arrays (B, t, Dv)]}, extended here. Returns (B, 1, C)."""
    H, Dk = n_head, d_qk
    m = slopes(H)
    qkv, _ = linear_forward(x_t, w_attn, b_attn)
    Dv = (qkv.shape[-1] - 2 * H * Dk) // H
    heads = []
    for h in range(H):
        q = qkv[..., h * Dk:(h + 1) * Dk]
        cache["k"][h] = np.concatenate([cache["k"][h], qkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk]], axis=1)
        cache["v"][h] = np.concatenate([cache["v"][h], qkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv]], axis=1)
        j = np.arange(t + 1)
        first = 0 if window is None else max(0, t + 1 - window)
        s = q @ cache["k"][h].transpose(0, 2, 1) / np.sqrt(Dk) - m[h] * (t - j)     # (B, 1, t+1)
        s = s[..., first:]
        heads.append(softmax(s) @ cache["v"][h][:, first:])
    y, _ = linear_forward(np.concatenate(heads, axis=-1), w_proj, b_proj)
    return y
