"""The plain twin of grouped-query attention: a loop over query heads, each reading its group's
key/value head, the shared heads' gradients summed over their readers (gqa.py states the method).
The engine's layer must equal it."""
from __future__ import annotations

import numpy as np

from ...reference import linear_backward, linear_forward, softmax


def gqa_attention_forward(x, w_attn, b_attn, w_proj, b_proj, n_head, n_kv_head, d_qk, causal=True, rotate=None):
    """For each query head h, with j = h // (H / Hkv) its key/value head:
    S_h = q_h k_j^T / sqrt(Dk), future keys masked;  y_h = softmax(S_h) v_j;
    y = concat_h(y_h) w_proj + b_proj.  w_attn (C, H Dk + Hkv (Dk + Dv)): [all q | Hkv k | Hkv v].
    ``rotate`` (rotation, its transpose) turns q and k by their positions, as in the core's twin
    ``reference.attention_forward`` (rotary positions: ``designs/rope/twin.rotation``)."""
    H, G, Dk = n_head, n_head // n_kv_head, d_qk
    T = x.shape[1]
    qkv, qkv_cache = linear_forward(x, w_attn, b_attn)
    Dv = (qkv.shape[-1] - (H + n_kv_head) * Dk) // n_kv_head
    k_at, v_at = H * Dk, (H + n_kv_head) * Dk
    future = np.triu(np.ones((T, T), bool), k=1)
    heads, per_head = [], []
    for h in range(H):
        j = h // G
        q = qkv[..., h * Dk:(h + 1) * Dk]
        k = qkv[..., k_at + j * Dk:k_at + (j + 1) * Dk]
        v = qkv[..., v_at + j * Dv:v_at + (j + 1) * Dv]
        if rotate is not None:
            q, k = rotate[0](q), rotate[0](k)
        S = q @ k.transpose(0, 2, 1) / np.sqrt(Dk)
        if causal:
            S = np.where(future, -np.inf, S)
        P = softmax(S)
        heads.append(P @ v)
        per_head.append((q, k, v, P))
    y, proj_cache = linear_forward(np.concatenate(heads, axis=-1), w_proj, b_proj)
    return y, (qkv_cache, proj_cache, per_head, H, n_kv_head, Dk, Dv, rotate)


def gqa_attention_backward(dy, cache):
    """Per query head, standard attention's backward (dv = P^T dy_h, dS = P * (dP - rowsum(dP P)),
    dq = dS k / sqrt(Dk), dk = dS^T q / sqrt(Dk)); a shared key/value head sums the dk and dv
    of every query head that read it.  Returns dx, dw_attn, db_attn, dw_proj, db_proj."""
    qkv_cache, proj_cache, per_head, H, Hkv, Dk, Dv, rotate = cache
    G = H // Hkv
    dy_cat, dw_proj, db_proj = linear_backward(dy, proj_cache)
    x = qkv_cache[0]
    dqkv = np.zeros(x.shape[:-1] + ((H + Hkv) * Dk + Hkv * Dv,), dy.dtype)
    k_at, v_at = H * Dk, (H + Hkv) * Dk
    for h, (q, k, v, P) in enumerate(per_head):
        j = h // G
        dy_h = dy_cat[..., h * Dv:(h + 1) * Dv]
        dv = P.transpose(0, 2, 1) @ dy_h
        dP = dy_h @ v.transpose(0, 2, 1)
        dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
        dq = dS @ k / np.sqrt(Dk)
        dk = dS.transpose(0, 2, 1) @ q / np.sqrt(Dk)
        if rotate is not None:
            dq, dk = rotate[1](dq), rotate[1](dk)
        dqkv[..., h * Dk:(h + 1) * Dk] = dq
        dqkv[..., k_at + j * Dk:k_at + (j + 1) * Dk] += dk
        dqkv[..., v_at + j * Dv:v_at + (j + 1) * Dv] += dv
    dx, dw_attn, db_attn = linear_backward(dqkv, qkv_cache)
    return dx, dw_attn, db_attn, dw_proj, db_proj
