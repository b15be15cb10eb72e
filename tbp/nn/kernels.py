"""The attention kernels: y = softmax(S + mask) v and its backward.   [paper §3-4]

A layer picks its kernel once, when it is built (:func:`kernel`), and from then on calls one
signature, whatever the form:

    saved = kernel.forward(qs, k, v, out, key_mask, drop) qs (B, H, Tq, Dk) scaled queries,
                                                          k (B, H, Tk, Dk), v (B, H, Tk, Dv),
                                                          y written to out (B, H, Tq, Dv)
    kernel.backward(dy, qs, k, v, y, saved, (dqs, dk, dv))
    P = kernel.weights(qs, k, saved)                     (B, H, Tq, Tk), for looking inside

Here the dense kernel, in its two forms; a design registers others on the registry's kernel
axis (FlashAttention, ``designs/flash/``). ``saved`` is the kernel's own business: the
probabilities P (dense), P in query blocks (causal dense), or each row's log-sum-exp (flash). A positions scheme's rotation is applied by
the layer before the kernel; its additive score term (``bias``, positions.py) and a window
(sliding-window attention) are the kernel's: each form adds the bias to the scores it computes,
where it adds the mask.
"""
from __future__ import annotations

import numpy as np

from . import gemm, registry
from .positions import add_bias


_MASKS: dict = {}


def causal_mask(Tq: int, q_pos0: int, dtype, window: int | None = None) -> np.ndarray:
    """(Tq, q_pos0 + Tq) additive mask for queries at positions q_pos0 ...: 0 where key j <= the
    query's position (and, with ``window``, j > position - window), -inf elsewhere.
    Cached (read-only): training reuses one shape every step."""
    key = (Tq, q_pos0, np.dtype(dtype), window)
    mask = _MASKS.get(key)
    if mask is None:
        keys, rows = np.arange(q_pos0 + Tq)[None, :], (q_pos0 + np.arange(Tq))[:, None]
        hidden = keys > rows
        if window is not None:
            hidden |= keys <= rows - window
        mask = np.where(hidden, -np.inf, 0).astype(dtype)
        mask.flags.writeable = False
        if len(_MASKS) >= 8:            # prefill chunks bring new shapes: keep the cache small
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


def attend(att: np.ndarray, v: np.ndarray, key_mask: np.ndarray | None = None,
           out: np.ndarray | None = None, drop: np.ndarray | None = None) -> np.ndarray:
    """y = softmax(S + mask) v, the dense core every attention layer shares.   [paper §3.2]

    att: the scores S (B, H, Tq, Tk), already scaled and causally masked where that applies,
    turned into the probabilities P in place and returned; v (B, H, Tk, Dv); key_mask: an
    additive (B, 1, 1, Tk) mask, -inf on keys no query may read (padding); y is written to
    ``out`` (B, H, Tq, Dv). A row must keep at least one key. ``drop`` (B, H, Tq, Tk), dropout's
    mask of 0 and 1/(1-p): y = (P * drop) v, and P itself is returned (dropout.py).
    """
    if key_mask is not None:
        att += key_mask
    # ufunc reductions directly: .max()/.sum() add a Python wrapper per call
    att -= np.maximum.reduce(att, axis=-1, keepdims=True)
    np.exp(att, out=att)
    att /= np.add.reduce(att, axis=-1, keepdims=True)
    gemm.batched_matmul(att if drop is None else att * drop, v, out)
    return att


def attend_backward(dy: np.ndarray, qs: np.ndarray, k: np.ndarray, v: np.ndarray, att: np.ndarray,
                    y: np.ndarray, out: tuple, drop: np.ndarray | None = None) -> None:
    """The backward of S = qs k^T, y = softmax(S) v, into out = (dqs, dk, dv).   [paper §3.2, §4]

    dv = P^T dy;  dP = dy v^T;  dS = P * (dP - rowsum(dP * P));  dqs = dS k;  dk = dS^T qs.
    rowsum(dP * P) = rowsum(dy * y), since y = P v: a (Tq, Dv) product instead of (Tq, Tk).
    A masked key has P = 0 in every row, so its dk and dv rows are exactly zero, and dS
    vanishes wherever a mask is, with no special case. qs (B, H, Tq, Dk), k (B, H, Tk, Dk).
    With dropout's ``drop``: dv = (P * drop)^T dy and dP = (dy v^T) * drop (dropout.py).
    """
    dq, dk, dv = out
    gemm.batched_matmul((att if drop is None else att * drop).transpose(0, 1, 3, 2), dy, dv)   # (B, H, Tk, Dv)
    datt = gemm.batched_matmul(dy, v.transpose(0, 1, 3, 2))                # (B, H, Tq, Tk)
    if drop is not None:
        datt *= drop
    datt -= np.add.reduce(dy * y, axis=-1, keepdims=True)                 # (B, H, Tq, 1) broadcast
    datt *= att                                                            # dS w.r.t. qs k^T
    gemm.batched_matmul(datt, k, dq)                                       # (B, H, Tq, Dk)
    gemm.batched_matmul(datt.transpose(0, 1, 3, 2), qs, dk)                # (B, H, Tk, Dk)


SPLIT_ROWS = 64        # causal dense attention: query blocks of about this many rows, from 2 blocks on


def query_blocks(T: int, rows: int = SPLIT_ROWS) -> list[tuple[int, int]]:
    """(start, end) of causal dense attention's query blocks of about ``rows`` rows (one below 2 rows)."""
    n = max(1, T // rows)
    bounds = [T * i // n for i in range(n + 1)]
    return list(zip(bounds, bounds[1:]))


def attend_causal_blocks(qs: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                         rows: int = SPLIT_ROWS, window: int | None = None,
                         key_mask: np.ndarray | None = None, drop: np.ndarray | None = None, bias=None) -> tuple:
    """Causal ``attend`` with the queries in blocks; returns each block's P.

    Queries [a, b) may read only keys [0, b), so block i's scores are (b - a, b): the masked
    part of S to the right of the block is never computed. With n blocks, S, the softmax and
    P v cost (n + 1) / 2n of the full square (3/4 for two), what flash attention's tiles skip
    as well, without its recomputation in the backward. qs, k (B, H, T, Dk); v (B, H, T, Dv);
    out (B, H, T, Dv); ``rows``: the blocks' size (query_blocks); ``window``: each query reads at
    most this many positions (applied only past it, T > window); ``key_mask`` (B, 1, 1, T),
    additive, on keys no query may read; ``bias``: a positions scheme's score term (positions.py).
    """
    T = qs.shape[2]
    mask = causal_mask(T, 0, qs.dtype, window if window and T > window else None)
    blocks = []
    for a, b in query_blocks(T, rows):
        att = gemm.batched_matmul(qs[:, :, a:b], k[:, :, :b].transpose(0, 1, 3, 2))   # (B, H, b - a, b)
        att += mask[a:b, :b]
        if bias is not None:
            add_bias(att, bias, np.arange(a, b), np.arange(b))
        blocks.append(attend(att, v[:, :, :b], None if key_mask is None else key_mask[..., :b], out=out[:, :, a:b],
                             drop=None if drop is None else drop[:, :, a:b, :b]))
    return tuple(blocks)


def attend_causal_blocks_backward(dy, qs, k, v, blocks: tuple, y, out: tuple, rows: int = SPLIT_ROWS,
                                  drop: np.ndarray | None = None) -> None:
    """``attend_backward`` of ``attend_causal_blocks``, into out = (dqs, dk, dv).

    The last block's queries read every key: its products write dk and dv whole. Each other
    block reads keys [0, b): its dk, dv are added to those rows.
    """
    dq, dk, dv = out
    spans = query_blocks(qs.shape[2], rows)
    for i in range(len(spans) - 1, -1, -1):
        a, b = spans[i]
        q_rows, keys = slice(a, b), slice(0, b)
        if i == len(spans) - 1:
            dk_i, dv_i = dk, dv
        else:
            dk_i, dv_i = np.empty_like(dk[:, :, keys]), np.empty_like(dv[:, :, keys])
        attend_backward(dy[:, :, q_rows], qs[:, :, q_rows], k[:, :, keys], v[:, :, keys], blocks[i],
                        y[:, :, q_rows], out=(dq[:, :, q_rows], dk_i, dv_i),
                        drop=None if drop is None else drop[:, :, q_rows, keys])
        if dk_i is not dk:
            dk[:, :, keys] += dk_i
            dv[:, :, keys] += dv_i


def padding_mask(pad: np.ndarray, dtype) -> np.ndarray:
    """(B, 1, 1, T) additive key mask from a boolean (B, T) ``pad`` (True: a padded position)."""
    return np.where(pad, -np.inf, 0).astype(dtype)[:, None, None, :]


class Dense:
    """Every score kept: P (B, H, Tq, Tk) is what the backward reads. Non-causal (an encoder,
    cross-attention), with an optional additive key mask (B, 1, 1, Tk) for padding."""

    def __init__(self, bias=None):
        self.bias = bias

    def forward(self, qs, k, v, out, key_mask=None, drop=None):
        if drop is not None:
            raise ValueError("dropout is for causal self-attention here")
        att = gemm.batched_matmul(qs, k.transpose(0, 1, 3, 2))            # (B, H, Tq, Tk)
        if self.bias is not None:
            add_bias(att, self.bias, np.arange(att.shape[2]), np.arange(att.shape[3]))
        return attend(att, v, key_mask, out=out)

    def backward(self, dy, qs, k, v, y, saved, out) -> None:
        attend_backward(dy, qs, k, v, saved, y, out=out)

    def weights(self, qs, k, saved) -> np.ndarray:
        return saved.copy()


class CausalBlocks:
    """Causal dense attention in query blocks of about ``rows`` rows (one block below 2 rows),
    the masked part right of each block never computed (:func:`attend_causal_blocks`).
    ``window``: sliding-window attention past that many positions. With a key mask, or past
    the window, it is one block, the full square (a window's masked part is on the left).
    ``saved`` is (the rows a block, each block's P, dropout's mask or None)."""

    def __init__(self, rows: int = SPLIT_ROWS, window: int | None = None, bias=None):
        self.rows, self.window, self.bias = rows, window, bias

    def forward(self, qs, k, v, out, key_mask=None, drop=None):
        T = qs.shape[2]
        rows = T if key_mask is not None or (self.window and T > self.window) else self.rows
        return rows, attend_causal_blocks(qs, k, v, out, rows, self.window, key_mask, drop, self.bias), drop

    def backward(self, dy, qs, k, v, y, saved, out) -> None:
        rows, blocks, drop = saved
        attend_causal_blocks_backward(dy, qs, k, v, blocks, y, out, rows, drop)

    def weights(self, qs, k, saved) -> np.ndarray:
        rows, blocks, _ = saved
        T = qs.shape[2]
        P = np.zeros(qs.shape[:2] + (T, T), qs.dtype)
        for (a, b), block in zip(query_blocks(T, rows), blocks):
            P[:, :, a:b, :b] = block
        return P


@registry.kernel("dense")
def _dense(causal: bool, window, rows: int, tiles: tuple | None, bias):
    """Causal: query blocks of ``rows`` (the masked scores right of each block never computed);
    otherwise one dense square."""
    return CausalBlocks(rows, window, bias) if causal else Dense(bias)


def kernel(impl: str, causal: bool, window: int | None = None, rows: int = SPLIT_ROWS,
           tiles: tuple | None = None, bias=None):
    """The kernel ``impl`` names on the registry's kernel axis, for the layer's mask and its
    positions scheme's score term ``bias(rows, keys, dtype)`` (positions.py; None: none).
    ``rows``: causal dense attention's query blocks; ``tiles``: a tiled kernel's (block_q,
    block_k), None for its own (the flash design's)."""
    make = registry.KERNEL.get(impl)
    if make is None:
        raise ValueError(f"attention kernel must be one of {', '.join(registry.KERNEL)}, got {impl!r}")
    return make(causal, window, rows, tiles, bias)
