"""Multi-head (causal) self-attention.   [paper §3-4]"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from . import registry
from .kernels import SPLIT_ROWS, causal_mask, kernel
from .linear import Linear, weight_of
from .module import DecodeState, Module
from .positions import LEARNED, Positions


def split_heads(merged: np.ndarray, H: int, D: int) -> np.ndarray:
    """(B, T, H*D) -> (B, H, T, D) view: heads side by side is the layout c_proj reads."""
    B, T, _ = merged.shape
    return merged.reshape(B, T, H, D).transpose(0, 2, 1, 3)


@registry.attention("standard")
class CausalSelfAttention(Module):
    """y = c_proj(concat_h softmax(mask(q_h k_h^T / sqrt(Dk))) v_h),  [q | k | v] = c_attn(x).

    x, y: (B, T, C); per head q, k: (T, Dk) and v: (T, Dv); c_attn.weight: (C, H*(2Dk+Dv)),
    columns ordered [all queries | all keys | all values], each head-major (GPT-2's layout when
    Dk = Dv = C/H); c_proj.weight: (H*Dv, C). Heads are computed together as (B, H, T, D)
    arrays: no Python loop over heads or tokens.

    ``impl`` picks the kernel once (kernels.py): "dense" keeps P (B, H, T, T) for the backward
    (causal: in query blocks of ``split_rows`` rows that skip the masked part); "flash"
    computes the same numbers in tiles (``tiles`` = (block_q, block_k); None: the kernel's
    own) and keeps only each row's log-sum-exp (designs/flash). ``positions`` (positions.py):
    what the model's positions scheme does in attention -- transform queries and keys
    (rotary), add a term to the scores -- or nothing (learned positions, the default).
    ``window``: each query attends to at most this many positions; a model without learned
    positions sets it to its context, so a sequence longer than the context is sliding-window
    attention -- exactly what the sliding KV cache computes. None: no limit.

    The keys and values are :attr:`kv_heads` heads, Hkv (here H, one per query head): a kind of
    attention whose query heads share them has fewer and says how they are read (the
    expansion and its transpose, :meth:`_expand` and :meth:`_reduce`; for decoding, the scratch's
    shapes and the cache's, :meth:`_scratch` and :meth:`_by_cache_head`).
    """

    def __init__(self, d_model: int, n_head: int, d_qk: int, d_v: int, rng: np.random.Generator,
                 dtype=np.float32, bias: bool = True, causal: bool = True, proj_std: float = 0.02,
                 impl: str = "dense", positions: Positions = LEARNED, tiles: tuple | None = None,
                 window: int | None = None, split_rows: int = SPLIT_ROWS):
        super().__init__()
        self.n_head, self.d_qk, self.d_v, self.causal = n_head, d_qk, d_v, causal
        self.impl, self.positions, self.window = impl, positions, window
        # the key bias adds one constant to every score of a row, which the softmax ignores: its
        # gradient is exactly zero, unless rotation by position makes the shift differ per key
        self.key_bias_inert = not positions.rotates
        self.kernel = kernel(impl, causal, window, split_rows, tiles, positions.bias)
        self.c_attn = Linear(d_model, (n_head + self.kv_heads) * d_qk + self.kv_heads * d_v, rng, dtype, bias)
        self.c_proj = Linear(n_head * d_v, d_model, rng, dtype, bias, std=proj_std)
        self.scale = np.dtype(dtype).type(1.0 / np.sqrt(d_qk))   # a scalar of the model's dtype

    @classmethod
    def from_config(cls, cfg, rng: np.random.Generator, dtype, layer: int, proj_std: float,
                    positions: Positions = LEARNED):
        """Layer ``layer`` of a model configured by ``cfg``, with the model's ``positions``
        (build.py makes both)."""
        return cls(cfg.d_model, cfg.n_head, cfg.d_qk, cfg.d_v, rng, dtype, cfg.bias, cfg.causal, proj_std,
                   cfg.attn_kernel, positions=positions, window=positions.window(cfg.n_ctx))

    @property
    def kv_heads(self) -> int:
        """Hkv, the key/value heads this layer computes and caches: here one per query head."""
        return self.n_head

    def _heads(self, qkv: np.ndarray):
        """(B, T, H*Dk + Hkv*(Dk+Dv)) -> q (B, H, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) views."""
        B, T, _ = qkv.shape
        H, Hkv, Dk, Dv = self.n_head, self.kv_heads, self.d_qk, self.d_v
        q = qkv[..., :H * Dk].reshape(B, T, H, Dk).transpose(0, 2, 1, 3)
        k = qkv[..., H * Dk:(H + Hkv) * Dk].reshape(B, T, Hkv, Dk).transpose(0, 2, 1, 3)
        v = qkv[..., (H + Hkv) * Dk:].reshape(B, T, Hkv, Dv).transpose(0, 2, 1, 3)
        return q, k, v

    def _heads_view(self, merged: np.ndarray, D: int) -> np.ndarray:
        return split_heads(merged, self.n_head, D)

    def _expand(self, k: np.ndarray, v: np.ndarray):
        """The keys and values as the kernel reads them, one per query head: here, themselves."""
        return k, v

    def _reduce(self, dk_heads: np.ndarray, dv_heads: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> None:
        """The transpose of :meth:`_expand`, into dk, dv: here the kernel wrote them directly."""

    def forward(self, x: np.ndarray, key_mask: np.ndarray | None = None, noise=None) -> np.ndarray:
        """x (B, T, C) -> (B, T, C). ``key_mask``: an additive (B, 1, 1, T) mask, -inf on padded
        keys (an encoder's padded source positions), 0 elsewhere; non-causal dense kernel only.
        ``noise``: dropout's (dropout.Noise), training only: the weights' mask is drawn here."""
        q, k, v = self._heads(self.c_attn.forward(x))
        q, k = self.positions.rotate(q, k)                                 # rotary: rotated copies
        B, H, T, _ = q.shape
        qs = q * self.scale               # (B, H, T, Dk): scaling q is cheaper than scaling S
        merged = np.empty((B, T, H * self.d_v), dtype=qs.dtype)            # heads side by side
        y = self._heads_view(merged, self.d_v)                             # (B, H, T, Dv) view
        k, v = self._expand(k, v)                                          # (B, H, T, Dk | Dv)
        drop = None if noise is None else noise.mask((H, T, T), qs.dtype)  # (B, H, T, T)
        saved = self.kernel.forward(qs, k, v, y, key_mask, drop)
        self.cache = qs, k, v, saved, y
        return self.c_proj.forward(merged)                                 # (B, T, C)

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §3.2, §4]  With P = softmax(S), S = q k^T * scale, y = P v, per head:
        dv = P^T dy;  dP = dy v^T;  dS = P * (dP - rowsum(dP * P));
        dq = scale * dS k;  dk = scale * dS^T q.
        rowsum(dP * P) = rowsum(dy * y), since y = P v: a (T, Dv) product instead of (T, T).
        Masked entries have P = 0, so dS vanishes there with no special case.
        The key bias gets an exactly zero gradient in exact arithmetic: every row of dS sums to
        zero (softmax is invariant to a shift of its scores), so sum_t dk[t] = 0.
        The kernel computes dS its own way (flash: tile by tile from the saved log-sum-exp);
        with rotary positions, dq and dk are rotated back (the transpose of the rotation). A
        positions bias on S has no parameter: dS is the same with it.
        """
        qs, k, v, saved, y = self.cache
        B, H, T, _ = qs.shape
        dy = self._heads_view(self.c_proj.backward(dout), self.d_v)        # (B, H, T, Dv) view
        # the three input gradients are written straight into their columns of dqkv
        dqkv = np.empty((B, T, self.c_attn.d_out), dtype=dout.dtype)
        dq, dk, dv = self._heads(dqkv)
        dk_heads, dv_heads = (dk, dv) if k.shape[1] == dk.shape[1] else (np.empty_like(k), np.empty_like(v))
        self.kernel.backward(dy, qs, k, v, y, saved, (dq, dk_heads, dv_heads))
        self._reduce(dk_heads, dv_heads, dk, dv)
        dq *= self.scale
        self.positions.rotate_back(dq, dk)
        return self.c_attn.backward(dqkv)                                  # (B, T, C)

    def weights(self) -> np.ndarray:
        """P (B, H, T, T), the attention weights of the last forward, for inspection (flash
        recomputes them from its log-sum-exp). Changes nothing the backward reads."""
        qs, k, _, saved, _ = self.cache
        return self.kernel.weights(qs, k, saved)

    # --- inference (decode.py) --------------------------------------------------------------
    def fold(self, ln) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(c_attn with ``ln`` folded in and the scale 1/sqrt(Dk) in its query columns,
        (C+1, H Dk + Hkv (Dk+Dv)); c_proj's weight (H Dv, C); its bias or None)."""
        qscale = np.ones(self.c_attn.d_out)
        qscale[:self.n_head * self.d_qk] = 1.0 / np.sqrt(self.d_qk)
        qkv = ln.fold(weight_of(self.c_attn), self.c_attn.params.get("bias"), col_scale=qscale)
        return qkv, weight_of(self.c_proj), self.c_proj.params.get("bias")

    @classmethod
    def key_value_heads(cls, cfg) -> int:
        """Hkv of this kind of attention in a model of ``cfg``: one per query head."""
        return cfg.n_head

    @classmethod
    def cache_numbers(cls, cfg) -> int:
        """Numbers of KV cache per sequence and layer: keys Hkv Dk and values Hkv (Dv + 1) per position."""
        return cfg.n_ctx * cls.key_value_heads(cfg) * (cfg.d_qk + cfg.d_v + 1)

    def decode_state(self, ln, batch: int, n_ctx: int, dtype) -> DecodeState:
        """What this layer keeps between decoding steps: its weights folded with ``ln``; keys
        (B, Hkv, n_ctx, Dk) and values (B, Hkv, n_ctx, Dv + 1), a position's numbers side by side,
        so that sparse decoding gathers K positions as K short rows (stored transposed, each
        kept key would cost Dk cache lines, and at K = n/16 the gather read as much memory as
        the dense product it replaced); the values' last column is ones, so that p @ [v, 1]
        gives both the weighted sum and the softmax's normaliser."""
        Hkv = self.kv_heads
        return DecodeState(lambda: self.fold(ln), lambda Tn: self._scratch(batch, Tn, n_ctx, dtype),
                           keys=np.zeros((batch, Hkv, n_ctx, self.d_qk), dtype),
                           values=np.ones((batch, Hkv, n_ctx, self.d_v + 1), dtype))

    def _scratch(self, B: int, Tn: int, n_ctx: int, dtype) -> SimpleNamespace:
        """The intermediates of one step over Tn new rows of B sequences, with views into them."""
        H, Hkv, Dk, Dv = self.n_head, self.kv_heads, self.d_qk, self.d_v
        s = SimpleNamespace()
        s.qkv = np.empty((B * Tn, self.c_attn.d_out), dtype)
        s.q, s.k, s.v = self._heads(s.qkv.reshape(B, Tn, -1))  # (B, H, Tn, Dk), (B, Hkv, Tn, Dk), (.., Dv)
        s.qk = s.qkv[:, :(H + Hkv) * Dk].reshape(B, Tn, H + Hkv, Dk)   # queries and keys, for rotary
        s.qk_rotated = np.empty_like(s.qk)
        s.att = np.empty((B, H, Tn, n_ctx), dtype)               # scores, then probabilities (unnormalised)
        s.rowmax = np.empty((B, H, Tn, 1), dtype)                # max of each score row
        s.ysum = np.empty((B, H, Tn, Dv + 1), dtype)             # [sum_j p_j v_j, sum_j p_j]
        s.ysum_v, s.ysum_p = s.ysum[..., :-1], s.ysum[..., -1:]
        s.ya = np.empty((B * Tn, H * Dv), dtype)                 # heads side by side
        s.y = s.ya.reshape(B, Tn, H, Dv).transpose(0, 2, 1, 3)   # (B, H, Tn, Dv)
        return s

    def _by_cache_head(self, cached: np.ndarray) -> np.ndarray:
        """Cached keys or values in the shape the scratch's products read them: here every
        query head has its own, so as they are."""
        return cached

    def _decode_rows(self, rows, state: DecodeState, step) -> None:
        _decode_rows_impl(self, rows, state, step)

    def decode(self, rows, state: DecodeState, step) -> None:
        """rows.out = c_proj(attention of the new rows t0 .. t1-1 to the cached ones).   [paper §3.2]

        The new rows' keys and values are written into the cache first. Past the cache (t1 >
        n_ctx, one row at a time, positions without a learned table only) the cache is a ring:
        position t lives in slot t mod n_ctx, and the row attends to all n_ctx slots, the last
        n_ctx positions. Attention is a weighted sum over a set, so the order of the slots does
        not matter: rotated keys carry their own positions, and a positions bias is given each
        slot's position (Step.slots).

        A decoding strategy (``step.strategy``, e.g. sparse decoding's, designs/sparse) is asked
        which keys and values the row reads before its scores, and shown the dense scores after
        them: it never enters as a branch on its name.
        """
        if step.positions is not None:
            self._decode_rows(rows, state, step)
            return
        t0, t1 = step.t0, step.t1
        s = state.scratch(t1 - t0)
        qkv, proj, proj_b = state.folded
        np.dot(rows.xa, qkv, out=s.qkv)                             # [q * scale | k | v], (N, .)
        if self.positions.rotates:                                  # rotary: q and k in place
            self.positions.rotate_rows(s.qk, s.qk_rotated, step)
        keys, values = state.keys, state.values
        n_ctx = keys.shape[2]
        s0 = t0 % n_ctx if t1 > n_ctx else t0                       # first slot written
        span = min(t1, n_ctx)                                       # slots attended to
        keys[:, :, s0:s0 + t1 - t0] = s.k
        values[:, :, s0:s0 + t1 - t0, :-1] = s.v
        thin = step.strategy             # a decoding strategy's hook (designs/sparse): which keys this row reads
        kept = None if thin is None else thin.cached(self, state, s, span, step)
        if kept is None:                                            # every cached position
            cached_k, cached_v = keys[:, :, :span], values[:, :, :span]
        else:
            cached_k, cached_v = kept
            span = cached_k.shape[2]
        att = s.att[..., :span]                                     # (B, H, Tn, span)
        np.matmul(s.q, self._by_cache_head(cached_k).swapaxes(-1, -2), out=att)
        if kept is None and self.positions.bias is not None:
            bias = step.once(("bias", self.positions), lambda: self.positions.bias(step.rows(), step.slots(span, n_ctx),
                                                                         att.dtype))
            att += bias.reshape(att.shape[1:])                      # (H, Tn, span), per head as att groups them
        if kept is None and thin is not None:
            thin.scored(self, state, att, step)                     # the strategy may choose from dense scores
        if t1 - t0 > 1:
            att += causal_mask(t1 - t0, t0, att.dtype)
        decode_attend(att, self._by_cache_head(cached_v), s)
        np.dot(s.ya, proj, out=rows.out)
        if proj_b is not None:
            rows.out += proj_b


def _decode_rows_impl(layer, rows, state: DecodeState, step) -> None:
    """One new token per sequence, each at its own position (``step.positions`` (B,)): sequences
    of different lengths decoded together (a server's concurrent requests). Row b writes its key
    and value at its position and attends to positions 0 .. positions[b]: the slots past that
    (another request's leftovers) are masked out. Within the context only, no sparse rule."""
    s = state.scratch(1)
    qkv, proj, proj_b = state.folded
    np.dot(rows.xa, qkv, out=s.qkv)
    if layer.positions.rotates:
        layer.positions.rotate_rows(s.qk, s.qk_rotated, step)
    pos = step.positions
    b = np.arange(pos.size)
    state.keys[b, :, pos] = s.k[:, :, 0]
    state.values[b, :, pos, :-1] = s.v[:, :, 0]
    span = step.t1
    att = s.att[..., :span]
    np.matmul(s.q, layer._by_cache_head(state.keys[:, :, :span]).swapaxes(-1, -2), out=att)
    att += step.row_mask(span).reshape((pos.size,) + (1,) * (att.ndim - 2) + (span,))
    if layer.positions.bias is not None:                            # (B, H, 1, span)
        bias = step.once(("bias", layer.positions), lambda: layer.positions.bias(step.rows(), np.arange(span), att.dtype))
        att += bias.reshape(att.shape)
    decode_attend(att, layer._by_cache_head(state.values[:, :, :span]), s)
    np.dot(s.ya, proj, out=rows.out)
    if proj_b is not None:
        rows.out += proj_b


def decode_attend(att: np.ndarray, values: np.ndarray, s) -> None:
    """s.y = softmax(att) v for a decoding step, self or cross.

    att (..., Tn, S): the masked scores, exponentiated in place; values (..., S, Dv + 1) with a
    trailing column of ones, so that p @ [v, 1] gives both the weighted sum ``s.ysum_v`` and
    the softmax's normaliser ``s.ysum_p`` (``s.ysum`` (..., Tn, Dv + 1)): the (Tn, Dv) output is
    normalised rather than the (Tn, S) probabilities, fewer numbers. ``s.rowmax`` (..., Tn, 1)
    is scratch.
    """
    np.maximum.reduce(att, axis=-1, keepdims=True, out=s.rowmax)
    att -= s.rowmax
    np.exp(att, out=att)
    np.matmul(att, values, out=s.ysum)
    np.divide(s.ysum_v, s.ysum_p, out=s.y)
