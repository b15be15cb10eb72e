"""Attention Residuals written the plain way, as reference.py writes the core layers: the whole
model, forward and backward, the sources each operation reads and each source's gradient
summed over its readers without deferring anything. Nothing here trains; tests/test_twins.py
holds the fast model to it in float64.
"""
from __future__ import annotations

import numpy as np

from ...reference import embedding_backward, embedding_forward, head_loss_and_backward
from ...reference_variants import sublayer_backward, sublayer_forward


# --- the depth attention: one operation's read of its sources (arXiv 2603.15031) --------------


def depth_attention_forward(vs, w, g, eps):
    """h = sum_i alpha_i v_i over sources v_i (N, C), token by token:
    u_i = v_i / sqrt(mean(v_i^2) + eps);  z_i = w . (g u_i);  alpha = softmax_i(z)."""
    N, C = vs[0].shape
    h = np.zeros((N, C))
    rows = []
    for n in range(N):
        r = np.array([np.sqrt(np.mean(v[n] ** 2) + eps) for v in vs])        # (K,)
        u = np.stack([v[n] / r_i for v, r_i in zip(vs, r)])                 # (K, C)
        z = np.array([w @ (g * u_i) for u_i in u])                          # (K,)
        alpha = np.exp(z - z.max())
        alpha /= alpha.sum()
        h[n] = sum(a_i * v[n] for a_i, v in zip(alpha, vs))
        rows.append((r, u, alpha))
    return h, (vs, w, g, rows)


def depth_attention_backward(dh, cache):
    """dalpha_i = dh . v_i;  dz_i = alpha_i (dalpha_i - sum_j alpha_j dalpha_j);
    dw = sum dz_i g u_i;  dg = sum dz_i w u_i;  du_i = dz_i w g;
    dv_i = alpha_i dh + (du_i - u_i mean(du_i u_i)) / r_i."""
    vs, w, g, rows = cache
    dvs = [np.zeros_like(v) for v in vs]
    dw, dg = np.zeros_like(w), np.zeros_like(g)
    for n, (r, u, alpha) in enumerate(rows):
        dalpha = np.array([dh[n] @ v[n] for v in vs])
        dz = alpha * (dalpha - alpha @ dalpha)
        for i in range(len(vs)):
            dw += dz[i] * g * u[i]
            dg += dz[i] * w * u[i]
            du = dz[i] * w * g
            dvs[i][n] = alpha[i] * dh[n] + (du - u[i] * np.mean(du * u[i])) / r[i]
    return dvs, dw, dg


# --- the whole model -------------------------------------------------------------------------


def attnres_gpt_loss_and_grads(P: dict, cfg, idx, targets):
    """Mean cross-entropy of a GPT with Attention Residuals (full, or in blocks), and the
    gradient of every parameter. Sublayer j (attention and MLP of each block in turn) belongs
    to block n = j // s + 1 (s sublayers a block; block 0 is the embedding) at place k = j % s.
    Its input is the depth attention of its operation over the sources it reads: every finished
    block's value S_m (the sum of its outputs; S_0 the embedding) and, from k >= 1 on, its own
    block's partial sum P_{n,k} = o_{n,0} + ... + o_{n,k-1}. The first sublayer reads S_0 as it
    is. The state before ln_f is res_f's depth attention over every block.

    Backward, plainly: each source's gradient is the sum of what each of its readers sends;
    output o_{n,k} enters S_n and every P_{n,k'}, k' > k, so its gradient is dS_n plus those
    dP_{n,k'}. Walking the sublayers in reverse, every reader of a source comes before it."""
    B, T = idx.shape
    C, L = cfg.d_model, cfg.n_layer
    blocks, c = cfg.designs["attnres"].blocks, cfg.designs["attnres"].query_scale   # c: q = c g w
    s = 2 * L // blocks if blocks else 1
    eps = cfg.ln_eps
    x0, emb_cache = embedding_forward(idx, P["wte"], P.get("wpe"))
    values = {("S", 0): x0.reshape(-1, C)}                              # source name -> (N, C)
    reads, caches = [], []
    for j in range(2 * L):
        i, kind = j // 2, ("attn", "mlp")[j % 2]
        h, op = f"h.{i}.", f"h.{i}.{kind}_res."
        n, k = j // s + 1, j % s
        names = [("S", m) for m in range(n)] + ([("P", n, k)] if k else [])
        if j == 0:
            x_in, op_cache = x0, None
        else:
            hx, op_cache = depth_attention_forward([values[name] for name in names], c * P[op + "query"],
                                                   P[op + "gain"], eps)
            x_in = hx.reshape(B, T, C)
        out, cache = sublayer_forward(P, h, i, kind, x_in, cfg)
        o = out.reshape(-1, C)
        values[("P", n, k + 1)] = o if k == 0 else values[("P", n, k)] + o
        if k == s - 1:
            values[("S", n)] = values[("P", n, k + 1)]
        reads.append(names)
        caches.append((op_cache, cache))
    final = [("S", m) for m in range(2 * L // s + 1)]
    hf, final_cache = depth_attention_forward([values[name] for name in final], c * P["res_f.query"],
                                              P["res_f.gain"], eps)
    grads: dict = {}
    loss, dhf = head_loss_and_backward(P, cfg, hf.reshape(B, T, C), targets, grads)

    dsource = {name: np.zeros((B * T, C)) for name in values}
    dvs, dw, grads["res_f.gain"] = depth_attention_backward(dhf.reshape(-1, C), final_cache)
    grads["res_f.query"] = c * dw                                       # the twin read w' = c w
    for name, dv in zip(final, dvs):
        dsource[name] += dv
    for j in reversed(range(2 * L)):
        i, kind = j // 2, ("attn", "mlp")[j % 2]
        h, op = f"h.{i}.", f"h.{i}.{kind}_res."
        n, k = j // s + 1, j % s
        do = dsource[("S", n)] + sum(dsource[("P", n, kk)] for kk in range(k + 1, s))
        op_cache, cache = caches[j]
        dx_in = sublayer_backward(do.reshape(B, T, C), cache, h, kind, grads).reshape(-1, C)
        if j == 0:
            dsource[("S", 0)] += dx_in
            continue
        dvs, dw, grads[op + "gain"] = depth_attention_backward(dx_in, op_cache)
        grads[op + "query"] = c * dw
        for name, dv in zip(reads[j], dvs):
            dsource[name] += dv
    dwte, grads["wpe"] = embedding_backward(dsource[("S", 0)].reshape(B, T, C), emb_cache)
    grads["wte"] = grads.get("wte", 0) + dwte
    return loss, {key: v for key, v in grads.items() if v is not None}
