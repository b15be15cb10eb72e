"""Sparse decoding written the plain way: the selection rules one position at a time, and a
decoding step whose later layers see only the kept positions, as the training forward with a
-inf mask. Nothing here is used to decode; the tests hold the decoder to these in float64
(tests/test_twins.py, tests/test_sparse.py). Shapes as in reference.py.
"""
from __future__ import annotations

import numpy as np

from ...reference import layernorm_forward, mlp_forward, softmax


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


def last_logits(P: dict, cfg, tokens: np.ndarray, kept, layer: int, own_top: int | None = None) -> np.ndarray:
    """The last token's logits (B, V) of a rotary, tied-head GPT (parameters ``P``, config ``cfg``)
    over ``tokens`` (B, T), when the layers after the selection layer ``layer`` let the last row
    attend only to ``kept`` ((B, K) for every head, or (B, H, K)); layers up to ``layer`` dense.
    With ``own_top``, every layer from ``layer`` on lets each head keep its own ``own_top``
    best scores instead (layer-topk). Every other row attends densely: the cached prefix."""
    from ..rope.twin import rope_forward     # the models it states are rotary (the retrieval study's)
    x = P["wte"][tokens]                                           # (B, T, C)
    B, T = tokens.shape
    H, Dk, Dv = cfg.n_head, cfg.d_qk, cfg.d_v
    for i in range(cfg.n_layer):
        h = f"h.{i}."
        a, _ = layernorm_forward(x, P[h + "ln_1.weight"], P[h + "ln_1.bias"], cfg.ln_eps)
        qkv = a @ P[h + "attn.c_attn.weight"] + P[h + "attn.c_attn.bias"]
        out = np.zeros((B, T, H * Dv))
        for hd in range(H):
            q = rope_forward(qkv[..., hd * Dk:(hd + 1) * Dk], cfg.designs["rope"].base)
            k = rope_forward(qkv[..., H * Dk + hd * Dk:H * Dk + (hd + 1) * Dk], cfg.designs["rope"].base)
            v = qkv[..., 2 * H * Dk + hd * Dv:2 * H * Dk + (hd + 1) * Dv]
            s = q @ k.transpose(0, 2, 1) / np.sqrt(Dk)
            s = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s)
            for b in range(B):
                if own_top is not None and i >= layer:             # each layer's own best, per head
                    keep = np.argsort(s[b, -1])[-own_top:]
                elif own_top is None and i > layer:                # the selection layer's set
                    keep = kept[b] if kept.ndim == 2 else kept[b, hd]
                else:
                    continue
                row = np.full(T, -np.inf)
                row[keep] = s[b, -1, keep]
                s[b, -1] = row
            out[..., hd * Dv:(hd + 1) * Dv] = softmax(s) @ v
        x = x + out @ P[h + "attn.c_proj.weight"] + P[h + "attn.c_proj.bias"]
        m, _ = layernorm_forward(x, P[h + "ln_2.weight"], P[h + "ln_2.bias"], cfg.ln_eps)
        m, _ = mlp_forward(m, P[h + "mlp.c_fc.weight"], P[h + "mlp.c_fc.bias"], P[h + "mlp.c_proj.weight"],
                           P[h + "mlp.c_proj.bias"])
        x = x + m
    xf, _ = layernorm_forward(x, P["ln_f.weight"], P["ln_f.bias"], cfg.ln_eps)
    return xf[:, -1] @ P["wte"].T
