"""Multi-head (causal) self-attention and its key/value cache.   [paper §3-4]"""
from __future__ import annotations

import numpy as np

from .linear import Linear
from .module import Module


class KVCache:
    """Keys and values of one attention layer, preallocated to the context length.   [paper §3.2]

    k: (B, H, n_ctx, Dk); v: (B, H, n_ctx, Dv); ``length`` positions are filled.
    Memory: B * H * n_ctx * (Dk + Dv) numbers per layer.
    """

    def __init__(self, B: int, H: int, n_ctx: int, d_k: int, d_v: int, dtype):
        self.k = np.zeros((B, H, n_ctx, d_k), dtype=dtype)
        self.v = np.zeros((B, H, n_ctx, d_v), dtype=dtype)
        self.length = 0

    @staticmethod
    def size_bytes(B: int, H: int, n_ctx: int, d_k: int, d_v: int, dtype) -> int:
        """Memory of one layer's cache, without allocating it."""
        return B * H * n_ctx * (d_k + d_v) * np.dtype(dtype).itemsize


class CausalSelfAttention(Module):
    """y = c_proj(concat_h softmax(mask(q_h k_h^T / sqrt(Dk))) v_h),  [q | k | v] = c_attn(x).

    x, y: (B, T, C); per head q, k: (T, Dk) and v: (T, Dv); c_attn.weight: (C, H*(2Dk+Dv)),
    columns ordered [all queries | all keys | all values], each head-major (GPT-2's layout when
    Dk = Dv = C/H); c_proj.weight: (H*Dv, C). Heads are computed together as (B, H, T, D)
    arrays: no Python loop over heads or tokens.
    """

    def __init__(self, d_model: int, n_head: int, d_k: int, d_v: int, rng: np.random.Generator,
                 dtype=np.float32, bias: bool = True, causal: bool = True, proj_std: float = 0.02):
        super().__init__()
        self.H, self.Dk, self.Dv, self.causal = n_head, d_k, d_v, causal
        self.c_attn = self.add("c_attn", Linear(d_model, n_head * (2 * d_k + d_v), rng, dtype, bias))
        self.c_proj = self.add("c_proj", Linear(n_head * d_v, d_model, rng, dtype, bias, std=proj_std))
        self.scale = np.dtype(dtype).type(1.0 / np.sqrt(d_k))   # a scalar of the model's dtype
        self.collect()
        self.cache = None
        self._masks: dict = {}

    def _heads(self, qkv: np.ndarray):
        """(B, T, H*(2Dk+Dv)) -> q (B, H, T, Dk), k (B, H, T, Dk), v (B, H, T, Dv) views."""
        B, T, _ = qkv.shape
        H, Dk, Dv = self.H, self.Dk, self.Dv
        q = qkv[..., :H * Dk].reshape(B, T, H, Dk).transpose(0, 2, 1, 3)
        k = qkv[..., H * Dk:2 * H * Dk].reshape(B, T, H, Dk).transpose(0, 2, 1, 3)
        v = qkv[..., 2 * H * Dk:].reshape(B, T, H, Dv).transpose(0, 2, 1, 3)
        return q, k, v

    def _mask(self, Tq: int, Tk: int, q_pos0: int, dtype) -> np.ndarray:
        """(Tq, Tk) additive mask: 0 where key j <= query position q_pos0 + i, else -inf."""
        key = (Tq, Tk, q_pos0, np.dtype(dtype))
        if key not in self._masks:
            future = np.arange(Tk)[None, :] > (q_pos0 + np.arange(Tq))[:, None]
            if len(self._masks) > 8:
                self._masks.clear()
            self._masks[key] = np.where(future, -np.inf, 0).astype(dtype)
        return self._masks[key]

    def _softmax_rows(self, att: np.ndarray, q_pos0: int) -> np.ndarray:
        """In place: mask keys after each query (when causal), then softmax over keys.

        att: (B, H, Tq, Tk) scores of queries at positions q_pos0.. against keys at 0..Tk-1.
        """
        Tq, Tk = att.shape[-2:]
        if self.causal and Tq > 1:      # one query at the end of the keys sees them all
            att += self._mask(Tq, Tk, q_pos0, att.dtype)
        # ufunc reductions directly: .max()/.sum() add a Python wrapper per call
        att -= np.maximum.reduce(att, axis=-1, keepdims=True)
        np.exp(att, out=att)
        att /= np.add.reduce(att, axis=-1, keepdims=True)
        return att

    def _merge(self, y: np.ndarray) -> np.ndarray:
        """(B, H, T, Dv) -> (B, T, H*Dv): heads side by side, as c_proj expects."""
        B, H, T, Dv = y.shape
        return y.transpose(0, 2, 1, 3).reshape(B, T, H * Dv)

    def forward(self, x: np.ndarray) -> np.ndarray:
        q, k, v = self._heads(self.c_attn.forward(x))
        qs = q * self.scale               # (B, H, T, Dk): scaling q is cheaper than scaling S
        att = qs @ k.transpose(0, 1, 3, 2)                                 # (B, H, T, T)
        att = self._softmax_rows(att, 0)                                   # (B, H, T, T)
        y = att @ v                                                        # (B, H, T, Dv)
        self.cache = qs, k, v, att, y
        return self.c_proj.forward(self._merge(y))                         # (B, T, C)

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §3.2, §4]  With P = softmax(S), S = q k^T * scale, y = P v, per head:
        dv = P^T dy;  dP = dy v^T;  dS = P * (dP - rowsum(dP * P));
        dq = scale * dS k;  dk = scale * dS^T q.
        rowsum(dP * P) = rowsum(dy * y), since y = P v: a (T, Dv) product instead of (T, T).
        Masked entries have P = 0, so dS vanishes there with no special case.
        The key bias gets an exactly zero gradient in exact arithmetic: every row of dS sums to
        zero (softmax is invariant to a shift of its scores), so sum_t dk[t] = 0.
        """
        qs, k, v, att, y = self.cache
        B, H, T, _ = qs.shape
        Dk, Dv = self.Dk, self.Dv
        dy = self.c_proj.backward(dout)                                    # (B, T, H*Dv)
        dy = dy.reshape(B, T, H, Dv).transpose(0, 2, 1, 3)                 # (B, H, T, Dv)
        dv = att.transpose(0, 1, 3, 2) @ dy                                # (B, H, T, Dv)
        datt = dy @ v.transpose(0, 1, 3, 2)                                # (B, H, T, T)
        datt -= np.einsum("bhtd,bhtd->bht", dy, y)[..., None]             # (B, H, T, 1) broadcast
        datt *= att                                                        # dS w.r.t. qs k^T
        dq = datt @ k                                                      # (B, H, T, Dk)
        dq *= self.scale
        dk = datt.transpose(0, 1, 3, 2) @ qs                               # (B, H, T, Dk)
        dqkv = np.empty((B, T, H * (2 * Dk + Dv)), dtype=dout.dtype)      # (B, T, H*(2Dk+Dv))
        dqkv[..., :H * Dk] = dq.transpose(0, 2, 1, 3).reshape(B, T, H * Dk)
        dqkv[..., H * Dk:2 * H * Dk] = dk.transpose(0, 2, 1, 3).reshape(B, T, H * Dk)
        dqkv[..., 2 * H * Dk:] = self._merge(dv)
        return self.c_attn.backward(dqkv)                                  # (B, T, C)

    def new_cache(self, B: int, n_ctx: int) -> KVCache:
        return KVCache(B, self.H, n_ctx, self.Dk, self.Dv, self.params["c_attn.weight"].dtype)

    def cache_bytes(self, B: int, n_ctx: int) -> int:
        return KVCache.size_bytes(B, self.H, n_ctx, self.Dk, self.Dv, self.params["c_attn.weight"].dtype)

    def forward_cached(self, x: np.ndarray, cache: KVCache) -> np.ndarray:
        """Inference only: attend the new tokens x to themselves and everything cached.   [paper §3.2]

        x: (B, Tn, C) at positions cache.length ... cache.length + Tn - 1. Their keys and values
        are written into the cache; each new query row costs one (Dk x t) product against the
        cached keys, so a one-token step is linear in the cached length, never quadratic.
        """
        if not self.causal:
            raise ValueError("a KV cache needs causal attention: later tokens would change earlier outputs")
        Tn = x.shape[1]
        t0, t1 = cache.length, cache.length + Tn
        if t1 > cache.k.shape[2]:
            raise ValueError(f"KV cache holds {cache.k.shape[2]} positions, asked for {t1}")
        q, k, v = self._heads(self.c_attn.forward(x))
        cache.k[:, :, t0:t1] = k
        cache.v[:, :, t0:t1] = v
        cache.length = t1
        att = (q * self.scale) @ cache.k[:, :, :t1].transpose(0, 1, 3, 2)  # (B, H, Tn, t1)
        att = self._softmax_rows(att, t0)
        y = att @ cache.v[:, :, :t1]                                       # (B, H, Tn, Dv)
        self.cache = None
        return self.c_proj.forward(self._merge(y))                         # (B, Tn, C)
