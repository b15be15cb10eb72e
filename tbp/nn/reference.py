"""Every layer written the plain way: the paper's equations, one name per quantity.

The fast layers (embedding.py, linear.py, ...) fold axes, work in place and reuse buffers,
because a CPU step is bound by memory traffic and by the number of NumPy calls; that hides
the math. This module states it: each layer is a pair of functions,
``X_forward(inputs, params) -> (out, cache)`` and ``X_backward(dout, cache) -> gradients``,
with loops over heads where the paper has them and no trick anywhere. Nothing here is used
for training; the tests prove the fast layers equal these, forward and backward, in float64.

Shapes: B batch, T time, C channels, H heads, Dk query/key width, Dv value width, V vocab.
"""
from __future__ import annotations

import numpy as np

# --- §2 embedding ----------------------------------------------------------------------------


def embedding_forward(idx, wte, wpe=None):
    """x[b, t] = wte[idx[b, t]] + wpe[t] (no wpe with rotary positions).   idx (B, T) -> x (B, T, C)"""
    T = idx.shape[1]
    x = wte[idx] + (wpe[np.arange(T)] if wpe is not None else 0)                   # eq. (2.1)
    return x, (idx, wte.shape, None if wpe is None else wpe.shape)


def embedding_backward(dx, cache):
    """dwte[v] = sum of dx over the positions holding token v; dwpe[t] = sum_b dx[b, t]."""
    idx, wte_shape, wpe_shape = cache
    dwte = np.zeros(wte_shape, dx.dtype)
    np.add.at(dwte, idx, dx)                           # eq. (2.2): a repeated token accumulates
    if wpe_shape is None:
        return dwte, None
    dwpe = np.zeros(wpe_shape, dx.dtype)
    dwpe[:idx.shape[1]] = dx.sum(axis=0)               # eq. (2.2)
    return dwte, dwpe


# --- the fully connected layer, and LoRA (§6) -------------------------------------------------


def linear_forward(x, w, b=None):
    """y = x w + b.   x (..., in), w (in, out), b (out,) -> y (..., out)"""
    y = x @ w
    if b is not None:
        y = y + b
    return y, (x, w, b is not None)


def linear_backward(dy, cache):
    """dx = dy w^T;  dw = sum over tokens of x^T dy;  db = sum over tokens of dy."""
    x, w, has_bias = cache
    dx = dy @ w.T
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dw = x2.T @ dy2
    db = dy2.sum(axis=0) if has_bias else None
    return dx, dw, db


def lora_forward(x, w, b, down, up, scale):
    """y = x w + b + scale * (x down) up.   down (in, R), up (R, out); w and b frozen."""
    h = x @ down                                       # (..., R)   eq. (6.1)
    y, _ = linear_forward(x, w, b)                     # eq. (6.1)
    y = y + scale * (h @ up)                           # eq. (6.1)
    return y, (x, w, down, up, h, scale)


def lora_backward(dy, cache):
    """dup = scale h^T dy;  ddown = scale x^T (dy up^T);  dx = dy w^T + scale (dy up^T) down^T."""
    x, w, down, up, h, scale = cache
    x2, dy2, h2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), h.reshape(-1, h.shape[-1])
    dh = scale * (dy2 @ up.T)                          # (N, R)   eq. (6.2)
    dup = scale * (h2.T @ dy2)                         # eq. (6.2)
    ddown = x2.T @ dh                                  # eq. (6.2)
    dx = (dy2 @ w.T + dh @ down.T).reshape(x.shape)    # eq. (6.2)
    return dx, ddown, dup


# --- §5 layer normalization -------------------------------------------------------------------


def layernorm_forward(x, w, b, eps):
    """y = (x - mean) / sqrt(var + eps) * w + b over the channels of each token."""
    mean = x.mean(axis=-1, keepdims=True)              # (B, T, 1)   eq. (5.1)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)   # (B, T, 1)   eq. (5.1)
    rstd = 1.0 / np.sqrt(var + eps)                    # (B, T, 1)   eq. (5.1)
    xhat = (x - mean) * rstd                           # (B, T, C)   eq. (5.1)
    y = xhat * w + (b if b is not None else 0)         # eq. (5.1)
    return y, (xhat, rstd, w, b is not None)


def layernorm_backward(dy, cache):
    """dxhat = dy w;  dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat));
    dw = sum over tokens of dy xhat;  db = sum over tokens of dy."""
    xhat, rstd, w, has_bias = cache
    dxhat = dy * w                                     # eq. (5.2)
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)            # eq. (5.2)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    axes = tuple(range(dy.ndim - 1))
    dw = (dy * xhat).sum(axis=axes)                    # eq. (5.3)
    db = dy.sum(axis=axes) if has_bias else None       # eq. (5.3)
    return dx, dw, db


# --- §3-4 multi-head self-attention -----------------------------------------------------------


def softmax(s):
    """exp(s) / sum(exp(s)) over the last axis; the row's maximum is subtracted first (the same
    softmax, since a shift of a row cancels) so that exp cannot overflow."""
    e = np.exp(s - s.max(axis=-1, keepdims=True))     # eq. (1.1)
    return e / e.sum(axis=-1, keepdims=True)           # eq. (1.1)


def attention_forward(x, w_attn, b_attn, w_proj, b_proj, n_head, d_qk, causal=True, rotate=None):
    """For each head h:  q_h, k_h, v_h = columns of x w_attn + b_attn (q_h and k_h then rotated
    by their positions when ``rotate``, a pair of functions (rotation, its transpose), is given:
    rotary positions, ``designs/rope/twin.py``);
    S_h = q_h k_h^T / sqrt(Dk), future keys masked to -inf (causal); P_h = softmax(S_h);
    y_h = P_h v_h.  Then y = concat_h(y_h) w_proj + b_proj.
    x (B, T, C); w_attn (C, H (2 Dk + Dv)) ordered [all q | all k | all v], each head-major."""
    B, T, _ = x.shape
    H, Dk = n_head, d_qk
    qkv, qkv_cache = linear_forward(x, w_attn, b_attn)                 # eq. (3.1)
    Dv = (qkv.shape[-1] - 2 * H * Dk) // H
    future = np.triu(np.ones((T, T), bool), k=1)                       # eq. (3.2): s > t
    heads, per_head = [], []
    for h in range(H):
        q = qkv[..., h * Dk:(h + 1) * Dk]                              # (B, T, Dk)   eq. (3.1)
        k = qkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk]            # (B, T, Dk)   eq. (3.1)
        v = qkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv]    # (B, T, Dv)   eq. (3.1)
        if rotate is not None:
            q, k = rotate[0](q), rotate[0](k)
        S = q @ k.transpose(0, 2, 1) / np.sqrt(Dk)                     # (B, T, T)   eq. (3.2)
        if causal:
            S = np.where(future, -np.inf, S)                           # eq. (3.2)
        P = softmax(S)                                                 # (B, T, T)   eq. (3.3)
        heads.append(P @ v)                                            # (B, T, Dv)   eqs. (3.3), (4.1)
        per_head.append((q, k, v, P))
    y_cat = np.concatenate(heads, axis=-1)                             # (B, T, H Dv)   eq. (4.1)
    y, proj_cache = linear_forward(y_cat, w_proj, b_proj)              # eqs. (3.3), (4.1)
    return y, (qkv_cache, proj_cache, per_head, H, Dk, Dv, rotate)


def attention_backward(dy, cache):
    """Per head, with dy_h the head's slice of dy w_proj^T:
    dv = P^T dy_h;  dP = dy_h v^T;  dS = P * (dP - rowsum(dP * P))  (the softmax Jacobian);
    dq = dS k / sqrt(Dk);  dk = dS^T q / sqrt(Dk).
    Returns dx, dw_attn, db_attn, dw_proj, db_proj."""
    qkv_cache, proj_cache, per_head, H, Dk, Dv, rotate = cache
    dy_cat, dw_proj, db_proj = linear_backward(dy, proj_cache)         # eq. (3.4)
    x = qkv_cache[0]
    dqkv = np.zeros(x.shape[:-1] + (H * (2 * Dk + Dv),), dy.dtype)
    for h, (q, k, v, P) in enumerate(per_head):
        dy_h = dy_cat[..., h * Dv:(h + 1) * Dv]                       # (B, T, Dv)   eq. (4.2)
        dv = P.transpose(0, 2, 1) @ dy_h                               # eq. (3.5)
        dP = dy_h @ v.transpose(0, 2, 1)                               # (B, T, T)   eq. (3.5)
        dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))           # eq. (3.6)
        dq = dS @ k / np.sqrt(Dk)                                      # eq. (3.7)
        dk = dS.transpose(0, 2, 1) @ q / np.sqrt(Dk)                   # eq. (3.7)
        if rotate is not None:                                         # back through the rotation
            dq, dk = rotate[1](dq), rotate[1](dk)
        dqkv[..., h * Dk:(h + 1) * Dk] = dq                           # eq. (4.2)
        dqkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk] = dk         # eq. (4.2)
        dqkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv] = dv  # eq. (4.2)
    dx, dw_attn, db_attn = linear_backward(dqkv, qkv_cache)            # eq. (4.2)
    return dx, dw_attn, db_attn, dw_proj, db_proj


def attention_decode(x_t, cache, w_attn, b_attn, w_proj, b_proj, n_head, d_qk):
    """One new token through one attention layer, with a cache of the keys and values of the
    tokens before it (generation's KV cache, written as a plain loop):
    per head, k_h and v_h of the new token join the cache; its query reads every cached row,
    itself included. No mask is needed: the cache holds no future. Per new token the work is
    one row of scores, (1, t), instead of the whole (t, t) map.
    x_t (B, 1, C); cache: {"k": [H arrays (B, t, Dk)], "v": [H arrays (B, t, Dv)]}, each
    extended here by one row (start with t = 0 rows). Returns out_t (B, 1, C)."""
    H, Dk = n_head, d_qk
    qkv, _ = linear_forward(x_t, w_attn, b_attn)                       # (B, 1, .)   eq. (3.8)
    Dv = (qkv.shape[-1] - 2 * H * Dk) // H
    heads = []
    for h in range(H):
        q = qkv[..., h * Dk:(h + 1) * Dk]                              # (B, 1, Dk)
        k = qkv[..., H * Dk + h * Dk:H * Dk + (h + 1) * Dk]            # (B, 1, Dk)
        v = qkv[..., 2 * H * Dk + h * Dv:2 * H * Dk + (h + 1) * Dv]    # (B, 1, Dv)
        cache["k"][h] = np.concatenate([cache["k"][h], k], axis=1)     # (B, t+1, Dk)   eq. (3.9)
        cache["v"][h] = np.concatenate([cache["v"][h], v], axis=1)     # (B, t+1, Dv)   eq. (3.9)
        s = q @ cache["k"][h].transpose(0, 2, 1) / np.sqrt(Dk)         # (B, 1, t+1)   eq. (3.10)
        heads.append(softmax(s) @ cache["v"][h])                       # (B, 1, Dv)   eq. (3.10)
    y, _ = linear_forward(np.concatenate(heads, axis=-1), w_proj, b_proj)   # (B, 1, C)   eq. (3.10)
    return y


def empty_cache(batch, n_head, d_qk, d_v):
    """A KV cache holding no token yet, for :func:`attention_decode`."""
    return {"k": [np.zeros((batch, 0, d_qk)) for _ in range(n_head)],
            "v": [np.zeros((batch, 0, d_v)) for _ in range(n_head)]}


# --- §7 the MLP: FC_expand > g > FC_contract --------------------------------------------------
GELU_K, GELU_A = np.sqrt(2.0 / np.pi), 0.044715


def gelu(u):
    """GPT-2's tanh approximation: g(u) = u/2 (1 + tanh(k (u + a u^3))), k = sqrt(2/pi)."""
    return 0.5 * u * (1 + np.tanh(GELU_K * (u + GELU_A * u ** 3)))    # eq. (7.2)


def gelu_grad(u):
    """dg/du = (1 + tanh z)/2 + u/2 (1 - tanh^2 z) k (1 + 3a u^2),  z = k (u + a u^3)."""
    t = np.tanh(GELU_K * (u + GELU_A * u ** 3))                        # eq. (7.4)
    return 0.5 * (1 + t) + 0.5 * u * (1 - t ** 2) * GELU_K * (1 + 3 * GELU_A * u ** 2)   # eq. (7.4)


def mlp_forward(x, w_fc, b_fc, w_proj, b_proj, activation="gelu"):
    """y = g(x w_fc + b_fc) w_proj + b_proj, g = GELU or ReLU."""
    u, fc_cache = linear_forward(x, w_fc, b_fc)                       # (B, T, 4C)   eq. (7.2)
    a = gelu(u) if activation == "gelu" else np.maximum(u, 0)          # eq. (7.2)
    y, proj_cache = linear_forward(a, w_proj, b_proj)                  # eq. (7.2)
    return y, (fc_cache, proj_cache, u, activation)


def mlp_backward(dy, cache):
    """da = dy w_proj^T;  du = da * g'(u);  then the linear layers' rules."""
    fc_cache, proj_cache, u, activation = cache
    da, dw_proj, db_proj = linear_backward(dy, proj_cache)             # eq. (7.4)
    du = da * (gelu_grad(u) if activation == "gelu" else (u > 0))      # eq. (7.4)
    dx, dw_fc, db_fc = linear_backward(du, fc_cache)                   # eq. (7.4)
    return dx, dw_fc, db_fc, dw_proj, db_proj


# --- §1 cross-entropy on shifted targets -------------------------------------------------------


def cross_entropy_forward(logits, targets):
    """loss = -(1/N) sum_n log softmax(logits_n)[y_n] over the N = B T positions."""
    p = softmax(logits)                                                # (B, T, V)   eq. (1.1)
    picked = np.take_along_axis(p, targets[..., None], axis=-1)[..., 0]   # p[n, y_n]   eq. (1.2)
    return float(-np.log(picked).mean()), (p, targets)                 # eq. (1.2)


def cross_entropy_backward(cache):
    """dlogits = (p - onehot(y)) / N."""
    p, targets = cache
    onehot = np.zeros_like(p)                                          # eq. (1.3)
    np.put_along_axis(onehot, targets[..., None], 1.0, axis=-1)        # e_y   eq. (1.3)
    return (p - onehot) / targets.size                                 # eq. (1.3)


# --- §7 the whole model: the layers composed ---------------------------------------------------


def head_loss_and_backward(P: dict, cfg, x, targets, grads: dict, weights=None, norm=None):
    """ln_f, the head (tied: logits = xf wte^T; or lm_head with bias) and the mean cross-entropy
    (with ``weights`` (B, T): sum(w CE) / sum(w)); returns the loss and the gradient of x, the
    head's and ln_f's gradients put in ``grads``. ``norm``: (forward, backward) of ln_f, the
    layer norm's when None."""
    norm_forward, norm_backward = norm or (layernorm_forward, layernorm_backward)
    xf, lnf = norm_forward(x, P["ln_f.weight"], P.get("ln_f.bias"), cfg.ln_eps)
    if cfg.tie_head:
        logits, head = linear_forward(xf, P["wte"].T)                  # eq. (7.5)
    else:
        logits, head = linear_forward(xf, P["lm_head.weight"], P.get("lm_head.bias"))
    if weights is None:
        loss, ce = cross_entropy_forward(logits, targets)
        dlogits = cross_entropy_backward(ce)
    else:
        p = softmax(logits)
        picked = np.take_along_axis(p, targets[..., None], axis=-1)[..., 0]
        loss = float(-(weights * np.log(picked)).sum() / weights.sum())
        onehot = np.zeros_like(p)
        np.put_along_axis(onehot, targets[..., None], 1.0, axis=-1)
        dlogits = (p - onehot) * (weights / weights.sum())[..., None]
    dxf, dw_head, db_head = linear_backward(dlogits, head)
    if cfg.tie_head:
        grads["wte"] = dw_head.T                                        # eq. (7.5)
    else:
        grads["lm_head.weight"], grads["lm_head.bias"] = dw_head, db_head
    dx, grads["ln_f.weight"], grads["ln_f.bias"] = norm_backward(dxf, lnf)
    return loss, dx


def gpt_loss_and_grads(params: dict, cfg, idx, targets, rotate=None, norm=None, mlp=None):
    """Mean cross-entropy of a GPT given as a dict of arrays under GPT-2 names, and the gradient
    of every parameter: pre-LN blocks x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)), then ln_f
    and the head (wte^T, tied, or an untied lm_head with bias). The backward is the forward's
    calls read bottom-up; a parameter read twice (the tied wte) sums its two gradients.
    Positions: ``wpe`` where the parameters hold one, and ``rotate`` (see attention_forward)
    where given -- rotary positions come from their design's twin, not from here; likewise
    ``norm`` and ``mlp``, (forward, backward) pairs with the signatures of the layer norm's and
    the MLP's below (RMSNorm's and SwiGLU's twins), the layer norm and the MLP when None."""
    norm_forward, norm_backward = norm or (layernorm_forward, layernorm_backward)
    mlp_fwd, mlp_bwd = mlp or (mlp_forward, mlp_backward)
    P = params
    grads = {}
    x, emb_cache = embedding_forward(idx, P["wte"], P.get("wpe"))
    caches = []
    for i in range(cfg.n_layer):
        h = f"h.{i}."
        a, ln1 = norm_forward(x, P[h + "ln_1.weight"], P.get(h + "ln_1.bias"), cfg.ln_eps)   # eq. (7.1)
        a, attn = attention_forward(a, P[h + "attn.c_attn.weight"], P.get(h + "attn.c_attn.bias"),
                                    P[h + "attn.c_proj.weight"], P.get(h + "attn.c_proj.bias"),
                                    cfg.n_head, cfg.d_qk, cfg.causal, rotate)
        x = x + a                                                      # eq. (7.1)
        m, ln2 = norm_forward(x, P[h + "ln_2.weight"], P.get(h + "ln_2.bias"), cfg.ln_eps)   # eq. (7.1)
        m, mlp = mlp_fwd(m, P[h + "mlp.c_fc.weight"], P.get(h + "mlp.c_fc.bias"),
                         P[h + "mlp.c_proj.weight"], P.get(h + "mlp.c_proj.bias"), cfg.activation)
        x = x + m                                                      # eq. (7.1)
        caches.append((ln1, attn, ln2, mlp))
    loss, dx = head_loss_and_backward(P, cfg, x, targets, grads, norm=(norm_forward, norm_backward))
    for i in reversed(range(cfg.n_layer)):
        h = f"h.{i}."
        ln1, attn, ln2, mlp = caches[i]
        dm, *g = mlp_bwd(dx, mlp)                                      # eq. (7.3)
        for name, gi in zip(("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"), g):
            grads[h + name] = gi
        dln, grads[h + "ln_2.weight"], grads[h + "ln_2.bias"] = norm_backward(dm, ln2)   # eq. (7.3)
        dx = dx + dln                                                  # the residual's two paths   eq. (7.3)
        da, *g = attention_backward(dx, attn)                          # eq. (7.3)
        for name, gi in zip(("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                             "attn.c_proj.bias"), g):
            grads[h + name] = gi
        dln, grads[h + "ln_1.weight"], grads[h + "ln_1.bias"] = norm_backward(da, ln1)   # eq. (7.3)
        dx = dx + dln                                                  # eq. (7.3)
    dwte, grads["wpe"] = embedding_backward(dx, emb_cache)          # None without wpe
    grads["wte"] = grads.get("wte", 0) + dwte                          # eq. (7.5): read twice, summed
    return loss, {k: v for k, v in grads.items() if v is not None}
