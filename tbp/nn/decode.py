"""Autoregressive inference with a key/value cache.   [paper §3.2, the KV cache]

Decoding one token at a time does little arithmetic per step (a few matrix-vector products),
so its cost is the number of NumPy calls, each a microsecond or more of fixed overhead. Each
layer therefore has an inference form beside its forward and backward, on weights prepared
once (``fold``) and buffers allocated once (``decode``):

- each layer norm's gain and bias are folded into the linear layer that reads it
  (``LayerNorm.fold``), and that layer's bias rides along as one more row of its matrix,
  read by a constant-1 column after the normalised input: the affine step and the bias cost
  no call at all;
- the attention scale 1/sqrt(Dk) is folded into the query columns of c_attn;
- LoRA adapters are merged into their base weights.

The ``Decoder`` holds only the buffers, the cache and the order of the calls. Only the
matrices that read a layer norm (c_attn, c_fc, the head) are copied; the output projections
and the embeddings are the model's own arrays. The result equals ``GPT.forward`` up to
rounding (float64: ~1e-14; float32: ~1e-6 relative); ``tests/test_generate.py`` checks this
at every step.
"""
from __future__ import annotations

import numpy as np

from .attnres import StackedSources
from .linear import weight_of
from .sparse import select


def kv_cache_bytes(cfg, batch: int, dtype) -> int:
    """Bytes of the cache: keys (L, B, H, Dk, n_ctx) and values (L, B, H, n_ctx, Dv + 1)."""
    return cfg.n_layer * batch * cfg.n_ctx * cfg.n_head * (cfg.d_qk + cfg.d_v + 1) * np.dtype(dtype).itemsize


class _Buffers:
    """Every intermediate of one forward over N = B * Tn new rows, with the views into them.
    The layers' ``decode`` methods read and write these fields by name."""

    def __init__(self, B: int, Tn: int, C: int, H: int, Dk: int, Dv: int, d_ff: int,
                 V: int, n_ctx: int, dtype):
        N = B * Tn
        self.x = np.empty((N, C), dtype)                 # the residual stream
        self.mean = np.empty((N, 1), dtype)              # layer norm: mean
        self.std = np.empty((N, 1), dtype)               # variance + eps, then its square root
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
        self.u = np.empty((N, d_ff), dtype)              # c_fc's output
        self.g = np.empty((N, d_ff), dtype)              # the activation (GELU's gate first)
        self.logits = np.empty((N, V), dtype)
        # rotary positions: queries and keys side by side, rotated through a scratch copy
        self.qk = heads[..., :2 * H * Dk].reshape(B, Tn, 2 * H, Dk)
        self.qk_rotated = np.empty_like(self.qk)
        self.cos = self.sin = None                       # (Tn, 1, Dk/2), set per forward
        # an encoder-decoder's cross-attention queries, scaled (its keys and values are cached)
        self.cq = np.empty((N, H * Dk), dtype)
        self.cq_h = self.cq.reshape(B, Tn, H, Dk).transpose(0, 2, 1, 3)            # (B, H, Tn, Dk)


class Decoder:
    """A GPT prepared for sampling: folded weights and a preallocated KV cache.   [paper §3.2]

    ``forward(idx)`` takes the next tokens idx (B, Tn) of B sequences, at positions
    ``length .. length + Tn - 1``, writes their keys and values into the cache and returns their
    logits (B, Tn, V). A prefill passes the whole prompt; each later step passes one token, and
    then costs one (Dk x t) row of attention per head against the t cached keys: linear in t.

    Cache per layer: keys (B, H, Dk, n_ctx), stored transposed so that each head's scores are
    one matrix-vector product over contiguous rows, and values (B, H, n_ctx, Dv + 1).
    With rotary positions (``slides``) the cache keeps going past n_ctx one token at a time,
    as a ring over the last n_ctx positions (CausalSelfAttention.decode says why that is exact).
    The folded matrices are made when the Decoder is built: build a new one after changing
    the model's weights.

    A long prefill runs in chunks of query rows, so its (B, H, rows, n_ctx) attention scores
    stay under ``max_scores`` numbers (16 MiB in float32) whatever the batch and prompt.

    ``sparse`` (a sparse.Sparsity) thins attention for one-token steps once more positions are
    cached than its budget: at its selection layers the token attends densely and picks the
    set the following layers attend to (sparse.py). Prefill and layers before the first
    selection layer stay dense; ``kept`` holds the last set chosen.
    """

    max_scores = 1 << 22

    def __init__(self, model, batch: int = 1, sparse=None):
        cfg = model.config
        if not cfg.causal:
            raise ValueError("a KV cache needs causal attention: later tokens would change earlier outputs")
        self.model, self.B, self.dtype = model, batch, model.dtype
        # rotary positions let the cache slide past n_ctx, one token at a time (a ring of slots)
        self.rotary = model.blocks[0].attn.rotary
        self.slides = self.rotary is not None
        self.n_ctx, self.V = cfg.n_ctx, cfg.vocab_size
        d_hidden = model.blocks[0].mlp.c_fc.d_out
        self._shape = (cfg.d_model, cfg.n_head, cfg.d_qk, cfg.d_v, d_hidden, cfg.vocab_size, cfg.n_ctx)
        dt = self.dtype
        self.layers = [(block, block.attn.fold(block.ln_1), block.mlp.fold(block.ln_2),
                        block.ln_1.decode_vectors(dt), block.ln_2.decode_vectors(dt),
                        (block.cross.fold(block.ln_cross), block.ln_cross.decode_vectors(dt))
                        if hasattr(block, "cross") else None)
                       for block in model.blocks]
        self.seq2seq = self.layers[0][-1] is not None
        # Multi-Token Attention: the rows of its score maps the next rows' convolutions read
        self.mta_states = [block.attn.decode_state(batch, self.n_ctx, dt) if hasattr(block.attn, "decode_state")
                           else None for block in model.blocks]
        self.memory = None                        # per layer: the encoder output's cross keys, values
        self.memory_mask = None                   # (B, 1, 1, S): the source's padding
        if model.lm_head is None:
            self.head = model.ln_f.fold(model.embed.params["wte"].T)
        else:
            self.head = model.ln_f.fold(weight_of(model.lm_head), model.lm_head.params.get("bias"))
        self.norm_f = model.ln_f.decode_vectors(dt)
        # Attention Residuals: each sublayer's input is mixed over depth, row by row (no cache:
        # the mixing never looks across positions)
        self.depth = model.res_f is not None
        if self.depth:                            # each operation's query g * w, per block, then res_f's
            self.depth_q = [(block.attn_res.decode_query() if i else None, block.mlp_res.decode_query())
                            for i, block in enumerate(model.blocks)] + [model.res_f.decode_query()]
        L, H = len(self.layers), cfg.n_head
        self.keys = np.zeros((L, batch, H, cfg.d_qk, self.n_ctx), dt)
        # each value row carries a trailing 1: probabilities @ [v, 1] gives the weighted sum and
        # the softmax's normaliser in one product
        self.values = np.ones((L, batch, H, self.n_ctx, cfg.d_v + 1), dt)
        self.length = 0
        self.sparse = sparse                      # a sparse.Sparsity, or None: dense attention
        self.kept = None                          # the positions the last sparse step kept
        self.kept_scores = None                   # (B, H, t) the scores they were chosen from
        if sparse is not None and cfg.attention != "standard":
            raise ValueError("sparse decoding is for standard attention")
        if sparse is not None and self.seq2seq:
            raise ValueError("sparse decoding is for the decoder-only GPT's long self-attention cache")
        if sparse is not None and max(sparse.layers) >= L:
            raise ValueError(f"selection layer {max(sparse.layers)} does not exist: the model has {L} layers")
        # query rows per prefill chunk, so that its scores stay under max_scores numbers
        self._chunk = max(1, self.max_scores // (batch * H * self.n_ctx))
        self._step = self._buffers(1)

    @staticmethod
    def cache_size(model, batch: int = 1) -> int:
        """Bytes of KV cache a Decoder for ``batch`` sequences allocates."""
        return kv_cache_bytes(model.config, batch, model.dtype)

    @property
    def cache_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def reset(self) -> None:
        """Forget every cached position (the memory stays allocated)."""
        self.length = 0

    def encode(self, src: np.ndarray) -> None:
        """An encoder-decoder's source, once: run the encoder on src (B, S) (one row is shared by
        all B sequences), compute every layer's cross-attention keys and values from its output,
        and start the target afresh. Each decoding step then costs one row of attention against
        them per layer: the source is never read again."""
        if not self.seq2seq:
            raise ValueError("encode() is for an encoder-decoder; a GPT's prompt goes to forward()")
        src = self.model.check_tokens(src)
        if src.shape[0] not in (1, self.B):
            raise ValueError(f"this decoder holds {self.B} sequences, got {src.shape[0]} sources")
        m, key_mask = self.model.encode(src)                                 # (b, S, C)
        if src.shape[0] != self.B:
            m = np.repeat(m, self.B, axis=0)
            key_mask = None if key_mask is None else np.repeat(key_mask, self.B, axis=0)
        self.memory = [block.cross.memory(m) for block in self.model.blocks]
        self.memory_mask = key_mask
        self.reset()

    def _buffers(self, Tn: int) -> _Buffers:
        return _Buffers(self.B, Tn, *self._shape, self.dtype)

    def forward(self, idx: np.ndarray, check: bool = True) -> np.ndarray:
        """Logits (B, Tn, V) of tokens idx (B, Tn) that continue the cached ones.

        ``check=False`` skips validating ids the caller knows are in range (a sampler's).
        The returned array is a buffer the next call overwrites: copy it to keep it.
        """
        t0 = self.length
        if self.seq2seq and self.memory is None:
            raise ValueError("encode a source first: an encoder-decoder's decoder reads it at every step")
        if check:
            idx = self.model.check_tokens(idx, 0 if self.slides and idx.shape[-1] == 1 else t0)
            if idx.shape[0] != self.B:
                raise ValueError(f"this decoder holds {self.B} sequences, got {idx.shape[0]}")
        Tn = idx.shape[1]
        t1 = t0 + Tn
        if t1 > self.n_ctx and not (self.slides and Tn == 1):
            raise ValueError(f"KV cache holds {self.n_ctx} positions, asked for {t1}"
                             + (" (past the context it takes one token at a time)" if self.slides else ""))
        rows = self._chunk
        if Tn > rows:                   # chunked prefill: each chunk attends to the ones before
            logits = np.empty((self.B, Tn, self.V), self.dtype)
            for s in range(0, Tn, rows):
                logits[:, s:s + rows] = self.forward(idx[:, s:s + rows], check=False)
            return logits
        buf = self._step if Tn == 1 else self._buffers(Tn)
        if self.rotary is not None:
            cos, sin = self.rotary.tables(t0, Tn, self.dtype)                       # (Tn, Dk/2)
            buf.cos, buf.sin = cos[:, None], sin[:, None]
        model = self.model
        model.embed.decode(idx, t0, buf.x)
        H = self.model.config.n_head
        rule = self.sparse
        thin = rule is not None and Tn == 1 and rule.budget < t1 <= self.n_ctx    # within the cache
        keep = None
        depth = StackedSources(buf.x, 2 * len(self.layers), model.config.residual_block_size,
                               model.res_f.eps) if self.depth else None
        dq = self.depth_q if self.depth else None
        for i, ((block, attn_w, mlp_w, norm_1, norm_2, cross), keys, values) in enumerate(
                zip(self.layers, self.keys, self.values)):
            if depth and i:                          # block 0's attention reads the embedding as it is
                depth.mix(dq[i][0], buf.x)
            block.ln_1.decode(buf, norm_1)
            if self.mta_states[i] is not None:
                block.attn.decode(buf, attn_w, keys, values, t0, t1, state=self.mta_states[i])
            elif thin and i in rule.layers:                           # dense, and choose the set
                scores = np.empty((self.B, H, 1, t1), self.dtype)
                block.attn.decode(buf, attn_w, keys, values, t0, t1, scores=scores)
                keep = select(scores[:, :, 0], rule)
                self.kept_scores = scores[:, :, 0]
            else:
                block.attn.decode(buf, attn_w, keys, values, t0, t1, keep=keep if thin else None)
            if depth:
                depth.add(buf.out)
                depth.mix(dq[i][1], buf.x)
            if cross is not None:                                   # the encoder-decoder's third sublayer
                block.ln_cross.decode(buf, cross[1])
                block.cross.decode(buf, cross[0], *self.memory[i], self.memory_mask)
            block.ln_2.decode(buf, norm_2)
            block.mlp.decode(buf, mlp_w)
            if depth:
                depth.add(buf.out)
        self.kept = keep
        if depth:
            depth.mix(dq[-1], buf.x)
        model.ln_f.decode(buf, self.norm_f)
        np.dot(buf.xa, self.head, out=buf.logits)
        self.length = t1
        return buf.logits.reshape(self.B, Tn, self.V)
