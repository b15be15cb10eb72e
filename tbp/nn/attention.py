"""Multi-head (causal) self-attention.   [paper §3-4]"""
from __future__ import annotations

import numpy as np

from . import gemm
from .flash import BLOCK_K, BLOCK_Q, flash_backward, flash_forward
from .linear import Linear, weight_of
from .module import Module
from .rope import Rotary, rotate


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
           out: np.ndarray | None = None) -> np.ndarray:
    """y = softmax(S + mask) v, the dense core every attention layer shares.   [paper §3.2]

    att: the scores S (B, H, Tq, Tk), already scaled and causally masked where that applies,
    turned into the probabilities P in place and returned; v (B, H, Tk, Dv); key_mask: an
    additive (B, 1, 1, Tk) mask, -inf on keys no query may read (padding); y is written to
    ``out`` (B, H, Tq, Dv). A row must keep at least one key.
    """
    if key_mask is not None:
        att += key_mask
    # ufunc reductions directly: .max()/.sum() add a Python wrapper per call
    att -= np.maximum.reduce(att, axis=-1, keepdims=True)
    np.exp(att, out=att)
    att /= np.add.reduce(att, axis=-1, keepdims=True)
    gemm.batched_matmul(att, v, out)
    return att


def attend_backward(dy: np.ndarray, qs: np.ndarray, k: np.ndarray, v: np.ndarray, att: np.ndarray,
                    y: np.ndarray, out: tuple) -> None:
    """The backward of S = qs k^T, y = softmax(S) v, into out = (dqs, dk, dv).   [paper §3.2, §4]

    dv = P^T dy;  dP = dy v^T;  dS = P * (dP - rowsum(dP * P));  dqs = dS k;  dk = dS^T qs.
    rowsum(dP * P) = rowsum(dy * y), since y = P v: a (Tq, Dv) product instead of (Tq, Tk).
    A masked key has P = 0 in every row, so its dk and dv rows are exactly zero, and dS
    vanishes wherever a mask is, with no special case. qs (B, H, Tq, Dk), k (B, H, Tk, Dk).
    """
    dq, dk, dv = out
    gemm.batched_matmul(att.transpose(0, 1, 3, 2), dy, dv)                 # (B, H, Tk, Dv)
    datt = gemm.batched_matmul(dy, v.transpose(0, 1, 3, 2))                # (B, H, Tq, Tk)
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
                         rows: int = SPLIT_ROWS) -> tuple:
    """Causal ``attend`` with the queries in blocks; returns each block's P.

    Queries [a, b) may read only keys [0, b), so block i's scores are (b - a, b): the masked
    part of S to the right of the block is never computed. With n blocks, S, the softmax and
    P v cost (n + 1) / 2n of the full square (3/4 for two), what flash attention's tiles skip
    as well, without its recomputation in the backward. qs, k (B, H, T, Dk); v (B, H, T, Dv);
    out (B, H, T, Dv); ``rows``: the blocks' size (query_blocks).
    """
    T = qs.shape[2]
    mask = causal_mask(T, 0, qs.dtype)
    blocks = []
    for a, b in query_blocks(T, rows):
        att = gemm.batched_matmul(qs[:, :, a:b], k[:, :, :b].transpose(0, 1, 3, 2))   # (B, H, b - a, b)
        att += mask[a:b, :b]
        blocks.append(attend(att, v[:, :, :b], out=out[:, :, a:b]))
    return tuple(blocks)


def attend_causal_blocks_backward(dy, qs, k, v, blocks: tuple, y, out: tuple, rows: int = SPLIT_ROWS) -> None:
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
                        y[:, :, q_rows], out=(dq[:, :, q_rows], dk_i, dv_i))
        if dk_i is not dk:
            dk[:, :, keys] += dk_i
            dv[:, :, keys] += dv_i


def padding_mask(pad: np.ndarray, dtype) -> np.ndarray:
    """(B, 1, 1, T) additive key mask from a boolean (B, T) ``pad`` (True: a padded position)."""
    return np.where(pad, -np.inf, 0).astype(dtype)[:, None, None, :]


class CausalSelfAttention(Module):
    """y = c_proj(concat_h softmax(mask(q_h k_h^T / sqrt(Dk))) v_h),  [q | k | v] = c_attn(x).

    x, y: (B, T, C); per head q, k: (T, Dk) and v: (T, Dv); c_attn.weight: (C, H*(2Dk+Dv)),
    columns ordered [all queries | all keys | all values], each head-major (GPT-2's layout when
    Dk = Dv = C/H); c_proj.weight: (H*Dv, C). Heads are computed together as (B, H, T, D)
    arrays: no Python loop over heads or tokens.

    ``impl``: "dense" keeps P (B, H, T, T) for the backward (causal, from T = 2 ``split_rows``
    on, as blocks of that many query rows that skip the masked part); "flash" computes the same numbers
    in tiles and keeps only each row's log-sum-exp (flash.py; ``tiles`` = (block_q, block_k)).
    ``rotary``: a Rotary, to rotate queries and keys by their positions (rope.py), or None.
    ``window``: each query attends to at most this many positions (itself and the ones before);
    rotary models set it to their context, so a sequence longer than the context is sliding-
    window attention -- exactly what the sliding KV cache computes. None: no limit.
    """

    def __init__(self, d_model: int, n_head: int, d_qk: int, d_v: int, rng: np.random.Generator,
                 dtype=np.float32, bias: bool = True, causal: bool = True, proj_std: float = 0.02,
                 impl: str = "dense", rotary: Rotary | None = None, tiles: tuple = (BLOCK_Q, BLOCK_K),
                 window: int | None = None, split_rows: int = SPLIT_ROWS):
        super().__init__()
        self.n_head, self.d_qk, self.d_v, self.causal = n_head, d_qk, d_v, causal
        self.split_rows = split_rows
        self.impl, self.rotary, self.tiles, self.window = impl, rotary, tiles, window
        self.c_attn = Linear(d_model, n_head * (2 * d_qk + d_v), rng, dtype, bias)
        self.c_proj = Linear(n_head * d_v, d_model, rng, dtype, bias, std=proj_std)
        self.scale = np.dtype(dtype).type(1.0 / np.sqrt(d_qk))   # a scalar of the model's dtype

    def _heads(self, qkv: np.ndarray):
        """(B, T, H*(2Dk+Dv)) -> q (B, H, T, Dk), k (B, H, T, Dk), v (B, H, T, Dv) views."""
        B, T, _ = qkv.shape
        H, Dk, Dv = self.n_head, self.d_qk, self.d_v
        q = qkv[..., :H * Dk].reshape(B, T, H, Dk).transpose(0, 2, 1, 3)
        k = qkv[..., H * Dk:2 * H * Dk].reshape(B, T, H, Dk).transpose(0, 2, 1, 3)
        v = qkv[..., 2 * H * Dk:].reshape(B, T, H, Dv).transpose(0, 2, 1, 3)
        return q, k, v

    def _heads_view(self, merged: np.ndarray, D: int) -> np.ndarray:
        """(B, T, H*D) -> (B, H, T, D) view: heads side by side is the layout c_proj reads."""
        B, T, _ = merged.shape
        return merged.reshape(B, T, self.n_head, D).transpose(0, 2, 1, 3)

    def forward(self, x: np.ndarray, key_mask: np.ndarray | None = None) -> np.ndarray:
        """x (B, T, C) -> (B, T, C). ``key_mask``: an additive (B, 1, 1, T) mask, -inf on padded
        keys (an encoder's padded source positions), 0 elsewhere; dense kernel only."""
        q, k, v = self._heads(self.c_attn.forward(x))
        if self.rotary is not None:
            q, k = self.rotary.forward(q), self.rotary.forward(k)          # (B, H, T, Dk) rotated
        B, H, T, _ = q.shape
        qs = q * self.scale               # (B, H, T, Dk): scaling q is cheaper than scaling S
        merged = np.empty((B, T, H * self.d_v), dtype=qs.dtype)            # heads side by side
        y = self._heads_view(merged, self.d_v)                             # (B, H, T, Dv) view
        if self.impl == "flash":
            if key_mask is not None:
                raise ValueError("flash attention takes no key padding mask; use the dense kernel")
            _, lse = flash_forward(qs, k, v, self.causal, *self.tiles, out=y, window=self.window)
            self.cache = qs, k, v, lse, y                                  # lse: (B, H, T)
        elif self.causal and T >= 2 * self.split_rows and key_mask is None and not (self.window and T > self.window):
            self.cache = qs, k, v, attend_causal_blocks(qs, k, v, y, self.split_rows), y  # P in query blocks
        else:
            att = gemm.batched_matmul(qs, k.transpose(0, 1, 3, 2))         # (B, H, T, T)
            if self.causal:
                att += causal_mask(T, 0, att.dtype, self.window if self.window and T > self.window else None)
            att = attend(att, v, key_mask, out=y)                          # (B, H, T, T)
            self.cache = qs, k, v, att, y
        return self.c_proj.forward(merged)                                 # (B, T, C)

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §3.2, §4]  With P = softmax(S), S = q k^T * scale, y = P v, per head:
        dv = P^T dy;  dP = dy v^T;  dS = P * (dP - rowsum(dP * P));
        dq = scale * dS k;  dk = scale * dS^T q.
        rowsum(dP * P) = rowsum(dy * y), since y = P v: a (T, Dv) product instead of (T, T).
        Masked entries have P = 0, so dS vanishes there with no special case.
        The key bias gets an exactly zero gradient in exact arithmetic: every row of dS sums to
        zero (softmax is invariant to a shift of its scores), so sum_t dk[t] = 0.
        Flash computes the same dS tile by tile from the saved log-sum-exp (flash.py); with
        rotary positions, dq and dk are rotated back (the transpose of the rotation).
        """
        qs, k, v, saved, y = self.cache
        B, H, T, _ = qs.shape
        Dk, Dv = self.d_qk, self.d_v
        dy = self._heads_view(self.c_proj.backward(dout), Dv)              # (B, H, T, Dv) view
        # the three input gradients are written straight into their columns of dqkv
        dqkv = np.empty((B, T, H * (2 * Dk + Dv)), dtype=dout.dtype)      # (B, T, H*(2Dk+Dv))
        dq, dk, dv = self._heads(dqkv)
        if self.impl == "flash":
            flash_backward(dy, qs, k, v, y, saved, self.causal, *self.tiles, out=(dq, dk, dv), window=self.window)
        elif isinstance(saved, tuple):
            attend_causal_blocks_backward(dy, qs, k, v, saved, y, (dq, dk, dv), self.split_rows)
        else:
            attend_backward(dy, qs, k, v, saved, y, out=(dq, dk, dv))
        dq *= self.scale
        if self.rotary is not None:
            dq[...] = self.rotary.backward(dq)
            dk[...] = self.rotary.backward(dk)
        return self.c_attn.backward(dqkv)                                  # (B, T, C)

    def weights(self) -> np.ndarray:
        """P (B, H, T, T), the attention weights of the last forward, for inspection: dense
        attention kept them; flash recomputes them from its saved log-sum-exp, P = exp(S - L),
        exactly the probabilities it used. Changes nothing the backward reads."""
        qs, k, v, saved, y = self.cache
        if isinstance(saved, tuple):                                       # causal query blocks
            T = qs.shape[2]
            P = np.zeros(qs.shape[:2] + (T, T), qs.dtype)
            for (a, b), block in zip(query_blocks(T, self.split_rows), saved):
                P[:, :, a:b, :b] = block
            return P
        if self.impl != "flash":
            return saved.copy()
        s = qs @ k.transpose(0, 1, 3, 2)                                   # (B, H, T, T)
        if self.causal:
            T = s.shape[-1]
            s += causal_mask(T, 0, s.dtype, self.window if self.window and T > self.window else None)
        s -= saved[..., None]
        return np.exp(s, out=s)

    # --- inference (the Decoder) ------------------------------------------------------------
    def fold(self, ln) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(c_attn with ``ln`` folded in and the scale 1/sqrt(Dk) in its query columns,
        (C+1, H(2Dk+Dv)); c_proj's weight (H Dv, C); its bias or None)."""
        qscale = np.ones(self.c_attn.d_out)
        qscale[:self.n_head * self.d_qk] = 1.0 / np.sqrt(self.d_qk)
        qkv = ln.fold(weight_of(self.c_attn), self.c_attn.params.get("bias"), col_scale=qscale)
        return qkv, weight_of(self.c_proj), self.c_proj.params.get("bias")

    def decode(self, buf, weights, keys: np.ndarray, values: np.ndarray, t0: int, t1: int,
               keep: np.ndarray | None = None, scores: np.ndarray | None = None) -> None:
        """buf.x += c_proj(attention of new rows t0 .. t1-1 to the cached ones).   [paper §3.2]

        keys (B, H, Dk, n_ctx): the cache, transposed so each head's scores are one product
        over contiguous memory; values (B, H, n_ctx, Dv + 1), whose last column is ones, so
        that p @ [v, 1] gives both the weighted sum and the softmax's normaliser. The new
        rows' keys and values are written into the cache first.

        Past the cache (t1 > n_ctx, one row at a time, rotary positions only) the cache is a
        ring: position t lives in slot t mod n_ctx, and the row attends to all n_ctx slots,
        the last n_ctx positions. Attention is a weighted sum over a set, so the order of the
        slots does not matter, and rotated keys carry their own positions.

        Sparse decoding (one row, within the cache; sparse.py): ``scores`` (B, H, 1, t1)
        receives the row's pre-softmax scores, from which the decoder picks a set; ``keep``,
        a set of cached positions, (B, K) for all heads or (B, H, K) per head, restricts the
        row's attention to those keys and values, gathered once for this layer.
        """
        qkv, proj, proj_b = weights
        np.dot(buf.xa, qkv, out=buf.qkv)                            # [q * scale | k | v], (N, .)
        if self.rotary is not None:                                 # rotate q and k in place
            rotate(buf.qk, buf.cos, buf.sin, out=buf.qk_rotated)
            buf.qk[...] = buf.qk_rotated
        n_ctx = keys.shape[-1]
        s0 = t0 % n_ctx if t1 > n_ctx else t0                       # first slot written
        span = min(t1, n_ctx)                                       # slots attended to
        keys[..., s0:s0 + t1 - t0] = buf.k
        values[:, :, s0:s0 + t1 - t0, :-1] = buf.v
        if keep is None:
            cached_k, cached_v = keys[..., :span], values[:, :, :span]
        else:                                                       # the kept positions only
            per_head = keep.ndim == 3
            cached_k = np.take_along_axis(keys, keep[:, :, None, :] if per_head else keep[:, None, None, :], -1)
            cached_v = np.take_along_axis(values, keep[:, :, :, None] if per_head else keep[:, None, :, None], 2)
            span = keep.shape[-1]
        att = buf.att[..., :span]                                   # (B, H, Tn, span)
        np.matmul(buf.q, cached_k, out=att)
        if scores is not None:
            scores[...] = att
        if t1 - t0 > 1:
            att += causal_mask(t1 - t0, t0, att.dtype)
        decode_attend(buf, att, cached_v, proj, proj_b)


def decode_attend(buf, att: np.ndarray, values: np.ndarray, proj: np.ndarray, proj_b) -> None:
    """The end of a decoding attention step, self or cross: buf.x += c_proj(softmax(att) v).

    att (B, H, Tn, S): the masked scores, a view into buf.att, exponentiated in place;
    values (B, H, S, Dv + 1) with a trailing column of ones, so that p @ [v, 1] gives both the
    weighted sum and the softmax's normaliser: the (Tn, Dv) output is normalised rather than
    the (Tn, S) probabilities, fewer numbers.
    """
    np.maximum.reduce(att, axis=-1, keepdims=True, out=buf.rowmax)
    att -= buf.rowmax
    np.exp(att, out=att)
    np.matmul(att, values, out=buf.ysum)
    np.divide(buf.ysum_v, buf.ysum_p, out=buf.y)
    np.dot(buf.ya, proj, out=buf.out)
    if proj_b is not None:
        buf.out += proj_b
    buf.x += buf.out


class CrossAttention(Module):
    """y = c_proj(concat_h softmax(q_h k_h^T / sqrt(Dk) + pad) v_h),  q = c_q(x), [k | v] = c_kv(m).
    [Vaswani et al. 2017, §3.2.3: encoder-decoder attention]

    x (B, Tq, C): the decoder's stream, which asks; m (B, Tk, C): the encoder's output, which
    answers, Tk != Tq in general. No causal mask: every target position may read the whole
    source. ``key_mask`` (B, 1, 1, Tk), -inf on padded source positions. c_q.weight:
    (C, H*Dk); c_kv.weight: (C, H*(Dk+Dv)), columns [all keys | all values], head-major;
    c_proj.weight: (H*Dv, C). The dense core is self-attention's (``attend``).
    """

    def __init__(self, d_model: int, n_head: int, d_qk: int, d_v: int, rng: np.random.Generator,
                 dtype=np.float32, bias: bool = True, proj_std: float = 0.02):
        super().__init__()
        self.n_head, self.d_qk, self.d_v = n_head, d_qk, d_v
        self.c_q = Linear(d_model, n_head * d_qk, rng, dtype, bias)
        self.c_kv = Linear(d_model, n_head * (d_qk + d_v), rng, dtype, bias)
        self.c_proj = Linear(n_head * d_v, d_model, rng, dtype, bias, std=proj_std)
        self.scale = np.dtype(dtype).type(1.0 / np.sqrt(d_qk))

    def _split(self, a: np.ndarray, D: int) -> np.ndarray:
        """(B, T, H*D) -> (B, H, T, D) view."""
        B, T, _ = a.shape
        return a.reshape(B, T, self.n_head, D).transpose(0, 2, 1, 3)

    def _kv(self, kv: np.ndarray):
        """(B, Tk, H*(Dk+Dv)) -> k (B, H, Tk, Dk), v (B, H, Tk, Dv) views."""
        split = self.n_head * self.d_qk
        return self._split(kv[..., :split], self.d_qk), self._split(kv[..., split:], self.d_v)

    def forward(self, x: np.ndarray, memory: np.ndarray, key_mask: np.ndarray | None = None) -> np.ndarray:
        q = self._split(self.c_q.forward(x), self.d_qk)                    # (B, H, Tq, Dk)
        k, v = self._kv(self.c_kv.forward(memory))                         # (B, H, Tk, Dk|Dv)
        qs = q * self.scale
        B, H, Tq, _ = qs.shape
        merged = np.empty((B, Tq, H * self.d_v), dtype=qs.dtype)
        y = self._split(merged, self.d_v)                                  # (B, H, Tq, Dv) view
        att = attend(qs @ k.transpose(0, 1, 3, 2), v, key_mask, out=y)   # (B, H, Tq, Tk)
        self.cache = qs, k, v, att, y
        return self.c_proj.forward(merged)                                 # (B, Tq, C)

    def backward(self, dout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Returns (dx, dm): the gradient reaches both streams.   [Vaswani §3.2.3; paper §3.2]

        With dS from ``attend_backward``: dq = scale dS k into the decoder, dx = dq c_q^T;
        dk = scale dS^T q and dv = P^T dy into the encoder, dm = [dk | dv] c_kv^T. A padded
        source key has P = 0 in every row, so its dk and dv rows, and its share of dm through
        them, are exactly zero.
        """
        qs, k, v, att, y = self.cache
        B, H, Tq, _ = qs.shape
        Tk = k.shape[2]
        dy = self._split(self.c_proj.backward(dout), self.d_v)             # (B, H, Tq, Dv)
        dq_flat = np.empty((B, Tq, H * self.d_qk), dtype=dout.dtype)
        dkv = np.empty((B, Tk, H * (self.d_qk + self.d_v)), dtype=dout.dtype)
        dq = self._split(dq_flat, self.d_qk)
        dk, dv = self._kv(dkv)
        attend_backward(dy, qs, k, v, att, y, out=(dq, dk, dv))
        dq *= self.scale
        return self.c_q.backward(dq_flat), self.c_kv.backward(dkv)

    def weights(self) -> np.ndarray:
        """P (B, H, Tq, Tk) of the last forward: what each target position read in the source."""
        return self.cache[3].copy()

    # --- inference (the Decoder) ------------------------------------------------------------
    def fold(self, ln) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(c_q with ``ln`` folded in and the scale 1/sqrt(Dk) applied, (C+1, H Dk); c_proj's
        weight (H Dv, C); its bias or None)."""
        q = ln.fold(weight_of(self.c_q), self.c_q.params.get("bias"),
                    col_scale=np.full(self.c_q.d_out, 1.0 / np.sqrt(self.d_qk)))
        return q, weight_of(self.c_proj), self.c_proj.params.get("bias")

    def memory(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The cross-attention cache of one layer, computed once per source: keys (B, H, Dk, Tk)
        (transposed, as the self-attention cache) and values (B, H, Tk, Dv + 1), last column ones."""
        kv = m @ weight_of(self.c_kv)                                     # (B, Tk, H(Dk+Dv))
        if "bias" in self.c_kv.params:
            kv += self.c_kv.params["bias"]
        k, v = self._kv(kv)
        values = np.ones(v.shape[:-1] + (self.d_v + 1,), v.dtype)
        values[..., :-1] = v
        return np.ascontiguousarray(k.transpose(0, 1, 3, 2)), values

    def decode(self, buf, weights, keys: np.ndarray, values: np.ndarray, key_mask: np.ndarray | None) -> None:
        """buf.x += c_proj(attention of the new rows to the whole source).   [Vaswani §3.2.3]"""
        q_w, proj, proj_b = weights
        np.dot(buf.xa, q_w, out=buf.cq)                             # (N, H Dk), scaled queries
        att = buf.att[..., :keys.shape[-1]]                         # (B, H, Tn, Tk)
        np.matmul(buf.cq_h, keys, out=att)
        if key_mask is not None:
            att += key_mask
        decode_attend(buf, att, values, proj, proj_b)
