"""Autoregressive inference with a key/value cache.   [paper §3.2, the KV cache]

Decoding one token at a time does little arithmetic per step (a few matrix-vector products),
so its cost is the number of NumPy calls, each a microsecond or more of fixed overhead. The
``Decoder`` therefore works on a snapshot of the model prepared for inference:

- each layer norm's gain and bias are folded into the linear layer that reads it,
  (xhat * g + b) @ W + c = xhat @ (g[:, None] * W) + (b @ W + c), and that layer's bias rides
  along as one more row of its matrix, multiplied by a constant-1 column kept at the end of
  the normalised input: layer norm's affine step and the bias cost no call at all;
- the attention scale 1/sqrt(Dk) is folded into the query columns of c_attn, and GELU's
  factor 1/2 into the columns of c_fc;
- LoRA adapters are merged into their base weights;
- every intermediate lives in a buffer allocated once and written with ``out=``.

Only the three matrices that read a layer norm (c_attn, c_fc, the head) are copied; the
output projections and the embeddings are the model's own arrays. The result equals
``GPT.forward`` up to rounding (float64: ~1e-14; float32: ~1e-6 relative);
``tests/test_generate.py`` checks this at every step.
"""
from __future__ import annotations

import numpy as np

from .attention import causal_mask
from .linear import LoRA
from .mlp import _GELU_A, _GELU_K


def _weight(layer) -> np.ndarray:
    """A Linear's (in, out) weight, with a LoRA adapter merged in."""
    return layer.merged() if isinstance(layer, LoRA) else layer.params["weight"]


def _fold(W: np.ndarray, b, gain, shift, col_scale=None) -> np.ndarray:
    """(in + 1, out) matrix M with [xhat, 1] @ M == ((xhat * gain + shift) @ W + b) * col_scale.

    ``col_scale`` (out,) scales output columns: the attention scale on the queries, GELU's 1/2.
    """
    d_in, d_out = W.shape
    M = np.empty((d_in + 1, d_out), W.dtype)
    np.multiply(W, gain[:, None], out=M[:d_in])
    M[d_in] = 0 if shift is None else np.dot(shift, W)
    if b is not None:
        M[d_in] += b
    if col_scale is not None:
        M *= col_scale.astype(W.dtype)
    return M


class _Layer:
    """One block's weights for decoding: attn (C+1, H(2Dk+Dv)) and fc (C+1, 4C) folded,
    proj (HDv, C) and mlp (4C, C) with their biases as the model holds them."""

    def __init__(self, block):
        attn, mlp = block.attn, block.mlp
        H, Dk = attn.H, attn.Dk
        qscale = np.ones(attn.c_attn.d_out)
        qscale[:H * Dk] = 1.0 / np.sqrt(Dk)
        ln1, ln2 = block.ln_1.params, block.ln_2.params
        self.attn = _fold(_weight(attn.c_attn), attn.c_attn.params.get("bias"),
                          ln1["weight"], ln1.get("bias"), col_scale=qscale)
        half = np.full(mlp.c_fc.d_out, 0.5) if mlp.activation == "gelu" else None
        self.fc = _fold(_weight(mlp.c_fc), mlp.c_fc.params.get("bias"), ln2["weight"], ln2.get("bias"),
                        col_scale=half)
        self.proj, self.proj_b = _weight(attn.c_proj), attn.c_proj.params.get("bias")
        self.mlp, self.mlp_b = _weight(mlp.c_proj), mlp.c_proj.params.get("bias")
        self.eps = (block.ln_1.eps, block.ln_2.eps)
        self.norms = None                         # the two layer norms' mean vectors, set by the Decoder


class _Buffers:
    """Every intermediate of one forward over N = B * Tn new rows, with the views into them."""

    def __init__(self, B: int, Tn: int, C: int, H: int, Dk: int, Dv: int, d_ff: int,
                 V: int, n_ctx: int, dtype):
        N = B * Tn
        self.x = np.empty((N, C), dtype)                 # the residual stream
        self.mu = np.empty((N, 1), dtype)                # layer-norm mean
        self.var = np.empty((N, 1), dtype)               # variance + eps, then its square root
        self.xc = np.empty((N, C), dtype)                # centred input
        self.sq = np.ones((N, C + 1), dtype)             # [xc^2, 1]: the 1 brings in eps
        self.xa = np.ones((N, C + 1), dtype)             # [xhat, 1]: the 1 brings in the bias
        self.sq_c, self.xa_c = self.sq[:, :C], self.xa[:, :C]
        self.qkv = np.empty((N, H * (2 * Dk + Dv)), dtype)
        heads = self.qkv.reshape(B, Tn, 2 * H * Dk + H * Dv)
        self.q = heads[..., :H * Dk].reshape(B, Tn, H, Dk).transpose(0, 2, 1, 3)          # (B, H, Tn, Dk)
        self.k = heads[..., H * Dk:2 * H * Dk].reshape(B, Tn, H, Dk).transpose(0, 2, 3, 1)  # (B, H, Dk, Tn)
        self.v = heads[..., 2 * H * Dk:].reshape(B, Tn, H, Dv).transpose(0, 2, 1, 3)      # (B, H, Tn, Dv)
        self.att = np.empty((B, H, Tn, n_ctx), dtype)    # scores, then probabilities (unnormalised)
        self.rowmax = np.empty((B, H, Tn, 1), dtype)     # max of each score row
        self.ysum = np.empty((B, H, Tn, Dv + 1), dtype)  # [sum_j p_j v_j, sum_j p_j]
        self.ysum_v, self.ysum_p = self.ysum[..., :-1], self.ysum[..., -1:]
        self.ya = np.empty((N, H * Dv), dtype)           # heads side by side
        self.y = self.ya.reshape(B, Tn, H, Dv).transpose(0, 2, 1, 3)               # (B, H, Tn, Dv)
        self.out = np.empty((N, C), dtype)               # a sublayer's output, before the residual
        self.u = np.empty((N, d_ff), dtype)
        self.t = np.empty((N, d_ff), dtype)
        self.ha = np.empty((N, d_ff), dtype)             # the activation
        self.logits = np.empty((N, V), dtype)


class Decoder:
    """A GPT prepared for sampling: folded weights and a preallocated KV cache.   [paper §3.2]

    ``forward(idx)`` takes the next tokens idx (B, Tn) of B sequences, at positions
    ``length .. length + Tn - 1``, writes their keys and values into the cache and returns their
    logits (B, Tn, V). A prefill passes the whole prompt; each later step passes one token, and
    then costs one (Dk x t) row of attention per head against the t cached keys: linear in t.

    Cache per layer: keys (B, H, Dk, n_ctx), stored transposed so that each head's scores are
    one matrix-vector product over contiguous rows, and values (B, H, n_ctx, Dv + 1).
    The folded matrices are made when the Decoder is built: build a new one after changing
    the model's weights.

    A long prefill runs in chunks of query rows, so its (B, H, rows, n_ctx) attention scores
    stay under ``max_scores`` numbers (16 MiB in float32) whatever the batch and prompt.
    """

    max_scores = 1 << 22

    def __init__(self, model, batch: int = 1):
        cfg = model.config
        if not cfg.causal:
            raise ValueError("a KV cache needs causal attention: later tokens would change earlier outputs")
        self.model, self.B, self.dtype = model, batch, model.dtype
        attn = model.blocks[0].attn
        self.C, self.H, self.Dk, self.Dv = cfg.d_model, attn.H, attn.Dk, attn.Dv
        self.n_ctx, self.V, self.d_ff = cfg.n_ctx, cfg.vocab_size, model.blocks[0].mlp.c_fc.d_out
        self.gelu = model.blocks[0].mlp.activation == "gelu"
        dt = self.dtype
        self.wte = model.params["wte"]
        self.wpe = model.params["wpe"]
        self.layers = [_Layer(block) for block in model.blocks]
        lnf = model.ln_f.params
        if model.lm_head is None:
            self.head = _fold(self.wte.T, None, lnf["weight"], lnf.get("bias"))
        else:
            self.head = _fold(_weight(model.lm_head), model.lm_head.params.get("bias"),
                              lnf["weight"], lnf.get("bias"))
        L = len(self.layers)
        self.keys = np.zeros((L, batch, self.H, self.Dk, self.n_ctx), dt)
        # each value row carries a trailing 1: probabilities @ [v, 1] gives the weighted sum and
        # the softmax's normaliser in one product
        self.values = np.ones((L, batch, self.H, self.n_ctx, self.Dv + 1), dt)
        self.length = 0
        self._avg = {}
        for layer in self.layers:
            layer.norms = tuple(self._mean_vectors(eps) for eps in layer.eps)
        self._norm_f = self._mean_vectors(model.ln_f.eps)
        # query rows per prefill chunk, so that its scores stay under max_scores numbers
        self._chunk = max(1, self.max_scores // (batch * self.H * self.n_ctx))
        self._step = self._buffers(1)
        # with w = u / 2 (c_fc's columns carry the 1/2): gelu(u) = w (1 + tanh(2k w (1 + 4a w^2)))
        self._gelu = {k: dt.type(v) for k, v in (("8ka", 8 * _GELU_K * _GELU_A), ("2k", 2 * _GELU_K))}

    @staticmethod
    def cache_size(model, batch: int = 1) -> int:
        """Bytes of KV cache a Decoder for ``batch`` sequences allocates."""
        attn = model.blocks[0].attn
        return (len(model.blocks) * batch * model.config.n_ctx * attn.H * (attn.Dk + attn.Dv + 1)
                * model.dtype.itemsize)

    @property
    def cache_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def reset(self) -> None:
        """Forget every cached position (the memory stays allocated)."""
        self.length = 0

    def _buffers(self, Tn: int) -> _Buffers:
        return _Buffers(self.B, Tn, self.C, self.H, self.Dk, self.Dv, self.d_ff, self.V,
                        self.n_ctx, self.dtype)

    def _mean_vectors(self, eps: float):
        """(C, 1) column of 1/C, and (C+1, 1) column [1/C ..., eps] for mean(xc^2) + eps."""
        vecs = self._avg.get(eps)
        if vecs is None:
            avg = np.full((self.C, 1), 1.0 / self.C, self.dtype)
            vecs = self._avg[eps] = avg, np.append(avg, [[eps]], axis=0).astype(self.dtype)
        return vecs

    def forward(self, idx: np.ndarray, check: bool = True) -> np.ndarray:
        """Logits (B, Tn, V) of tokens idx (B, Tn) that continue the cached ones.

        ``check=False`` skips validating ids the caller knows are in range (a sampler's).
        The returned array is a buffer the next call overwrites: copy it to keep it.
        """
        t0 = self.length
        if check:
            idx = self.model.check_tokens(idx, t0)
            if idx.shape[0] != self.B:
                raise ValueError(f"this decoder holds {self.B} sequences, got {idx.shape[0]}")
        Tn = idx.shape[1]
        t1 = t0 + Tn
        if t1 > self.n_ctx:
            raise ValueError(f"KV cache holds {self.n_ctx} positions, asked for {t1}")
        rows = self._chunk
        if Tn > rows:                   # chunked prefill: each chunk attends to the ones before
            logits = np.empty((self.B, Tn, self.V), self.dtype)
            for s in range(0, Tn, rows):
                logits[:, s:s + rows] = self.forward(idx[:, s:s + rows], check=False)
            return logits
        buf = self._step if Tn == 1 else self._buffers(Tn)
        x = buf.x
        self.wte.take(idx.reshape(-1), axis=0, out=x)                          # (N, C)
        if Tn == 1:
            x += self.wpe[t0]
        else:
            x.reshape(self.B, Tn, self.C)[...] += self.wpe[t0:t1]
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            self._norm(buf, *layer.norms[0])
            self._attend(buf, layer, keys, values, t0, t1)
            self._norm(buf, *layer.norms[1])
            self._mlp(buf, layer)
        self._norm(buf, *self._norm_f)
        np.dot(buf.xa, self.head, out=buf.logits)
        self.length = t1
        return buf.logits.reshape(self.B, Tn, self.V)

    def _norm(self, buf: _Buffers, avg: np.ndarray, avg_eps: np.ndarray) -> None:
        """buf.xa[:, :C] = (x - mean) / sqrt(var + eps): six calls, whatever the batch.
        avg: (C, 1) column of 1/C; avg_eps: (C+1, 1), the same with eps appended."""
        np.dot(buf.x, avg, out=buf.mu)
        np.subtract(buf.x, buf.mu, out=buf.xc)
        np.multiply(buf.xc, buf.xc, out=buf.sq_c)
        np.dot(buf.sq, avg_eps, out=buf.var)                                    # var + eps
        np.sqrt(buf.var, out=buf.var)
        np.divide(buf.xc, buf.var, out=buf.xa_c)

    def _attend(self, buf: _Buffers, layer: _Layer, keys, values, t0: int, t1: int) -> None:
        """x += c_proj(attention of the new rows to positions 0 .. t1-1)."""
        np.dot(buf.xa, layer.attn, out=buf.qkv)                     # [q * scale | k | v], (N, .)
        keys[..., t0:t1] = buf.k
        values[:, :, t0:t1, :-1] = buf.v
        att = buf.att[..., :t1]                                     # (B, H, Tn, t1)
        np.matmul(buf.q, keys[..., :t1], out=att)
        if t1 - t0 > 1:
            att += causal_mask(t1 - t0, t0, self.dtype)
        np.maximum.reduce(att, axis=-1, keepdims=True, out=buf.rowmax)
        att -= buf.rowmax
        np.exp(att, out=att)
        # normalise the (Tn, Dv) output rather than the (Tn, t1) probabilities: fewer numbers
        np.matmul(att, values[:, :, :t1], out=buf.ysum)
        np.divide(buf.ysum_v, buf.ysum_p, out=buf.y)
        np.dot(buf.ya, layer.proj, out=buf.out)
        if layer.proj_b is not None:
            buf.out += layer.proj_b
        buf.x += buf.out

    def _mlp(self, buf: _Buffers, layer: _Layer) -> None:
        """x += c_proj(g(c_fc(xhat)))."""
        w, t = buf.u, buf.t
        np.dot(buf.xa, layer.fc, out=w)                             # GELU: w = u / 2; ReLU: u
        if self.gelu:                                               # w (1 + tanh(2k w (1 + 4a w^2)))
            np.multiply(w, w, out=t)
            t *= self._gelu["8ka"]
            t += self._gelu["2k"]
            t *= w
            np.tanh(t, out=t)
            t += 1
            np.multiply(t, w, out=buf.ha)
        else:
            np.maximum(w, 0, out=buf.ha)
        np.dot(buf.ha, layer.mlp, out=buf.out)
        if layer.mlp_b is not None:
            buf.out += layer.mlp_b
        buf.x += buf.out
