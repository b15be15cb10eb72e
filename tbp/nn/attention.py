"""Multi-head (causal) self-attention.   [paper §3-4]"""
from __future__ import annotations

import numpy as np

from .linear import Linear
from .module import Module


_MASKS: dict = {}


def causal_mask(Tq: int, q_pos0: int, dtype) -> np.ndarray:
    """(Tq, q_pos0 + Tq) additive mask for queries at positions q_pos0 ...: 0 where key j <= the
    query's position, -inf after it. Cached (read-only): training reuses one shape every step."""
    key = (Tq, q_pos0, np.dtype(dtype))
    mask = _MASKS.get(key)
    if mask is None:
        future = np.arange(q_pos0 + Tq)[None, :] > (q_pos0 + np.arange(Tq))[:, None]
        mask = np.where(future, -np.inf, 0).astype(dtype)
        mask.flags.writeable = False
        if len(_MASKS) >= 8:            # prefill chunks bring new shapes: keep the cache small
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


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

    def _heads(self, qkv: np.ndarray):
        """(B, T, H*(2Dk+Dv)) -> q (B, H, T, Dk), k (B, H, T, Dk), v (B, H, T, Dv) views."""
        B, T, _ = qkv.shape
        H, Dk, Dv = self.H, self.Dk, self.Dv
        q = qkv[..., :H * Dk].reshape(B, T, H, Dk).transpose(0, 2, 1, 3)
        k = qkv[..., H * Dk:2 * H * Dk].reshape(B, T, H, Dk).transpose(0, 2, 1, 3)
        v = qkv[..., 2 * H * Dk:].reshape(B, T, H, Dv).transpose(0, 2, 1, 3)
        return q, k, v

    def _softmax_rows(self, att: np.ndarray) -> np.ndarray:
        """In place: mask keys after each query (when causal), then softmax over keys.  att: (B, H, T, T)."""
        if self.causal:
            att += causal_mask(att.shape[-2], 0, att.dtype)
        # ufunc reductions directly: .max()/.sum() add a Python wrapper per call
        att -= np.maximum.reduce(att, axis=-1, keepdims=True)
        np.exp(att, out=att)
        att /= np.add.reduce(att, axis=-1, keepdims=True)
        return att

    def _heads_view(self, merged: np.ndarray, D: int) -> np.ndarray:
        """(B, T, H*D) -> (B, H, T, D) view: heads side by side is the layout c_proj reads."""
        B, T, _ = merged.shape
        return merged.reshape(B, T, self.H, D).transpose(0, 2, 1, 3)

    def forward(self, x: np.ndarray) -> np.ndarray:
        q, k, v = self._heads(self.c_attn.forward(x))
        B, H, T, _ = q.shape
        qs = q * self.scale               # (B, H, T, Dk): scaling q is cheaper than scaling S
        att = qs @ k.transpose(0, 1, 3, 2)                                 # (B, H, T, T)
        att = self._softmax_rows(att)                                      # (B, H, T, T)
        merged = np.empty((B, T, H * self.Dv), dtype=att.dtype)            # heads side by side
        y = self._heads_view(merged, self.Dv)                              # (B, H, T, Dv) view
        np.matmul(att, v, out=y)
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
        """
        qs, k, v, att, y = self.cache
        B, H, T, _ = qs.shape
        Dk, Dv = self.Dk, self.Dv
        dy = self._heads_view(self.c_proj.backward(dout), Dv)              # (B, H, T, Dv) view
        # the three input gradients are written straight into their columns of dqkv
        dqkv = np.empty((B, T, H * (2 * Dk + Dv)), dtype=dout.dtype)      # (B, T, H*(2Dk+Dv))
        dq, dk, dv = self._heads(dqkv)
        np.matmul(att.transpose(0, 1, 3, 2), dy, out=dv)                   # (B, H, T, Dv)
        datt = dy @ v.transpose(0, 1, 3, 2)                                # (B, H, T, T)
        datt -= np.add.reduce(dy * y, axis=-1, keepdims=True)             # (B, H, T, 1) broadcast
        datt *= att                                                        # dS w.r.t. qs k^T
        np.matmul(datt, k, out=dq)                                         # (B, H, T, Dk)
        dq *= self.scale
        np.matmul(datt.transpose(0, 1, 3, 2), qs, out=dk)                  # (B, H, T, Dk)
        return self.c_attn.backward(dqkv)                                  # (B, T, C)
