"""The encoder-decoder transformer: composition only.   [Vaswani et al. 2017, §3.1; paper §7]

The encoder reads the source with non-causal self-attention (every position sees every
other, padded positions excepted); the decoder is a GPT whose blocks also cross-attend to
the encoder's output m. Every decoder layer reads the same m, so m's gradient is the sum of
what each layer's cross-attention sends back -- the add-into contract, as for the tied
embedding.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ... import init, registry
from ...config import ConfigError, ModelConfig, Options, option
from .cross import CrossAttention
from ...embedding import Embedding
from ...batch import Batch
from ...gpt import Block, LanguageModel, drop_caches
from ...kernels import padding_mask
from ...module import Module, Stack
from ...parts import Parts, parts as make_parts
from ...residual import Sum
from ...variant import Variant


class DecoderBlock(Block):
    """Pre-LN decoder block.  x, y: (B, T, C); m: (B, S, C), the encoder's output.

    h = x + attn(ln_1(x));  c = h + cross(ln_cross(h), m);  y = c + mlp(ln_2(c)).
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, dtype=np.float32, parts: Parts | None = None):
        parts = parts or make_parts(cfg, dtype)
        super().__init__(cfg, rng, dtype, additions=3 * cfg.n_layer, parts=parts)
        self.ln_cross = parts.norm(dtype)
        self.cross = CrossAttention(cfg.d_model, cfg.n_head, cfg.d_qk, cfg.d_v, rng, dtype, cfg.bias,
                                    init.residual_proj_std(cfg, 3 * cfg.n_layer))

    def sublayers(self) -> tuple:
        return (None, self.ln_1, self.attn), (None, self.ln_cross, self.cross), (None, self.ln_2, self.mlp)

    def read_source(self, states: list, m: np.ndarray, key_mask: np.ndarray | None) -> None:
        """Decoding: the cross-attention's keys and values of the encoder output m (B, S, C)."""
        self.cross.read_source(states[1][-1], m, key_mask)

    def forward(self, x: np.ndarray, m: np.ndarray, key_mask: np.ndarray | None = None) -> np.ndarray:
        h = self.attn.forward(self.ln_1.forward(x))
        h += x
        c = self.cross.forward(self.ln_cross.forward(h), m, key_mask)
        c += h
        y = self.mlp.forward(self.ln_2.forward(c))
        y += c
        return y

    def backward(self, dout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Returns (dx, dm): the input's gradient and this layer's share of the memory's."""
        dc = self.ln_2.backward(self.mlp.backward(dout))
        dc += dout
        dq, dm = self.cross.backward(dc)
        dh = self.ln_cross.backward(dq)
        dh += dc
        dx = self.ln_1.backward(self.attn.backward(dh))
        dx += dh
        return dx, dm


class Encoder(Module):
    """Embeddings -> n_enc_layer non-causal blocks -> ln_f.  src (B, S) -> m (B, S, C).

    ``key_mask`` (B, 1, 1, S), -inf on padded source positions: no position reads them. A padded
    position's own output is computed (and ignored: the decoder masks it too).
    """

    CHILD_NAMES = {"embed": "", "blocks": "h"}

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, dtype=np.float32):
        super().__init__()
        # the encoder-decoder's own kernel ("dense": a padded source needs the key mask), not the one
        # "auto" would pick for a GPT of this context
        bidirectional = dataclasses.replace(cfg, causal=False, arch="gpt", designs={}, attn_impl=cfg.attn_kernel)
        n_enc_layer = cfg.designs["encoder-decoder"].n_enc_layer
        self.embed = Embedding(cfg.vocab_size, cfg.n_ctx, cfg.d_model, rng, dtype)
        self.blocks = Stack(Block(bidirectional, rng, dtype, additions=2 * n_enc_layer) for _ in range(n_enc_layer))
        self.ln_f = make_parts(cfg, dtype).norm(dtype)

    def forward(self, src: np.ndarray, key_mask: np.ndarray | None = None) -> np.ndarray:
        x = self.embed.forward(src)
        for block in self.blocks:
            x = block.forward(x, key_mask)
        return self.ln_f.forward(x)

    def backward(self, dm: np.ndarray) -> None:
        dx = self.ln_f.backward(dm)
        for block in reversed(self.blocks):
            dx = block.backward(dx)
        self.embed.backward(dx)


class SourceApart:
    """An encoder-decoder's pairs: the source to the encoder, the target to the decoder."""

    describe = "encoder-decoder"
    refuses = "an encoder-decoder trains on paired data (tbp prepare --format pairs, or --task reverse)"

    @staticmethod
    def need(meta: dict) -> tuple[int, str]:
        """Context the longest source, or target with its start token, needs, and that said."""
        n = max(meta["max_source_tokens"], meta["max_target_tokens"] + 1)
        return n, f"source or target is {n} tokens (a target with its start token)"

    @staticmethod
    def derived(kind: str, meta: dict) -> dict:
        """The padding id of a pairs dataset: padded source positions are masked as keys."""
        return {"pad_id": meta["pad_id"]} if kind == "pairs" else {}

    @staticmethod
    def collate(pairs: list, sep: int, eot: int, pad: int) -> Batch:
        B = len(pairs)
        S = max(len(s) for s, _ in pairs)
        T = max(len(t) for _, t in pairs) + 1
        source = np.full((B, S), pad, np.int64)
        idx = np.full((B, T), pad, np.int64)
        targets = np.full((B, T), pad, np.int64)
        weights = np.zeros((B, T), np.float32)
        for r, (s, t) in enumerate(pairs):
            source[r, :len(s)] = s
            idx[r, :len(t) + 1] = np.concatenate([[sep], t])
            targets[r, :len(t) + 1] = np.concatenate([t, [eot]])
            weights[r, :len(t) + 1] = 1.0
        return Batch(idx, targets, weights, source)


@registry.arch("encoder-decoder")
class EncoderDecoder(LanguageModel):
    """Encoder-decoder transformer: src (B, S) and tgt_in (B, T) -> logits (B, T, V).
    [Vaswani et al. 2017, Figure 1, pre-LN]

    The decoder is GPT-shaped (``wte``, ``wpe``, ``h.*``, ``ln_f``, tied or untied head) with
    a cross-attention in every block; the encoder's parameters are under ``enc.``. Source and
    target share the tokenizer but not the embedding tables. ``pad_id`` (its options,
    ``cfg.designs["encoder-decoder"]``): padded source positions are masked as keys everywhere,
    and ``tgt_out == pad_id`` carries no loss.

    >>> cfg = ModelConfig(arch="encoder-decoder", vocab_size=11, n_ctx=8, n_layer=1, n_head=2, d_model=8)
    >>> EncoderDecoder(cfg).forward(np.array([[1, 2, 3, 4]]), np.array([[5, 6]])).shape
    (1, 2, 11)
    """

    CHILD_NAMES = {"embed": "", "blocks": "h", "encoder": "enc", "residual": ""}
    reads_source = True
    collation = SourceApart

    def __init__(self, cfg: ModelConfig, seed: int = 0, dtype=np.float32, parts: Parts | None = None):
        super().__init__()
        if cfg.arch != "encoder-decoder":
            raise ValueError(f"EncoderDecoder builds arch 'encoder-decoder', the config says {cfg.arch!r}")
        self._setup(cfg, dtype)
        rng = np.random.default_rng(seed)
        self.encoder = Encoder(cfg, rng, self.dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.n_ctx, cfg.d_model, rng, self.dtype)
        parts = parts or make_parts(cfg, self.dtype)                    # the builder's, or the registry's
        self.blocks = Stack(DecoderBlock(cfg, rng, self.dtype, parts) for _ in range(cfg.n_layer))
        self.residual = Sum()        # the residual stream (Attention Residuals refuse this architecture)
        self.source_scale = 1.0      # 0 zeroes the encoder's output: the ablation that proves it is read
        self._head_and_pack(cfg, rng, parts)

    @property
    def pad_id(self) -> int | None:
        return self.config.designs["encoder-decoder"].pad_id

    def source_mask(self, src: np.ndarray) -> np.ndarray | None:
        """(B, 1, 1, S) additive mask of src's padded positions, or None when nothing is padded."""
        if self.pad_id is None:
            return None
        pad = src == self.pad_id
        if pad.all(axis=1).any():
            raise ValueError("a source sequence is all padding: nothing to attend to")
        return padding_mask(pad, self.dtype) if pad.any() else None

    def encode(self, src: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(m (B, S, C), key mask) for source ids src (B, S)."""
        src = self.check_tokens(src)
        key_mask = self.source_mask(src)
        m = self.encoder.forward(src, key_mask)
        if self.source_scale != 1.0:
            m *= self.dtype.type(self.source_scale)
        return m, key_mask

    def check_decodable(self, inference) -> None:
        if not inference.has_source:
            raise ValueError("encode a source first: an encoder-decoder's decoder reads it at every step")

    def read_source(self, states: list, src: np.ndarray, batch: int) -> None:
        """Decoding (decode.py): run the encoder on src (b, S), b = 1 (shared by all ``batch``
        sequences) or ``batch``, and give every layer's cross-attention its keys and values."""
        src = self.check_tokens(src)
        if src.shape[0] not in (1, batch):
            raise ValueError(f"this Inference holds {batch} sequences, got {src.shape[0]} sources")
        m, key_mask = self.encode(src)                                     # (b, S, C)
        if src.shape[0] != batch:
            m = np.repeat(m, batch, axis=0)
            key_mask = None if key_mask is None else np.repeat(key_mask, batch, axis=0)
        for block, block_states in zip(self.blocks, states):
            block.read_source(block_states, m, key_mask)

    # --- training path ----------------------------------------------------------------------
    def forward(self, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
        m, key_mask = self.encode(src)
        tgt_in = self.check_tokens(tgt_in)
        if m.shape[0] != tgt_in.shape[0]:
            raise ValueError(f"{m.shape[0]} sources but {tgt_in.shape[0]} targets")
        x = self.embed.forward(tgt_in)                                     # (B, T, C)
        for block in self.blocks:
            x = block.forward(x, m, key_mask)
        return self._head(self.ln_f.forward(x))                            # (B, T, V)

    def backward(self, dlogits: np.ndarray) -> None:
        """The decoder bottom-up, summing each layer's dm; then the encoder from dm."""
        dx = self.ln_f.backward(self._head_backward(dlogits))
        dm = None
        for block in reversed(self.blocks):
            dx, dm_layer = block.backward(dx)
            if dm is None:
                dm = dm_layer
            else:
                dm += dm_layer
        self.embed.backward(dx)
        if self.source_scale != 1.0:
            dm *= self.dtype.type(self.source_scale)
        self.encoder.backward(dm)

    def attention_weights(self, src: np.ndarray, tgt_in: np.ndarray) -> dict[str, list[np.ndarray]]:
        """Each layer's attention weights after a forward: "encoder" (B, H, S, S), "self"
        (B, H, T, T), "cross" (B, H, T, S) -- row t of cross is what target position t read."""
        self.forward(src, tgt_in)
        return {"encoder": [b.attn.weights() for b in self.encoder.blocks],
                "self": [b.attn.weights() for b in self.blocks],
                "cross": [b.cross.weights() for b in self.blocks]}

    def _weights(self, tgt_out: np.ndarray, weights: np.ndarray | None) -> np.ndarray | None:
        if weights is None and self.pad_id is not None:
            return (tgt_out != self.pad_id).astype(self.dtype)
        return weights

    def loss(self, src: np.ndarray, tgt_in: np.ndarray, tgt_out: np.ndarray,
             weights: np.ndarray | None = None) -> float:
        """Mean cross-entropy of tgt_out (B, T) given src and tgt_in; padded targets (or
        ``weights`` (B, T), when given) weigh nothing. Forward only."""
        logits = self.forward(src, tgt_in)
        tgt_out = self._check_targets(tgt_out, tgt_in)
        return self.loss_fn.forward(logits, tgt_out, self._weights(tgt_out, weights), overwrite=True)

    def loss_and_backward(self, src: np.ndarray, tgt_in: np.ndarray, tgt_out: np.ndarray,
                          weights: np.ndarray | None = None) -> float:
        """Zero the gradients, then fill ``grads`` for the mean cross-entropy; returns the loss."""
        self.zero_grad()
        return self.accumulate(src, tgt_in, tgt_out, weights=weights)

    def accumulate(self, src: np.ndarray, tgt_in: np.ndarray, tgt_out: np.ndarray, scale: float = 1.0,
                   weights: np.ndarray | None = None) -> float:
        """*Add* ``scale`` times the loss's gradient into ``grads`` (as GPT.accumulate)."""
        loss = self.loss(src, tgt_in, tgt_out, weights)
        self._backward_from_loss(scale)
        return loss

    def batch_loss(self, batch: Batch) -> float:
        """A batch's ``source`` to the encoder, its ``idx`` (tgt_in) and ``targets`` (tgt_out)
        to the decoder; no dropout here (``noise`` must be None). For evaluation: what the
        layers kept for a backward is let go of once the loss is known."""
        value = self.loss(batch.source, batch.idx, batch.targets, batch.weights)
        drop_caches(self)
        self.loss_fn.cache = None
        return value

    def batch_accumulate(self, batch: Batch, scale: float = 1.0) -> float:
        return self.accumulate(batch.source, batch.idx, batch.targets, scale, batch.weights)


@dataclass(frozen=True)
class EncDecOptions(Options):
    """The encoder-decoder's own options (``cfg.designs["encoder-decoder"]``)."""
    n_enc_layer: int | None = option(None, "Encoder blocks of an encoder-decoder (default: --n-layer, the "
                                           "decoder's).", min=1, max=96)
    pad_id: int | None = option(None, "The padding token: an encoder-decoder masks padded source keys and "
                                      "targets (set from the tokenizer).", min=0, cli=False)


def _check(cfg: ModelConfig) -> None:
    o = cfg.designs["encoder-decoder"]
    if o.n_enc_layer is None:                          # the default: as deep as the decoder
        cfg.designs["encoder-decoder"] = o = dataclasses.replace(o, n_enc_layer=cfg.n_layer)
    if o.pad_id is not None and o.pad_id >= cfg.vocab_size:
        raise ConfigError(f"pad_id {o.pad_id} is outside the vocabulary ({cfg.vocab_size})")
    if not cfg.causal:
        raise ConfigError("an encoder-decoder's decoder is causal (its encoder never is)")


VARIANT = registry.declare(Variant(
    key="encoder-decoder", name="encoder-decoder", active=lambda cfg: cfg.arch == "encoder-decoder", axis="arch",
    options=EncDecOptions, switch="--arch encoder-decoder",
    summary="encoder-decoder: a non-causal encoder reads the source, the decoder cross-attends to it (paired "
            "datasets).",
    describe=lambda cfg: ("encoder", f"{cfg.designs['encoder-decoder'].n_enc_layer} non-causal layers over the "
                                     f"source; each decoder layer cross-attends to them"),
    refuses={"rope": "an encoder-decoder uses learned positions (rope is for the decoder-only GPT)",
             "dropout": "dropout is built for the GPT here (not the encoder-decoder)",
             "flash": "an encoder-decoder's attention is dense: its padding masks are not in the flash kernel "
                      "(attn_impl auto or dense)",
             "thin": "sparse decoding is for a GPT's long self-attention cache, not an encoder-decoder",
             "export": "GPT-2 is decoder-only, it has no encoder and no cross-attention",
             "gguf": "llama.cpp's GPT-style graphs are decoder-only, with no cross-attention (the encoder-decoder)",
             "recompute": "activation recomputation is built for the GPT's one stack of blocks (drop --recompute)",
             "rows": "an encoder-decoder's sequences each read their own source; they are decoded one at a time",
             "lora": "LoRA adapters are for the GPT; fine-tune an encoder-decoder with all its weights "
                     "(drop --lora-rank)",
             "chat": "conversations are for a GPT trained on a chat dataset",
             "speculate": "speculative decoding drafts a decoder-only model's continuation; an encoder-decoder's "
                          "target reads its source",
             "bench": "tbp bench times the GPT; an encoder-decoder's speed shows in tbp train's tokens/s"},
    # an encoder layer, and each decoder layer's cross-attention, keep what a GPT layer keeps
    activations=lambda cfg: 2 * cfg.designs["encoder-decoder"].n_enc_layer * (26 * cfg.d_model
                                                                            + 2 * cfg.n_head * cfg.n_ctx),
    check=_check,
    # cross-attention over a source whose last position in row 0 is padding, as a layer and in a
    # decoder block (its memory's gradient is checked; the padded position's must be zero)
    memory_cases=(("cross-attention [Tq=5, Tk=7, padded key]",
                   lambda C, H, rng, dtype: CrossAttention(C, H, 4, C // H, rng, dtype)),
                  ("cross-attention [d_qk=3 != d_v=4]",
                   lambda C, H, rng, dtype: CrossAttention(C, H, 3, C // H, rng, dtype)),
                  ("decoder-block [pre-LN, cross]",
                   lambda C, H, rng, dtype: DecoderBlock(ModelConfig(vocab_size=7, n_ctx=8, n_layer=1, n_head=H,
                                                                     d_model=C), rng, dtype))),
    # the whole model on random pairs, padded by its collation: every decoder layer reads the
    # same memory, so the encoder's gradients check the sum over layers
    model_cases=(("encoder-decoder [tied head, padding]", dict(arch="encoder-decoder", pad_id=0)),
                 ("encoder-decoder [untied head, 1 enc + 2 dec]",
                  dict(arch="encoder-decoder", pad_id=0, tie_head=False, n_enc_layer=1)),
                 ("encoder-decoder [d_qk=2, no biases]", dict(arch="encoder-decoder", pad_id=0, d_qk=2, bias=False))),
))
