"""Multi-Token Attention written the plain way, as reference.py writes the core layers: its
convolution one entry at a time (``mta_conv``), and the whole layer -- key-query convolution,
head mixing, softmax, the post-softmax convolution, head-group mixing, the norm and gate --
forward only: its gradients are the fast backward's, which gradcheck holds to this forward's
derivative. Nothing here trains; tests/test_twins.py holds the layer to it in float64.
"""
from __future__ import annotations

import numpy as np

from ...reference import linear_forward, softmax


def mta_conv(X, theta):
    """Multi-Token Attention's key-query convolution, one entry at a time:
    Z[b, h, i, j] = sum_{a < cq, c < ck} theta[h, a, c] X[b, h, i - (cq-1) + a, j - p + c], p = (ck-1)/2,
    the terms outside X left out.   X (B, H, Tq, Tk); theta (H, cq, ck)."""
    B, H, Tq, Tk = X.shape
    _, cq, ck = theta.shape
    p = (ck - 1) // 2
    Z = np.zeros_like(X)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                for j in range(Tk):
                    for a in range(cq):
                        for c in range(ck):
                            r, k = i - (cq - 1) + a, j - p + c
                            if 0 <= r < Tq and 0 <= k < Tk:
                                Z[b, h, i, j] += theta[h, a, c] * X[b, h, r, k]
    return Z


def mta_attention_forward(x, P: dict, n_head, d_qk, conv=True, post=False, mix=False, group=0, norm=False,
                          eps=1e-5, layer=None):
    """One MTA layer, causal. P: c_attn.weight/.bias, c_proj.weight/.bias and the MTA parameters
    theta (H, cq, ck), theta_post, mix (H, H), group_mix (H/g, g, g), norm_gain, gate_weight (Dv,),
    gate_bias (1,), under the names MultiTokenAttention gives them (``mta.`` dropped).

    S = q k^T / sqrt(Dk);  S0 = S with the future set to 0;  Z = conv(S0, theta) (or S);
    Z'_h = sum_g mix[h, g] Z_g;  A = softmax(Z' + future -inf);  A' = C conv(A, theta_post);
    A''_{k,o} = sum_p group_mix[k, p, o] A'_{k,p} in each group k of g heads;  O_h = A''_h v_h;
    norm: n = g * O / rms(O), O = n sigmoid(n . w + b), and with ``layer`` (the depth scale, the
    0-based layer l) O = (1 - lambda(l)) n sigmoid(n . w + b), lambda(l) = 0.8 - 0.6 exp(-0.3 l).
    y = concat_h(O_h) w_proj + b_proj."""
    B, T, _ = x.shape
    H, Dk = n_head, d_qk
    qkv, _ = linear_forward(x, P["c_attn.weight"], P.get("c_attn.bias"))
    Dv = (qkv.shape[-1] - 2 * H * Dk) // H
    future = np.triu(np.ones((T, T), bool), k=1)
    q = [qkv[..., h * Dk:(h + 1) * Dk] for h in range(H)]
    k = [qkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk] for h in range(H)]
    v = [qkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv] for h in range(H)]
    S = np.stack([q[h] @ k[h].transpose(0, 2, 1) / np.sqrt(Dk) for h in range(H)], axis=1)   # (B, H, T, T)
    Z = mta_conv(np.where(future, 0.0, S), P["theta"]) if conv else S
    if mix:
        Z = np.stack([sum(P["mix"][h, g] * Z[:, g] for g in range(H)) for h in range(H)], axis=1)
    A = softmax(np.where(future, -np.inf, Z))
    if post:
        A = np.where(future, 0.0, mta_conv(A, P["theta_post"]))
    if group:
        mixed = np.zeros_like(A)
        for kk in range(H // group):
            for o in range(group):
                for p in range(group):
                    mixed[:, kk * group + o] += P["group_mix"][kk, p, o] * A[:, kk * group + p]
        A = mixed
    heads = []
    for h in range(H):
        O = A[:, h] @ v[h]                                              # (B, T, Dv)
        if norm:
            n = O / np.sqrt(np.mean(O ** 2, axis=-1, keepdims=True) + eps) * P["norm_gain"]
            s = 1 / (1 + np.exp(-(n @ P["gate_weight"] + P["gate_bias"][0])))
            O = n * s[..., None]
            if layer is not None:
                O = O * (1 - (0.8 - 0.6 * np.exp(-0.3 * layer)))
        heads.append(O)
    y, _ = linear_forward(np.concatenate(heads, axis=-1), P["c_proj.weight"], P.get("c_proj.bias"))
    return y
