"""Autoregressive inference with a key/value cache.   [paper §3.2, the KV cache]

Decoding one token at a time does little arithmetic per step (a few matrix-vector products),
so its cost is the number of NumPy calls, each a microsecond or more of fixed overhead. Each
layer therefore has an inference form beside its forward and backward, on weights prepared
once (``fold``) and buffers allocated once (``decode_state``):

- each layer norm's gain and bias are folded into the linear layer that reads it
  (``LayerNorm.fold``), and that layer's bias rides along as one more row of its matrix,
  read by a constant-1 column after the normalised input: the affine step and the bias cost
  no call at all;
- the attention scale 1/sqrt(Dk) is folded into the query columns of c_attn;
- LoRA adapters are merged into their base weights.

The :class:`Inference` holds the layers' states and calls them in order; it knows no variant.
What a layer must provide to decode (the attention kinds, the MLP, cross-attention do):

- ``decode_state(ln, batch, n_ctx, dtype)``: a module.DecodeState -- its weights folded with
  the norm ``ln`` that feeds it, its caches (self-attention: keys and values), its scratch;
- ``decode(rows, state, step)``: read the normalised new rows ``rows.xa`` ([xhat, 1],
  (N, C + 1), N = B Tn) and write the sublayer's output into ``rows.out`` (N, C). ``step``
  (:class:`Step`) says which positions the rows are, with what a positions scheme makes once
  per step and a decoding strategy's hook for it.

The residual scheme runs the layers (``decode(layers, rows, step, state)``, residual.py): it forms each
sublayer's input and takes its output from ``rows.out`` (the sum adds it into ``rows.x``); a
block lists its sublayers (``Block.sublayers``); an encoder-decoder reads
its source into the states first (``read_source``). The matrices that read a layer norm
(c_attn, c_fc, the head) are copied folded, and an MLP's c_proj transposed (a contraction is
streamed faster as dot products: linear.contraction); the attention's output projection and
the embeddings are the model's own arrays. The result equals ``GPT.forward`` up to rounding (float64: ~1e-14;
float32: ~1e-6 relative); ``tests/test_generate.py`` checks this at every step.
"""
from __future__ import annotations

import numpy as np

from . import build
from .linear import weight_of


class Rows:
    """The stream of one forward over N = B * Tn new rows, shared by every sublayer: ``x`` the
    residual stream, ``xa`` the normalised input [xhat, 1] a sublayer reads, ``out`` the
    output it writes; the rest is the layer norm's scratch (LayerNorm.decode)."""

    def __init__(self, N: int, C: int, V: int, dtype):
        self.x = np.empty((N, C), dtype)                 # the residual stream
        self.mean = np.empty((N, 1), dtype)              # layer norm: mean
        self.std = np.empty((N, 1), dtype)               # variance + eps, then its square root
        self.xc = np.empty((N, C), dtype)                # centred input
        self.sq = np.ones((N, C + 1), dtype)             # [xc^2, 1]: the 1 brings in eps
        self.xa = np.ones((N, C + 1), dtype)             # [xhat, 1]: the 1 brings in the bias
        self.sq_c, self.xa_c = self.sq[:, :C], self.xa[:, :C]
        self.out = np.empty((N, C), dtype)               # a sublayer's output, before the residual
        self.logits = np.empty((N, V), dtype)


class Step:
    """What one forward tells its layers: the new rows are positions t0 .. t1-1, ``layer`` is
    the layer being run, ``strategy`` what a decoding strategy made for this step (the hook an
    attention layer asks which cached positions it reads, attention.py), or None: dense."""

    def __init__(self, t0: int, t1: int, dtype, strategy=None, positions: np.ndarray | None = None):
        self.t0, self.t1, self.dtype, self.strategy, self.layer = t0, t1, dtype, strategy, 0
        self.positions = positions        # (B,): one row per sequence, each at its own position
        self._once: dict = {}
        self._mask = None

    def once(self, key, make):
        """``make()``, made once per step and shared by every layer (keyed by ``key``, e.g. the
        positions object whose rotary tables or score bias it is)."""
        if key not in self._once:
            self._once[key] = make()
        return self._once[key]

    def rows(self) -> np.ndarray:
        """The new rows' positions: (Tn,), t0 .. t1-1, or (B, 1), each sequence's own."""
        return self.positions[:, None] if self.positions is not None else np.arange(self.t0, self.t1)

    def slots(self, span: int, n_ctx: int) -> np.ndarray:
        """(span,) the position each of the cache's first ``span`` slots holds: slot s holds s
        within the context; past it (one row at t0, a ring of n_ctx slots) the latest position
        t <= t0 with t = s mod n_ctx."""
        s = np.arange(span)
        return s if self.t1 <= n_ctx else self.t0 - (self.t0 - s) % n_ctx

    def row_mask(self, span: int) -> np.ndarray:
        """(B, span): 0 where row b may read (slots up to its position), -inf past it."""
        if self._mask is None:
            self._mask = np.where(np.arange(span)[None, :] <= self.positions[:, None], 0, -np.inf).astype(self.dtype)
        return self._mask


class Inference:
    """A model prepared for sampling: folded weights and preallocated caches.   [paper §3.2]

    ``forward(idx)`` takes the next tokens idx (B, Tn) of B sequences, at positions
    ``length .. length + Tn - 1``, writes their keys and values into the cache and returns their
    logits (B, Tn, V). A prefill passes the whole prompt; each later step passes one token, and
    then costs one (Dk x t) row of attention per head against the t cached keys: linear in t.

    With rotary positions (``slides``) the cache keeps going past n_ctx one token at a time,
    as a ring over the last n_ctx positions (CausalSelfAttention.decode says why that is exact).
    The folded matrices are made when the Inference is built (each layer's on its first
    step): build a new one after changing the model's weights. ``share``: another Inference of
    the same model, unchanged since, whose folded matrices this one reads instead of making its
    own -- a copy of nearly every weight, a few hundred milliseconds at GPT-2 124M's size, which
    a server or a benchmark that decodes again and again pays once; the caches stay its own. A long prefill runs in chunks of query rows, so its (B, H, rows,
    n_ctx) attention scores stay under ``max_scores`` numbers (16 MiB in float32).

    ``strategy``: how one-token steps decode beyond dense attention (a sparse rule thins it,
    designs/sparse): it declares the use the model's variants may refuse (``use``), checks the
    model (``check``), and makes each one-token step's hook (``step(t0, t1, n_ctx)``, None for
    a dense step). ``last``: what the last step's hook recorded (a sparse rule's kept set), or None.
    """

    max_scores = 1 << 22

    def __init__(self, model, batch: int = 1, strategy=None, share: "Inference | None" = None):
        cfg = model.config
        if not cfg.causal:
            raise ValueError("a KV cache needs causal attention: later tokens would change earlier outputs")
        if strategy is not None:
            why = build.refusal(cfg, strategy.use)
            if why is not None:
                raise ValueError(why)
            strategy.check(cfg)
        self.model, self.B, self.dtype = model, batch, model.dtype
        # rotary positions let the cache slide past n_ctx, one token at a time (a ring of slots)
        self.slides = model.slides
        self.n_ctx, self.V, self.C = cfg.n_ctx, cfg.vocab_size, cfg.d_model
        self.residual = model.residual
        self.residual_state = self.residual.decode_state()
        self.layers = [block.decode_state(self.residual, batch, self.n_ctx, self.dtype) for block in model.blocks]
        if share is not None:
            if share.model is not model:
                raise ValueError("an Inference shares the folded weights of another Inference of the same model only")
            for mine, theirs in zip(self.layers, share.layers):
                for (*_, state), (*_, lent) in zip(mine, theirs):
                    state.share(lent)
            self.head = share.head
        elif model.lm_head is None:
            self.head = model.ln_f.fold(model.embed.params["wte"].T)
        else:
            self.head = model.ln_f.fold(weight_of(model.lm_head), model.lm_head.params.get("bias"))
        self.norm_f = model.ln_f.decode_vectors(self.dtype)
        self.has_source = False
        self.length = 0
        self.strategy = strategy                  # how one-token steps decode, or None: dense attention
        self.last = None                          # what the last step's hook recorded
        # query rows per prefill chunk, so that its scores stay under max_scores numbers
        self._chunk = max(1, self.max_scores // (batch * cfg.n_head * self.n_ctx))
        self._one_row = Rows(batch, self.C, self.V, self.dtype)     # the rows of every one-token step

    def prepare(self) -> "Inference":
        """Make every layer's folded matrices now (each is otherwise made on its first step), so
        that a server folds before it says it is serving, not on its first request."""
        for layer in self.layers:
            for *_, state in layer:
                state.folded
        return self

    @staticmethod
    def cache_size(model, batch: int = 1) -> int:
        """Bytes of KV cache an Inference for ``batch`` sequences allocates."""
        return build.kv_cache_bytes(model.config, batch, model.dtype)

    def caches(self):
        """(layer, name, array) of every cache: each self-attention's keys and values, ..."""
        for i, layer in enumerate(self.layers):
            for *_, state in layer:
                for name, a in state.caches.items():
                    yield i, name, a

    @property
    def cache_bytes(self) -> int:
        return sum(a.nbytes for _, _, a in self.caches())

    def reset(self) -> None:
        """Forget every cached position (the memory stays allocated)."""
        self.length = 0

    def rewind(self, length: int) -> None:
        """Forget the cached positions from ``length`` on and keep those before it: the next
        forward continues at position ``length``, as if the later tokens had never been fed.
        Exact, because a step writes its own positions' keys and values before any row reads
        them and no row reads past its own; so several continuations (each sparse rule, say)
        can share one prefill. Not once a sliding cache has passed n_ctx (the ring has
        overwritten older positions: only a rewind to 0, a reset, is exact then), nor where a
        layer caches rows it only keeps the last of (Multi-Token Attention refuses it)."""
        if self.length > self.n_ctx and length:
            raise ValueError(f"the cache has slid past its context of {self.n_ctx} (a ring over the last "
                             f"positions): only a rewind to 0 is exact")
        if not 0 <= length <= self.length:
            raise ValueError(f"can rewind to 0 .. {self.length} cached positions, not {length}")
        if 0 < length < self.length:
            why = build.refusal(self.model.config, "rewind")
            if why is not None:
                raise ValueError(why)
        self.length = length

    def step_rows(self, idx: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Logits (B, V) of one new token per sequence, idx (B,), each at its own position
        ``positions`` (B,) -- sequences of different lengths decoded in one step (a server's
        concurrent requests), each row's cache filled up to its position before (``load_row``).
        The same numbers as each sequence's own one-token step, up to float rounding: the
        products run over B rows at once. Within the context (no sliding), without a decoding
        strategy; variants whose decoding keeps more than keys and values refuse it.
        The returned array is a buffer the next call overwrites."""
        why = build.refusal(self.model.config, "rows")
        if why is not None:
            raise ValueError(why)
        if self.strategy is not None:
            raise ValueError("a decoding strategy shapes one sequence's steps; rows at their own positions take none")
        idx = np.asarray(idx, dtype=np.int64).reshape(self.B, 1)
        positions = np.asarray(positions, dtype=np.int64).reshape(self.B)
        if positions.min() < 0 or positions.max() >= self.n_ctx:
            raise ValueError(f"positions must be in 0 .. {self.n_ctx - 1}")
        rows = self._one_row
        span = int(positions.max()) + 1                 # t1: the slots any row reads; one new row each
        step = Step(span - 1, span, self.dtype, positions=positions)
        self.model.embed.decode(idx, 0, rows.x, positions)
        self.residual.decode(self.layers, rows, step, self.residual_state)
        self.model.ln_f.decode(rows, self.norm_f)
        np.dot(rows.xa, self.head, out=rows.logits)
        return rows.logits

    def load_row(self, row: int, one: "Inference") -> None:
        """Copy the caches of ``one`` (an Inference of one sequence, after its prefill) into
        sequence ``row`` of this one: a new request joins the others' decoding."""
        if one.B != 1:
            raise ValueError("load_row copies from an Inference of one sequence")
        for (_, _, mine), (_, _, theirs) in zip(self.caches(), one.caches()):
            mine[row] = theirs[0]

    def encode(self, src: np.ndarray) -> None:
        """An encoder-decoder's source, once: run the encoder on src (B, S) (one row is shared by
        all B sequences), compute every layer's cross-attention keys and values from its output,
        and start the target afresh. Each decoding step then costs one row of attention against
        them per layer: the source is never read again."""
        self.model.read_source(self.layers, src, self.B)
        self.has_source = True
        self.reset()

    def forward(self, idx: np.ndarray, check: bool = True) -> np.ndarray:
        """Logits (B, Tn, V) of tokens idx (B, Tn) that continue the cached ones.

        ``check=False`` skips validating ids the caller knows are in range (a sampler's).
        The returned array is a buffer the next call overwrites: copy it to keep it.
        """
        t0 = self.length
        self.model.check_decodable(self)
        if check:
            idx = self.model.check_tokens(idx, 0 if self.slides and idx.shape[-1] == 1 else t0)
            if idx.shape[0] != self.B:
                raise ValueError(f"this Inference holds {self.B} sequences, got {idx.shape[0]}")
        Tn = idx.shape[1]
        t1 = t0 + Tn
        if t1 > self.n_ctx and not (self.slides and Tn == 1):
            raise ValueError(f"KV cache holds {self.n_ctx} positions, asked for {t1}"
                             + (" (past the context it takes one token at a time)" if self.slides else ""))
        if Tn > self._chunk:            # chunked prefill: each chunk attends to the ones before
            logits = np.empty((self.B, Tn, self.V), self.dtype)
            for s in range(0, Tn, self._chunk):
                logits[:, s:s + self._chunk] = self.forward(idx[:, s:s + self._chunk], check=False)
            return logits
        rows = self._one_row if Tn == 1 else Rows(self.B * Tn, self.C, self.V, self.dtype)
        hook = self.strategy.step(t0, t1, self.n_ctx) if self.strategy is not None and Tn == 1 else None
        step = Step(t0, t1, self.dtype, hook)
        model = self.model
        model.embed.decode(idx, t0, rows.x)
        self.residual.decode(self.layers, rows, step, self.residual_state)
        self.last = hook
        model.ln_f.decode(rows, self.norm_f)
        np.dot(rows.xa, self.head, out=rows.logits)
        self.length = t1
        return rows.logits.reshape(self.B, Tn, self.V)

