"""FlashAttention: exact attention in tiles, without storing the T x T matrix.
[Dao et al., arXiv 2205.14135; Dao, arXiv 2307.08691 (the FA2 form used here)]

Dense attention keeps P = softmax(S) (B, H, Tq, Tk) for its backward. Here the queries are cut
into tiles of ``block_q`` rows and the keys into tiles of ``block_k``; for each query tile a
running row maximum m, running normaliser l and unnormalised output O~ are updated key tile
by key tile (the online softmax, Milakov & Gimelshein, arXiv 1805.02867):

    S = Q_i K_j^T (Q pre-scaled by 1/sqrt(Dk));   m' = max(m, rowmax S);   c = exp(m - m')
    P~ = exp(S - m');   l = c l + rowsum P~;   O~ = c O~ + P~ V_j;   m = m'
    O_i = O~ / l;   L_i = m + log l          (the row log-sum-exp: all the backward keeps)

The backward recomputes each tile's probabilities exactly from L, P = exp(S - L), and uses
D = rowsum(dO * O) (= rowsum(P * dP), since O = P V), so it is the dense closed form tile by tile:

    dV_j += P^T dO_i;   dP = dO_i V_j^T;   dS = P * (dP - D_i);   dQ_i += dS K_j;   dK_j += dS^T Q_i

Causal: query row r (absolute position r + Tk - Tq: queries are the last Tq positions) sees
keys <= its position; tiles entirely above the diagonal are skipped, and only tiles that
cross it are masked. Memory: O(T) per head beyond the inputs (L, and one tile of scores).
Results equal dense attention up to rounding (the tests hold them to 1e-12 in float64).
"""
from __future__ import annotations

import numpy as np

from ... import registry
from ...attention import CausalSelfAttention
from ...kernels import causal_mask
from ...positions import add_bias
from ...variant import Variant

BLOCK_Q = 128      # query rows per tile   (measured on 2 cores: benchmarks/speed/long_context.py)
BLOCK_K = 128      # key rows per tile
FLASH_FROM_T = 2048    # attn_impl auto: flash from this context on (measured: benchmarks/speed/long_context.py)


def _mask(i0: int, i1: int, j0: int, j1: int, offset: int, dtype, window) -> np.ndarray | None:
    """Additive (i1-i0, j1-j0) mask of a causal tile: -inf on keys in a query's future (or more
    than ``window`` positions back); None when the tile has no such key."""
    future = j1 - 1 > i0 + offset             # the last key is after the first query
    too_old = window is not None and j0 <= i1 - 1 + offset - window
    if not (future or too_old):
        return None
    rows, keys = np.arange(i0, i1)[:, None] + offset, np.arange(j0, j1)[None, :]
    hidden = keys > rows
    if window is not None:
        hidden |= keys <= rows - window
    return np.where(hidden, dtype.type(-np.inf), dtype.type(0))


def _scores(q_tile: np.ndarray, kT_tile: np.ndarray, i0: int, i1: int, j0: int, j1: int, offset: int,
            causal: bool, window, bias) -> np.ndarray:
    """One tile's scores S = Q_i K_j^T (B, H, bq, bk), with its causal (and band) mask and the
    positions scheme's term: the forward and the backward's recomputation make them alike."""
    s = q_tile @ kT_tile
    if causal:
        mask = _mask(i0, i1, j0, j1, offset, s.dtype, window)
        if mask is not None:
            s += mask
    if bias is not None:
        add_bias(s, bias, np.arange(i0, i1) + offset, np.arange(j0, j1))
    return s


def _key_range(i0: int, i1: int, Tk: int, offset: int, causal: bool, window) -> tuple[int, int]:
    """Keys the query tile i0..i1-1 can see: all of them, or up to its last position (and from
    ``window`` positions before its first one)."""
    if not causal:
        return 0, Tk
    return (max(0, i0 + offset - window + 1) if window is not None else 0), min(Tk, i1 + offset)


def flash_forward(qs: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = True,
                  block_q: int = BLOCK_Q, block_k: int = BLOCK_K, out: np.ndarray | None = None,
                  window: int | None = None, bias=None):
    """qs (B, H, Tq, Dk) pre-scaled queries, k (B, H, Tk, Dk), v (B, H, Tk, Dv) ->
    (y (B, H, Tq, Dv), lse (B, H, Tq)). ``out`` receives y (it may be a strided view).
    ``window`` (causal only): each query sees at most that many positions, itself included.
    ``bias(rows, keys, dtype)`` -> (H, bq, bk): a positions scheme's score term, added to each
    tile's scores with its mask (positions.py)."""
    B, H, Tq, _ = qs.shape
    Tk, Dv = k.shape[2], v.shape[3]
    offset = Tk - Tq
    if window is not None and (not causal or Tk <= window):
        window = None                          # the band hides nothing: skip its bookkeeping
    dtype = qs.dtype
    y = np.empty((B, H, Tq, Dv), dtype) if out is None else out
    lse = np.empty((B, H, Tq), dtype)
    kT = k.transpose(0, 1, 3, 2)                                          # (B, H, Dk, Tk)
    for i0 in range(0, Tq, block_q):
        i1 = min(i0 + block_q, Tq)
        qi = qs[:, :, i0:i1]                                              # (B, H, bq, Dk)
        m = np.full((B, H, i1 - i0, 1), -np.inf, dtype)                   # running row max
        l = np.zeros((B, H, i1 - i0, 1), dtype)                           # running normaliser
        acc = np.zeros((B, H, i1 - i0, Dv), dtype)                        # unnormalised output
        for j0 in range(*_key_range(i0, i1, Tk, offset, causal, window), block_k):
            j1 = min(j0 + block_k, Tk)
            s = _scores(qi, kT[..., j0:j1], i0, i1, j0, j1, offset, causal, window, bias)   # (B, H, bq, bk)
            m_new = np.maximum(m, np.maximum.reduce(s, axis=-1, keepdims=True))
            shift = m_new
            if window is not None:
                # with a band, a row may have seen no key yet (max -inf): shift it by 0, not -inf
                shift = np.where(m_new == -np.inf, dtype.type(0), m_new)
            s -= shift
            p = np.exp(s, out=s)                                          # P~, in the scores' memory
            c = np.exp(m - shift)                                         # rescales what came before
            l *= c
            l += np.add.reduce(p, axis=-1, keepdims=True)
            acc *= c
            acc += p @ v[:, :, j0:j1]
            m = m_new
        np.divide(acc, l, out=y[:, :, i0:i1])
        lse[:, :, i0:i1] = (m + np.log(l))[..., 0]
    return y, lse


def flash_backward(dy: np.ndarray, qs: np.ndarray, k: np.ndarray, v: np.ndarray, y: np.ndarray,
                   lse: np.ndarray, causal: bool = True, block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                   out: tuple | None = None, window: int | None = None, bias=None):
    """Gradients of the scalar behind dy (B, H, Tq, Dv) with respect to qs, k and v, recomputing
    each tile's probabilities from lse. Returns (dqs, dk, dv); ``out`` = three arrays to write
    them into (views are fine). ``bias``: as in :func:`flash_forward`, added again where P is
    recomputed."""
    B, H, Tq, _ = qs.shape
    Tk = k.shape[2]
    offset = Tk - Tq
    dtype = qs.dtype
    if window is not None and (not causal or Tk <= window):
        window = None
    if out is None:
        out = (np.empty_like(qs), np.empty(k.shape, dtype), np.empty(v.shape, dtype))
    dqs, dk, dv = out
    dqs[...] = 0
    dk[...] = 0
    dv[...] = 0
    D = np.add.reduce(dy * y, axis=-1, keepdims=True)                    # (B, H, Tq, 1)
    L = lse[..., None]                                                    # (B, H, Tq, 1)
    vT = v.transpose(0, 1, 3, 2)                                          # (B, H, Dv, Tk)
    for j0 in range(0, Tk, block_k):
        j1 = min(j0 + block_k, Tk)
        kj = k[:, :, j0:j1]                                               # (B, H, bk, Dk)
        first = max(0, j0 - offset) // block_q * block_q if causal else 0   # tiles above: all masked
        last = Tq if window is None else min(Tq, j1 - 1 - offset + window)  # tiles below the band
        for i0 in range(first, last, block_q):
            i1 = min(i0 + block_q, Tq)
            s = _scores(qs[:, :, i0:i1], kj.transpose(0, 1, 3, 2), i0, i1, j0, j1, offset, causal, window, bias)
            s -= L[:, :, i0:i1]
            p = np.exp(s, out=s)                                          # exact P from the saved lse
            dy_i = dy[:, :, i0:i1]
            dv[:, :, j0:j1] += p.transpose(0, 1, 3, 2) @ dy_i
            dp = dy_i @ vT[..., j0:j1]                                    # (B, H, bq, bk)
            dp -= D[:, :, i0:i1]
            dp *= p                                                       # dS
            dqs[:, :, i0:i1] += dp @ kj
            dk[:, :, j0:j1] += dp.transpose(0, 1, 3, 2) @ qs[:, :, i0:i1]
    return dqs, dk, dv


class Flash:
    """The attention kernel (kernels.py's signature) computing the same numbers in tiles,
    keeping only each row's log-sum-exp L (B, H, Tq); ``tiles`` = (block_q, block_k)."""

    def __init__(self, causal: bool = True, window: int | None = None, tiles: tuple = (BLOCK_Q, BLOCK_K),
                 bias=None):
        self.causal, self.window, self.tiles, self.bias = causal, window, tiles, bias

    def forward(self, qs, k, v, out, key_mask=None, drop=None):
        if key_mask is not None or drop is not None:
            raise ValueError("flash attention takes no key padding mask and no dropout; use the dense kernel")
        return flash_forward(qs, k, v, self.causal, *self.tiles, out=out, window=self.window, bias=self.bias)[1]

    def backward(self, dy, qs, k, v, y, saved, out) -> None:
        flash_backward(dy, qs, k, v, y, saved, self.causal, *self.tiles, out=out, window=self.window,
                       bias=self.bias)

    def weights(self, qs, k, saved) -> np.ndarray:
        """P = exp(S - L): exactly the probabilities the forward used, recomputed."""
        s = qs @ k.transpose(0, 1, 3, 2)                                   # (B, H, T, T)
        if self.causal:
            T = s.shape[-1]
            s += causal_mask(T, 0, s.dtype, self.window if self.window and T > self.window else None)
        if self.bias is not None:
            add_bias(s, self.bias, np.arange(s.shape[2]) + s.shape[3] - s.shape[2], np.arange(s.shape[3]))
        s -= saved[..., None]
        return np.exp(s, out=s)


# one BLAS thread: a second slows its small tile products down (T = 2048, batch 1: 0.78 s a step
# with two threads, 0.58-0.63 s with one; benchmarks/speed/long_context.py --blas-threads 1)
@registry.kernel("flash", auto_from=FLASH_FROM_T, one_thread=True)
def _flash(causal: bool, window, rows: int, tiles: tuple | None, bias):
    return Flash(causal, window, tiles or (BLOCK_Q, BLOCK_K), bias)


def _tiled(C: int, H: int, causal: bool, rng, dtype):
    """An attention layer on the flash kernel in tiles of 2 query x 3 key rows (a gradcheck case)."""
    return CausalSelfAttention(C, H, 4, C // H, rng, dtype, True, causal, impl="flash", tiles=(2, 3))


VARIANT = registry.declare(Variant(
    key="flash", name="the flash kernel", active=lambda cfg: cfg.attn_kernel == "flash", axis="attn_impl",
    summary=f"flash computes the same numbers in tiles with O(T) memory (auto: from a context of {FLASH_FROM_T:,}).",
    refuses={"dropout": "dropout needs whole rows of attention weights; the flash kernel has tiles (attn_impl "
                        "auto or dense)"},
    # one log-sum-exp per head and row instead of a T-long row of probabilities, and one
    # tile of scores and probabilities at a time
    activations=lambda cfg: cfg.n_layer * 2 * cfg.n_head * (1 - cfg.n_ctx) + 2 * cfg.n_head * BLOCK_K,
    # tiles of 2 query x 3 key rows over T = 5: several tiles, a partial one, the diagonal
    layer_cases=(("attention [flash]", lambda C, H, rng, dtype: _tiled(C, H, True, rng, dtype)),
                 ("attention [flash, non-causal]", lambda C, H, rng, dtype: _tiled(C, H, False, rng, dtype))),
    model_cases=(("gpt [flash]", {"attn_impl": "flash"}),),
))
