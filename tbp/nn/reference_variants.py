"""The variants written the plain way, as reference.py writes the core layers: loops where the
papers have sums, every intermediate named, no buffer reused. Nothing here is used for
training; the tests hold the fast code to these in float64 (tests/test_twins.py).

- Attention Residuals, the whole model, forward and backward: the sources each operation
  reads, and each source's gradient summed over its readers without deferring anything;
- sparse decoding's selection rules, one position at a time;
- grouped-query attention, forward and backward, one query head at a time.

Shapes as in reference.py; N = B T rows. The encoder-decoder's twin is reference_seq2seq.py;
the designs of ``designs/`` keep their twins in their folders (``designs/mta/twin.py``, ...).
"""
from __future__ import annotations

import numpy as np

from .reference import (attention_backward, attention_forward, head_loss_and_backward,
                        depth_attention_backward, depth_attention_forward, embedding_backward, embedding_forward,
                        layernorm_backward, layernorm_forward, linear_backward, linear_forward, mlp_backward,
                        mlp_forward, softmax)


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


# --- Attention Residuals (Kimi Team, arXiv 2603.15031) ----------------------------------------


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
    s = 2 * L // cfg.residual_blocks if cfg.residual_blocks else 1
    eps = cfg.ln_eps
    c = cfg.residual_query_scale                                        # the logits' factor: q = c g w
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


# --- sparse decoding's selection (LessIsMore, Yang et al., arXiv 2508.07101) -----------------


def select_positions(scores, kind, budget, sinks=4, recency=0.25):
    """The kept positions of each batch row (and head, for topk), from scores (B, H, n).

    topk: each head's ``budget`` best positions.  window: the first ``sinks`` positions and the
    last budget - sinks.  lessismore: the sinks, the last ``recent`` positions, and between them
    ``middle`` = min(int((1 - recency) budget), budget - sinks) positions taken rank by rank --
    every head's best, then every head's second best, ... -- each position once.
    Returns sorted lists: [B][K] (lessismore, window) or [B][H][K] (topk, layer-topk: the same
    choice, made at every layer)."""
    B, H, n = scores.shape
    if kind in ("topk", "layer-topk"):
        return [[sorted(sorted(range(n), key=lambda j: -scores[b, h, j])[:budget]) for h in range(H)]
                for b in range(B)]
    middle = min(int((1 - recency) * budget), budget - sinks)
    if kind == "window":
        middle = 0
    recent = budget - sinks - middle
    out = []
    for b in range(B):
        kept = list(range(sinks)) + list(range(n - recent, n))
        ranked = [sorted(range(sinks, n - recent), key=lambda j: -scores[b, h, j]) for h in range(H)]
        chosen = []
        for rank in range(n):
            for h in range(H):
                if rank < len(ranked[h]) and ranked[h][rank] not in chosen and len(chosen) < middle:
                    chosen.append(ranked[h][rank])
        out.append(sorted(kept + chosen))
    return out
