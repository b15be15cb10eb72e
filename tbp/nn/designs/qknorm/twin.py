"""The plain twin of QK-norm attention: a loop over heads, the norm written out (qknorm.py
states the method). The engine's layer (any kernel) must equal it, forward and backward."""
from __future__ import annotations

import numpy as np

from ...reference import linear_backward, linear_forward, softmax


def qknorm_attention_forward(x, w_attn, b_attn, w_proj, b_proj, n_head, d_qk, eps=1e-6, scale=None):
    """For each head h: q_h, k_h, v_h = columns of x w_attn + b_attn;
    qn = q_h / sqrt(mean(q_h^2) + eps) per row, kn likewise; S_h = scale qn kn^T (scale
    1/sqrt(Dk) when None), future keys masked to -inf; P_h = softmax(S_h);
    y = concat_h(P_h v_h) w_proj + b_proj. x (B, T, C); w_attn (C, H (2 Dk + Dv))."""
    B, T, _ = x.shape
    H, Dk = n_head, d_qk
    scale = scale or 1.0 / np.sqrt(Dk)
    qkv, qkv_cache = linear_forward(x, w_attn, b_attn)
    Dv = (qkv.shape[-1] - 2 * H * Dk) // H
    future = np.triu(np.ones((T, T), bool), k=1)
    heads, per_head = [], []
    for h in range(H):
        q = qkv[..., h * Dk:(h + 1) * Dk]
        k = qkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk]
        v = qkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv]
        rq = 1.0 / np.sqrt((q ** 2).mean(axis=-1, keepdims=True) + eps)       # (B, T, 1)
        rk = 1.0 / np.sqrt((k ** 2).mean(axis=-1, keepdims=True) + eps)
        qn, kn = q * rq, k * rk
        S = np.where(future, -np.inf, scale * qn @ kn.transpose(0, 2, 1))      # (B, T, T)
        P = softmax(S)
        heads.append(P @ v)
        per_head.append((qn, rq, kn, rk, v, P))
    y, proj_cache = linear_forward(np.concatenate(heads, axis=-1), w_proj, b_proj)
    return y, (qkv_cache, proj_cache, per_head, H, Dk, Dv, scale)


def qknorm_attention_backward(dy, cache):
    """Per head: dv = P^T dy_h; dP = dy_h v^T; dS = P (dP - rowsum(dP P));
    dqn = scale dS kn; dkn = scale dS^T qn; then through each norm, dx = r (dx_n - x_n mean(dx_n x_n)).
    Returns dx, dw_attn, db_attn, dw_proj, db_proj."""
    qkv_cache, proj_cache, per_head, H, Dk, Dv, scale = cache
    dy_cat, dw_proj, db_proj = linear_backward(dy, proj_cache)
    x = qkv_cache[0]
    dqkv = np.zeros(x.shape[:-1] + (H * (2 * Dk + Dv),), dy.dtype)
    for h, (qn, rq, kn, rk, v, P) in enumerate(per_head):
        dy_h = dy_cat[..., h * Dv:(h + 1) * Dv]
        dv = P.transpose(0, 2, 1) @ dy_h
        dP = dy_h @ v.transpose(0, 2, 1)
        dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
        dqn, dkn = scale * dS @ kn, scale * dS.transpose(0, 2, 1) @ qn
        dqkv[..., h * Dk:(h + 1) * Dk] = rq * (dqn - qn * (dqn * qn).mean(axis=-1, keepdims=True))
        dqkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk] = rk * (dkn - kn * (dkn * kn).mean(axis=-1, keepdims=True))
        dqkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv] = dv
    dx, dw_attn, db_attn = linear_backward(dqkv, qkv_cache)
    return dx, dw_attn, db_attn, dw_proj, db_proj
