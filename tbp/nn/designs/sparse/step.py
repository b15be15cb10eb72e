"""One decoding step thinned by a sparse rule: the hook the attention layer's decoding calls
(attention.CausalSelfAttention.decode), and the gather of the kept positions.

The layer asks the step's strategy twice, and never which rule it holds:

- ``cached(layer, state, s, span, step)`` before its scores: the keys and values it reads --
  the kept ones, gathered once for this layer, at a layer after a selection layer (or, for a
  rule that chooses at every layer, the ones this layer's own dense scores keep) -- or None:
  all ``span`` cached positions, densely;
- ``scored(layer, state, att, step)`` after dense scores: at a selection layer, choose the set
  the following layers read from the new row's pre-softmax scores ``att``.
"""
from __future__ import annotations

import numpy as np


class SparseStep:
    """A sparse rule during one step: ``keep``, the positions the last selection layer chose
    (None before the first), ``scores`` (B, H, t), what it chose them from."""

    def __init__(self, rule):
        self.rule, self.keep, self.scores = rule, None, None

    def cached(self, layer, state, s, span: int, step):
        rule = self.rule
        if rule.every_layer:
            if not rule.chooses_at(step.layer):
                return None
            att = s.att[..., :span]                   # this layer's own set, from its own dense scores
            np.matmul(s.q, layer._by_cache_head(state.keys[:, :, :span]).swapaxes(-1, -2), out=att)
            self._choose(layer, state, att, span)
        elif rule.chooses_at(step.layer) or self.keep is None:
            return None
        return gather_kept(state.keys, state.values, self.keep, _kept_buffers(state, self.keep))

    def scored(self, layer, state, att: np.ndarray, step) -> None:
        if not self.rule.every_layer and self.rule.chooses_at(step.layer):
            self._choose(layer, state, att, att.shape[-1])

    def _choose(self, layer, state, att: np.ndarray, span: int) -> None:
        """The set kept from the new row's scores ``att`` (B, H.., 1, span): the rule's, or where
        query heads share key/value heads, a set per key/value head (B, Hkv, K) ranked over its
        group (topk: over their highest score per position)."""
        B, H, Hkv = att.shape[0], layer.n_head, layer.kv_heads
        buf = getattr(state, "sparse_scores", None)
        if buf is None or buf.shape[-1] < span:
            buf = state.sparse_scores = np.empty((B, H, state.keys.shape[2]), att.dtype)
        scores = buf[..., :span]
        scores[...] = att[..., 0, :].reshape(B, H, span)
        if Hkv == H:
            keep = self.rule.keep(scores)
        else:              # a set per key/value head, ranked over its G query heads (per head: their best)
            grouped = scores.reshape(B * Hkv, H // Hkv, span)
            if self.rule.per_head:
                grouped = grouped.max(axis=1, keepdims=True)
            keep = self.rule.keep(grouped).reshape(B, Hkv, -1)
        self.keep, self.scores = keep, scores


def _kept_buffers(state, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A layer's buffers for the kept keys and values, made on the first sparse step and reused
    while the budget stays the same."""
    B, Hkv, _, Dk = state.keys.shape
    shape = (B, Hkv, keep.shape[-1])
    bufs = getattr(state, "kept", None)
    if bufs is None or bufs[0].shape[:3] != shape:
        bufs = state.kept = (np.empty((*shape, Dk), state.keys.dtype),
                             np.empty((*shape, state.values.shape[-1]), state.values.dtype))
    return bufs


def gather_kept(keys: np.ndarray, values: np.ndarray, keep: np.ndarray, out=None) -> tuple[np.ndarray, np.ndarray]:
    """The cached keys (B, Hkv, K, Dk) and values (B, Hkv, K, Dv + 1) at the kept positions ``keep``:
    (B, K), one set for every cache head, or (B, Hkv, K), a set per head. One ``np.take`` of whole
    rows for all sequences and heads at once, through flat row numbers (b Hkv + j) n + position:
    no loop over heads, and each kept position a few contiguous cache lines. ``out``: a pair of
    buffers of those shapes to gather into (fresh ones cost their page faults at every step:
    as much as the gather itself); ``mode="clip"`` because the positions are in range and the
    default mode copies ``out`` through a buffer, which doubled the gather's time."""
    B, Hkv, n, Dk = keys.shape
    K = keep.shape[-1]
    base = (np.arange(B * Hkv).reshape(B, Hkv, 1) * n)                 # the first row of each (b, j)
    rows = (base + (keep[:, None, :] if keep.ndim == 2 else keep)).reshape(-1)
    if out is None:
        out = np.empty((B, Hkv, K, Dk), keys.dtype), np.empty((B, Hkv, K, values.shape[-1]), values.dtype)
    kept_k, kept_v = out
    np.take(keys.reshape(B * Hkv * n, Dk), rows, axis=0, out=kept_k.reshape(B * Hkv * K, Dk), mode="clip")
    np.take(values.reshape(B * Hkv * n, -1), rows, axis=0, out=kept_v.reshape(B * Hkv * K, -1), mode="clip")
    return kept_k, kept_v
