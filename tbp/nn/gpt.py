"""Block and GPT: composition only.   [paper §7]"""
from __future__ import annotations

import numpy as np

from . import gemm, init, registry
from .batch import Batch, OneSequence
from .config import ModelConfig
from .embedding import Embedding
from .layout import Layout
from .linear import Linear
from .loss import CrossEntropy
from .dropout import Dropout, Noise
from .module import Module, Stack, _join
from .parts import Parts, parts as _parts
from .residual import Sum, SumGrad, SumStream


class ReadsKept:
    """A residual scheme's forward stream that also keeps each input a sublayer reads, then the
    state handed to ln_f, as (N, C) arrays in ``inputs``: the residual stream under a sum, the
    depth mix under Attention Residuals. For looking inside; the numbers are the stream's."""

    def __init__(self, stream, inputs: list):
        self.stream, self.inputs = stream, inputs

    def _kept(self, h: np.ndarray) -> np.ndarray:
        self.inputs.append(h.reshape(-1, h.shape[-1]))       # never written again by the stream
        return h

    def read(self, op) -> np.ndarray:
        return self._kept(self.stream.read(op))

    def write(self, v: np.ndarray) -> None:
        self.stream.write(v)

    def finish(self) -> np.ndarray:
        return self._kept(self.stream.finish())


class Block(Module):
    """Pre-LN transformer block.  x, y: (B, T, C).

    x = x + attn(ln_1(x));  y = x + mlp(ln_2(x)):  ``forward``/``backward``, a block alone.
    In a model the residual scheme forms each sublayer's input (residual.py): the sum above,
    or Attention Residuals, whose per-block operations ``attn_res`` and ``mlp_res`` this block
    owns and hands to the scheme (None under the sum). ``parts`` makes its self-attention, its
    norms and its MLP (parts.py: the kinds the config names, as the builder hands them in;
    None: the registry's choices for ``cfg``). ln_1 and ln_2 are the config's norm (a layer
    norm, or RMSNorm), whatever its kind.
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, dtype=np.float32, layer: int = 0,
                 residual=None, additions: int | None = None, parts: Parts | None = None):
        super().__init__()
        # Every matrix starts N(0, 0.02), as in the PyTorch reference. GPT-2 also shrinks the
        # residual projections by 1/sqrt(2L) (--proj-init scaled); on nanoGPT's 4-layer recipe
        # that measured worse (val 1.904 vs 1.876 after 2000 steps), so it is not the default.
        # additions: the sums into this block's residual stream (default 2 per block).
        proj_std = init.residual_proj_std(cfg, additions or 2 * cfg.n_layer)
        parts = parts or _parts(cfg, dtype)
        self.ln_1 = parts.norm(dtype)
        self.attn = parts.attention(rng, dtype, layer, proj_std)
        self.ln_2 = parts.norm(dtype)
        self.mlp = parts.mlp(rng, dtype, proj_std)
        self.attn_res, self.mlp_res = (residual or Sum()).block_ops(layer)
        self.attn_drop, self.mlp_drop = Dropout(), Dropout()        # residual dropout (training, p > 0)

    def sublayers(self) -> tuple:
        """(the residual scheme's operation or None, norm, layer) of each sublayer, in order."""
        return (self.attn_res, self.ln_1, self.attn), (self.mlp_res, self.ln_2, self.mlp)

    def forward(self, x: np.ndarray, key_mask: np.ndarray | None = None) -> np.ndarray:
        stream = SumStream(x, None)
        self.forward_stream(stream, key_mask)
        return stream.finish()

    def backward(self, dout: np.ndarray) -> np.ndarray:
        grad = SumGrad(dout)
        self.backward_stream(grad)
        return grad.finish()

    def forward_stream(self, stream, key_mask: np.ndarray | None = None, noise=None) -> None:
        """Each sublayer reads its input from the scheme's stream and writes its output back
        (through dropout when training with ``noise``, dropout.py)."""
        a = self.attn.forward(self.ln_1.forward(stream.read(self.attn_res)), key_mask, noise)
        stream.write(self.attn_drop.forward(a, noise))
        m = self.mlp.forward(self.ln_2.forward(stream.read(self.mlp_res)))
        stream.write(self.mlp_drop.forward(m, noise))

    def backward_stream(self, grad) -> None:
        """The forward read bottom-up: each sublayer's output gradient in, its input's out."""
        grad.input(self.mlp_res, self.ln_2.backward(self.mlp.backward(self.mlp_drop.backward(grad.output()))))
        grad.input(self.attn_res, self.ln_1.backward(self.attn.backward(self.attn_drop.backward(grad.output()))))

    # --- inference (decode.py) --------------------------------------------------------------
    def decode_state(self, residual, batch: int, n_ctx: int, dtype) -> list[tuple]:
        """Per sublayer: (the scheme's decoding query, norm, its vectors, layer, its state)."""
        return [(residual.decode_query(op), norm, norm.decode_vectors(dtype), layer,
                 layer.decode_state(norm, batch, n_ctx, dtype)) for op, norm, layer in self.sublayers()]


def drop_caches(module: Module) -> None:
    """Let go of what every layer of ``module`` keeps for its backward (its ``cache``)."""
    for _, m in module.modules():
        m.cache = None


class LanguageModel(Module):
    """What every tbp model shares: token embeddings, blocks, a final norm and a head that gives
    next-token logits; one flat layout of its trainable parameters; a masked loss.

    Subclasses build ``embed``, ``blocks``, their ``residual`` scheme (residual.py), ``ln_f``
    and ``lm_head`` (None: tied to ``wte``), then call :meth:`pack`; they define
    ``forward``/``backward``, the loss's inputs and :meth:`batch_accumulate`/:meth:`batch_loss`
    (what the trainer and the evaluator call with a :class:`Batch`), their ``collation`` of a paired
    example (batch.py), and ``reads_source``/``read_source`` if decoding first reads a source.
    """

    CHILD_NAMES = {"embed": "", "blocks": "h", "residual": ""}      # GPT-2's names: wte, wpe, h.0, ...
    reads_source = False            # an encoder-decoder's decoding reads a source first (decode.py)
    pad_id = None                   # the padding token the model masks, where it reads padded pairs
    collation = OneSequence         # how a (source, target) pair becomes a batch row (batch.py)
    block_done = None               # called with i once the backward has passed block i (gradsync.py)
    reports_blocks = False          # whether backward calls block_done (GPT's does)

    def late_gradients(self) -> set[str]:
        """Block parameters whose gradient the backward completes only at its end, not when it
        passes their block: nothing here."""
        return set()

    def _setup(self, cfg: ModelConfig, dtype) -> None:
        self.config = cfg
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        self.loss_fn = CrossEntropy()

    def _head_and_pack(self, cfg: ModelConfig, rng: np.random.Generator, parts: Parts | None = None) -> None:
        """The last layers every model has -- ``ln_f`` (the config's norm) and the head (tied to
        ``wte``, or an untied ``lm_head``, with a bias unless ``head_bias`` is off) -- then the
        layout of the whole tree."""
        self.ln_f = (parts or _parts(cfg, self.dtype)).norm(self.dtype)
        self.lm_head = None
        if not cfg.tie_head:
            self.lm_head = Linear(cfg.d_model, cfg.vocab_size, rng, self.dtype, bias=cfg.head_bias)
        self.pack()

    def pack(self) -> Layout | None:
        """Lay the trainable parameters out in one flat buffer (and their gradients in another)."""
        self.layout = None if init.abstract() else Layout(self)
        return self.layout

    @classmethod
    def shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape for ``cfg``, without allocating the model."""
        with init.shapes_only():
            return {k: v.shape for k, v in cls(cfg).params.items()}

    def replica(self) -> "LanguageModel":
        """A data-parallel worker's copy: shared parameters, its own gradient buffer."""
        twin = super().replica()
        twin.loss_fn = CrossEntropy()
        twin.layout = self.layout.with_grads(twin)
        return twin

    def zero_grad(self) -> None:
        self.layout.grads.fill(0)       # every gradient is a view into it

    @property
    def slides(self) -> bool:
        """No learned position table (rotary positions): any length reads, past the context as
        sliding-window attention, and the KV cache slides with it."""
        return "wpe" not in self.embed.params

    # --- checks -----------------------------------------------------------------------------
    def check_tokens(self, idx: np.ndarray, pos0: int = 0) -> np.ndarray:
        """Validate token ids: integers in [0, V), 2-D (B, T), positions inside the context (with
        rotary positions any length: past the context, attention is a sliding window)."""
        idx = np.asarray(idx)
        if idx.ndim == 1:
            idx = idx[None, :]
        if idx.ndim != 2:
            raise ValueError(f"token ids must have shape (B, T), got {idx.shape}")
        if not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.config.vocab_size):
            bad = idx[(idx < 0) | (idx >= self.config.vocab_size)][0]
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        if pos0 + idx.shape[1] > self.config.n_ctx and not self.slides:
            raise ValueError(
                f"sequence of {pos0 + idx.shape[1]} tokens is longer than the context ({self.config.n_ctx})")
        return idx

    def _check_targets(self, targets: np.ndarray, idx: np.ndarray) -> np.ndarray:
        targets = self.check_tokens(targets)
        if targets.shape != np.shape(np.atleast_2d(idx)):
            raise ValueError(f"targets shape {targets.shape} differs from inputs {np.shape(idx)}")
        return targets

    # --- the head ---------------------------------------------------------------------------
    def _head(self, xf: np.ndarray) -> np.ndarray:
        """logits (B, T, V) of the final-norm output xf (B, T, C)."""
        self.cache = xf
        if self.lm_head is not None:
            return self.lm_head.forward(xf)
        wte = self.embed.params["wte"]
        V, C = wte.shape
        return gemm.matmul(xf.reshape(-1, C), wte.T).reshape(xf.shape[:-1] + (V,))

    def _head_backward(self, dlogits: np.ndarray) -> np.ndarray:
        """[paper §7, Table 3]  Tied head: logits = xf wte^T gives dwte += dlogits^T xf and
        dxf = dlogits wte; the embedding's scatter adds to the same dwte. Returns dxf."""
        xf = self.cache
        C = xf.shape[-1]
        if self.lm_head is not None:
            return self.lm_head.backward(dlogits)
        emb = self.embed
        dlogits2 = dlogits.reshape(-1, dlogits.shape[-1])                 # (N, V)
        if "wte" in emb.grads:
            gemm.matmul_add(emb.grads["wte"], dlogits2.T, xf.reshape(-1, C))
        return gemm.matmul(dlogits2, emb.params["wte"]).reshape(xf.shape)

    def _backward_from_loss(self, scale: float) -> None:
        dlogits = self.loss_fn.backward()
        if scale != 1.0:
            dlogits *= dlogits.dtype.type(scale)
        self.backward(dlogits)

    # --- inference path (KV cache: decode.Inference) ---------------------------------------
    def read_source(self, states: list, src: np.ndarray, batch: int) -> None:
        """A model whose decoding reads a source first reads it into ``states`` (designs/encdec)."""
        raise ValueError("encode() reads a source, and this model reads none: its prompt goes to forward()")

    def check_decodable(self, inference) -> None:
        """Raise ValueError if ``inference`` (decode.Inference) cannot take a step yet: never here."""


@registry.arch("gpt")
class GPT(LanguageModel):
    """GPT-2-shaped language model: embeddings -> L blocks -> ln_f -> logits.   [paper §7]

    idx: (B, T) token ids, T <= n_ctx; logits: (B, T, V). The head is ``wte`` itself
    (logits = x @ wte^T, GPT-2's tied head) or, with ``tie_head=False``, an untied
    ``lm_head`` Linear(C, V) with a bias (the paper's FC_logits).

    >>> model = GPT(ModelConfig(vocab_size=11, n_ctx=8, n_layer=1, n_head=2, d_model=8), seed=0)
    >>> model.forward(np.array([[1, 2, 3]])).shape
    (1, 3, 11)

    ``layout`` packs the trainable parameters into one buffer (see :class:`Layout`); call
    :meth:`pack` again after changing which parameters train (``add_lora`` does).

    ``residual``, the scheme that forms each sublayer's input (residual.py), is the sum of
    GPT-2 or Attention Residuals (attnres.py): each sublayer's input, and the final state
    handed to ``ln_f``, a learned softmax over the embedding and the earlier sublayers' outputs.

    With ``recompute`` (recompute.py) the training forward keeps each block's input only, and
    the backward runs each block's forward again just before its backward.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0, dtype=np.float32, parts: Parts | None = None):
        super().__init__()
        if cfg.arch != "gpt":
            raise ValueError(f"GPT builds arch 'gpt', the config says {cfg.arch!r} (use build_model)")
        self._setup(cfg, dtype)
        self._block_inputs = self._noise = None            # recompute.py: what the last forward kept
        rng = np.random.default_rng(seed)
        parts = parts or _parts(cfg, self.dtype)          # the builder's, or the registry's choices
        self.embed = Embedding(cfg.vocab_size, cfg.n_ctx, cfg.d_model, rng, self.dtype,
                               learned_positions=parts.positions.embeds)
        residual = parts.residual
        self.blocks = Stack(Block(cfg, rng, self.dtype, i, residual, parts=parts) for i in range(cfg.n_layer))
        self.residual = residual            # after the blocks: its parameters follow theirs (res_f)
        self._head_and_pack(cfg, rng, parts)

    # --- training path ----------------------------------------------------------------------
    def forward(self, idx: np.ndarray, outputs: list | None = None, noise=None,
                inputs: list | None = None, keep: bool = True) -> np.ndarray:
        """Logits (B, T, V) of token ids idx (B, T). ``outputs``, if given, collects each
        sublayer's output (N, C), in order, for looking inside; ``inputs`` each sublayer's input
        before its norm (the residual stream under a sum), then the state handed to ln_f: 2 L + 1
        arrays (N, C). ``noise``: one dropout seed per row (B,), training with ``dropout`` > 0
        only (dropout.py); None: no dropout. ``keep``: False for a forward that no backward
        follows (evaluation): each block lets go of what it keeps for the backward as soon as it
        is done, so one block's activations are alive at a time, not L."""
        idx = self.check_tokens(idx)
        if noise is not None:
            if not self.config.dropout:
                raise ValueError("dropout noise given to a model with dropout 0")
            if np.shape(noise) != idx.shape[:1]:
                raise ValueError(f"dropout noise must be one seed per row, shape {idx.shape[:1]}, got {np.shape(noise)}")
            noise = Noise(noise, self.config.dropout)
        stream = self.residual.stream(self.embed.forward(idx), outputs)       # (B, T, C)
        if inputs is not None:
            stream = ReadsKept(stream, inputs)
        # recompute.py: keep each block's input and drop the rest (not while looking inside)
        recompute = keep and self.config.recompute and outputs is None and inputs is None
        kept = self._block_inputs = [] if recompute else None
        for block in self.blocks:
            if kept is not None:              # recompute.py: the block's input, where its dropout draws start
                kept.append((stream.x, noise.state() if noise is not None else None))
            block.forward_stream(stream, None, noise)
            if kept is not None or not keep:
                drop_caches(block)
        self._noise = noise
        logits = self._head(self.ln_f.forward(stream.finish()))              # (B, T, V)
        if not keep:
            drop_caches(self)
        return logits

    reports_blocks = True

    def late_gradients(self) -> set[str]:
        """Attention Residuals' depth operations: each one's query gradient waits for every source
        it read to be done, the embedding last (attnres.Reads), so it is complete at the end."""
        ops = {id(op) for op in self.residual.ops(self.blocks)}
        return {_join(prefix, k) for prefix, m in self.modules() if id(m) in ops for k in m._grads}

    def backward(self, dlogits: np.ndarray) -> None:
        """[paper §7, Table 3]  The forward's calls read bottom-up."""
        grad = self.residual.grad(self.ln_f.backward(self._head_backward(dlogits)))
        report = self.block_done
        kept = self._block_inputs
        for i in reversed(range(len(self.blocks))):
            block = self.blocks[i]
            if kept is not None:               # recompute.py: run the block again from its input
                x, draws = kept[i]
                if draws is not None:
                    self._noise.restore(draws)
                block.forward_stream(SumStream(x, None), None, self._noise)
            block.backward_stream(grad)
            if kept is not None:
                drop_caches(block)
                kept[i] = None
            if report is not None:             # nothing below writes block i's gradient: it may be sent
                report(i)
        self.embed.backward(grad.finish())

    def attention_weights(self, idx: np.ndarray) -> list[np.ndarray]:
        """Run the forward on idx (B, T) and return each layer's attention weights (B, H, T, T):
        row t is what query t gives each key. For looking inside; the training path is untouched."""
        self.forward(idx)
        return [block.attn.weights() for block in self.blocks]

    def depth_weights(self, idx: np.ndarray) -> list[np.ndarray]:
        """Attention Residuals: run the forward on idx (B, T) and return, for each operation in
        order (the MLP of block 0, then attn and mlp of each later block, then ``res_f``; the first
        attention reads the embedding alone), alpha (K, B, T): what each position's
        input takes from each of the K sources (the embedding first, then blocks in order)."""
        ops = self.residual.ops(self.blocks)
        if not ops:
            raise ValueError("depth weights are an Attention Residuals model's (residual='attention')")
        B, T = self.check_tokens(idx).shape
        self.forward(idx)
        return [op.weights().reshape(-1, B, T) for op in ops]

    def loss(self, idx: np.ndarray, targets: np.ndarray, weights: np.ndarray | None = None,
             noise: np.ndarray | None = None, keep: bool = True) -> float:
        """Mean cross-entropy of the next-token predictions (weighted by ``weights`` (B, T),
        e.g. 0 on a prompt and 1 on its completion); forward only. ``noise``: dropout's row
        seeds (training); evaluation passes none. ``keep``: False when no backward follows
        (``forward``'s), the probabilities let go of too."""
        # the logits are this call's own: the loss turns them into probabilities in place
        value = self.loss_fn.forward(self.forward(idx, noise=noise, keep=keep), self._check_targets(targets, idx),
                                     weights, overwrite=True)
        if not keep:
            self.loss_fn.cache = None
        return value

    def loss_and_backward(self, idx: np.ndarray, targets: np.ndarray, weights: np.ndarray | None = None,
                          noise: np.ndarray | None = None) -> float:
        """Zero the gradients, then fill ``grads`` for the mean cross-entropy; returns the loss."""
        self.zero_grad()
        return self.accumulate(idx, targets, weights=weights, noise=noise)

    def accumulate(self, idx: np.ndarray, targets: np.ndarray, scale: float = 1.0,
                   weights: np.ndarray | None = None, noise: np.ndarray | None = None) -> float:
        """*Add* ``scale`` times the gradient of the mean cross-entropy into ``grads``; returns
        the loss. The one gradient entry point: gradient accumulation over micro-batches and
        the data-parallel workers' shares of a batch are both a scale."""
        loss = self.loss(idx, targets, weights, noise)
        self._backward_from_loss(scale)
        return loss

    def batch_loss(self, batch: Batch) -> float:
        """The batch's mean loss, for evaluation: nothing is kept for a backward."""
        return self.loss(batch.idx, batch.targets, batch.weights, batch.noise, keep=False)

    def batch_accumulate(self, batch: Batch, scale: float = 1.0) -> float:
        return self.accumulate(batch.idx, batch.targets, scale, batch.weights, batch.noise)
