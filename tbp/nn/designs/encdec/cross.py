"""Cross-attention: the decoder's stream asks, the encoder's output answers.
[Vaswani et al. 2017, §3.2.3: encoder-decoder attention]"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ...attention import decode_attend, split_heads
from ...kernels import Dense
from ...linear import Linear, weight_of
from ...module import DecodeState, Module


class CrossAttention(Module):
    """y = c_proj(concat_h softmax(q_h k_h^T / sqrt(Dk) + pad) v_h),  q = c_q(x), [k | v] = c_kv(m).

    x (B, Tq, C): the decoder's stream, which asks; m (B, Tk, C): the encoder's output, which
    answers, Tk != Tq in general. No causal mask: every target position may read the whole
    source. ``key_mask`` (B, 1, 1, Tk), -inf on padded source positions. c_q.weight:
    (C, H*Dk); c_kv.weight: (C, H*(Dk+Dv)), columns [all keys | all values], head-major;
    c_proj.weight: (H*Dv, C). The kernel is the dense one (kernels.py).
    """

    def __init__(self, d_model: int, n_head: int, d_qk: int, d_v: int, rng: np.random.Generator,
                 dtype=np.float32, bias: bool = True, proj_std: float = 0.02):
        super().__init__()
        self.n_head, self.d_qk, self.d_v = n_head, d_qk, d_v
        self.kernel = Dense()
        self.c_q = Linear(d_model, n_head * d_qk, rng, dtype, bias)
        self.c_kv = Linear(d_model, n_head * (d_qk + d_v), rng, dtype, bias)
        self.c_proj = Linear(n_head * d_v, d_model, rng, dtype, bias, std=proj_std)
        self.scale = np.dtype(dtype).type(1.0 / np.sqrt(d_qk))

    def _kv(self, kv: np.ndarray):
        """(B, Tk, H*(Dk+Dv)) -> k (B, H, Tk, Dk), v (B, H, Tk, Dv) views."""
        split = self.n_head * self.d_qk
        return split_heads(kv[..., :split], self.n_head, self.d_qk), split_heads(kv[..., split:], self.n_head, self.d_v)

    def forward(self, x: np.ndarray, m: np.ndarray, key_mask: np.ndarray | None = None) -> np.ndarray:
        q = split_heads(self.c_q.forward(x), self.n_head, self.d_qk)       # (B, H, Tq, Dk)
        k, v = self._kv(self.c_kv.forward(m))                              # (B, H, Tk, Dk|Dv)
        qs = q * self.scale
        B, H, Tq, _ = qs.shape
        merged = np.empty((B, Tq, H * self.d_v), dtype=qs.dtype)
        y = split_heads(merged, H, self.d_v)                               # (B, H, Tq, Dv) view
        att = self.kernel.forward(qs, k, v, y, key_mask)                   # (B, H, Tq, Tk)
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
        dy = split_heads(self.c_proj.backward(dout), H, self.d_v)          # (B, H, Tq, Dv)
        dq_flat = np.empty((B, Tq, H * self.d_qk), dtype=dout.dtype)
        dkv = np.empty((B, Tk, H * (self.d_qk + self.d_v)), dtype=dout.dtype)
        dq = split_heads(dq_flat, H, self.d_qk)
        dk, dv = self._kv(dkv)
        self.kernel.backward(dy, qs, k, v, y, att, (dq, dk, dv))
        dq *= self.scale
        return self.c_q.backward(dq_flat), self.c_kv.backward(dkv)

    def weights(self) -> np.ndarray:
        """P (B, H, Tq, Tk) of the last forward: what each target position read in the source."""
        return self.cache[3].copy()

    # --- inference (decode.py) --------------------------------------------------------------
    def fold(self, ln) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(c_q with ``ln`` folded in and the scale 1/sqrt(Dk) applied, (C+1, H Dk); c_proj's
        weight (H Dv, C); its bias or None)."""
        q = ln.fold(weight_of(self.c_q), self.c_q.params.get("bias"),
                    col_scale=np.full(self.c_q.d_out, 1.0 / np.sqrt(self.d_qk)))
        return q, weight_of(self.c_proj), self.c_proj.params.get("bias")

    def decode_state(self, ln, batch: int, n_ctx: int, dtype) -> DecodeState:
        """The folded weights; the source's keys and values come with :meth:`read_source`."""
        H, Dk, Dv = self.n_head, self.d_qk, self.d_v

        def scratch(Tn: int) -> SimpleNamespace:
            s = SimpleNamespace(cq=np.empty((batch * Tn, H * Dk), dtype),      # scaled queries
                                att=np.empty((batch, H, Tn, n_ctx), dtype),
                                rowmax=np.empty((batch, H, Tn, 1), dtype),
                                ysum=np.empty((batch, H, Tn, Dv + 1), dtype),
                                ya=np.empty((batch * Tn, H * Dv), dtype))
            s.cq_h = s.cq.reshape(batch, Tn, H, Dk).transpose(0, 2, 1, 3)      # (B, H, Tn, Dk)
            s.ysum_v, s.ysum_p = s.ysum[..., :-1], s.ysum[..., -1:]
            s.y = s.ya.reshape(batch, Tn, H, Dv).transpose(0, 2, 1, 3)
            return s
        state = DecodeState(lambda: self.fold(ln), scratch)
        state.keys = state.values = state.key_mask = None
        return state

    def read_source(self, state: DecodeState, m: np.ndarray, key_mask: np.ndarray | None) -> None:
        """The cross-attention cache of one layer, computed once per source m (B, Tk, C): keys
        (B, H, Dk, Tk) (transposed, as the self-attention cache) and values (B, H, Tk, Dv + 1),
        last column ones; ``key_mask`` (B, 1, 1, Tk) of the source's padding, or None."""
        kv = m @ weight_of(self.c_kv)                                     # (B, Tk, H(Dk+Dv))
        if "bias" in self.c_kv.params:
            kv += self.c_kv.params["bias"]
        k, v = self._kv(kv)
        values = np.ones(v.shape[:-1] + (self.d_v + 1,), v.dtype)
        values[..., :-1] = v
        state.keys, state.values, state.key_mask = np.ascontiguousarray(k.transpose(0, 1, 3, 2)), values, key_mask

    def decode(self, rows, state: DecodeState, step) -> None:
        """rows.out = c_proj(attention of the new rows to the whole source).   [Vaswani §3.2.3]"""
        s = state.scratch(step.t1 - step.t0)
        q_w, proj, proj_b = state.folded
        np.dot(rows.xa, q_w, out=s.cq)                              # (N, H Dk), scaled queries
        att = s.att[..., :state.keys.shape[-1]]                     # (B, H, Tn, Tk)
        np.matmul(s.cq_h, state.keys, out=att)
        if state.key_mask is not None:
            att += state.key_mask
        decode_attend(att, state.values, s)
        np.dot(s.ya, proj, out=rows.out)
        if proj_b is not None:
            rows.out += proj_b
