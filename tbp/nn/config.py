"""ModelConfig: the shape and options of a GPT, each declared once.

Every field is declared with :func:`option`: its default, a line of help, its range or its
choices. Validation here, the ``tbp train`` flags, ``--config`` files and ``tbp info`` are all
derived from those declarations, so a new model option is one field (plus the layer code and
its gradcheck row). What a field means for a variant -- which options belong to it, which
combinations it refuses -- is declared by the variant itself (variant.py, build.py): the
registry installs those checks in ``CHECKS`` when the engine is imported.
"""
from __future__ import annotations

import math
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields

from . import registry


class ConfigError(ValueError):
    """An option value outside its declared range or choices (a usage error, not a bug)."""


def option(default, help: str, *, min=None, max=None, min_open: bool = False, max_open: bool = False,
           choices=None, cli: bool = True, flag: str | None = None, gpt2=None):
    """A config field: default, help, and what makes a value valid.

    min/max: bounds, inclusive unless ``min_open``/``max_open``; choices: allowed strings;
    cli: False for values derived from the data or the engine (no flag); flag: a click flag
    spelling for booleans ("--tie-head/--untie-head"); gpt2: the value GPT-2 itself uses, for
    options an exported GPT-2 folder cannot represent otherwise.
    """
    meta = {"help": help, "min": min, "max": max, "min_open": min_open, "max_open": max_open, "choices": choices,
            "cli": cli, "flag": flag, "gpt2": gpt2}
    return field(default=default, metadata=meta)


class DictConfig:
    """Validation from the field declarations, and a JSON round trip (unknown keys are an error)."""
    KIND = "config"

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            _check(f.name, getattr(self, f.name), hints[f.name], f.metadata)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        if not isinstance(d, dict):
            raise ConfigError(f"a {cls.KIND} must be a JSON object, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown {cls.KIND} keys: {', '.join(sorted(unknown))}")
        return cls(**d)

    @classmethod
    def options(cls) -> list:
        """The fields a user sets (the ``tbp train`` flags), in declaration order."""
        return [f for f in fields(cls) if f.metadata.get("cli", False)]

    @classmethod
    def defaults(cls) -> dict:
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def _check(name: str, value, kind, meta) -> None:
    """Raise ConfigError unless ``value`` fits the field's type, range and choices."""
    args = typing.get_args(kind)
    if value is None:
        if type(None) in args:
            return
        raise ConfigError(f"{name} must be set")
    base = next((a for a in args if a is not type(None)), kind) if args else kind
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return
    if base is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if base is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if base is str and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if lo is not None and (value <= lo if meta.get("min_open") else value < lo):
        raise ConfigError(f"{name} must be {'>' if meta.get('min_open') else '>='} {lo}, got {value!r}")
    if hi is not None and (value >= hi if meta.get("max_open") else value > hi):
        raise ConfigError(f"{name} must be {'<' if meta.get('max_open') else '<='} {hi}, got {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


ACTIVATIONS = ("gelu", "relu")
class _KernelChoices:
    """``auto`` beside the attention kernels the engine has registered (registry.py)."""

    def __contains__(self, value) -> bool:
        return value == "auto" or value in registry.KERNEL

    def __iter__(self):
        return iter(("auto", *registry.KERNEL))


ATTN_IMPLS = _KernelChoices()
POSITIONS = registry.POSITIONS        # the positions schemes the engine has registered (registry.py)
# the choices of the design axes: what the engine has registered (registry.py)
ARCHS, ATTENTIONS, RESIDUALS = registry.ARCH, registry.ATTENTION, registry.RESIDUAL
PROJ_INITS = ("flat", "scaled")


N_CTX_MAX = 65536          # the longest context any model here reads: a bound for data too
# how the model computes or trains, not what it is (a kernel, dropout, recomputation): free to
# change on resume or fine-tune
COMPUTE_FIELDS = ("attn_impl", "dropout", "recompute")
# installed by build.py: check(cfg) raises ConfigError; refusal(cfg, use) -> the reason or None
CHECKS: list = []
REFUSALS: list = []


@dataclass
class ModelConfig(DictConfig):
    arch: str = option("gpt", "gpt: a decoder-only language model; encoder-decoder: a non-causal encoder reads "
                              "the source, the decoder cross-attends to it (paired datasets).",
                       choices=ARCHS, gpt2="gpt")
    vocab_size: int = option(65, "V: tokens the model reads and predicts (set by the tokenizer).",
                             min=1, cli=False)
    n_ctx: int = option(128, "Context length: tokens per training sequence (learned positions).",
                        min=2, max=N_CTX_MAX)
    n_layer: int = option(4, "L: transformer blocks.", min=1, max=96)
    n_enc_layer: int | None = option(None, "Encoder blocks of an encoder-decoder (default: --n-layer, the "
                                           "decoder's).", min=1, max=96)
    n_head: int = option(4, "H: attention heads per block.", min=1, max=128)
    d_model: int = option(128, "C: width of the residual stream (divisible by --n-head).", min=1, max=16384)
    d_qk: int | None = option(None, "Dk: query/key width per head, the paper's d_rho "
                                    "(default d_model / n_head, the value width Dv).", min=1, max=4096)
    bias: bool = option(True, "Biases in every linear and layer-norm layer.", gpt2=True)
    activation: str = option("gelu", "MLP nonlinearity: gelu (GPT-2's tanh approximation) or relu.",
                             choices=ACTIVATIONS, gpt2="gelu")
    ln_eps: float = option(1e-5, "Layer norm epsilon (the paper's checks use 0).", min=0.0)
    tie_head: bool = option(True, "Output head tied to the token embedding, or (untied) a separate "
                                  "layer with bias, the paper's FC_logits.",
                            flag="--tie-head/--untie-head", gpt2=True)
    causal: bool = option(True, "Causal mask; False gives permutation-equivariant attention.",
                          cli=False, gpt2=True)
    attn_impl: str = option("auto", "Attention kernel: dense keeps the T x T attention weights for the "
                                    "backward; flash computes the same numbers in tiles with O(T) memory; "
                                    "auto: flash at long contexts, for that memory (tbp info shows the choice).",
                            choices=ATTN_IMPLS)
    positions: str = option("learned", "Position encoding: learned (a vector per position, GPT-2's) or a "
                                       "scheme without one, which reads past the context as a sliding window "
                                       "(rope: queries and keys rotated by position; the designs add others).",
                            choices=POSITIONS, gpt2="learned")
    rope_base: float = option(10000.0, "RoPE frequency base: pair i turns by position * base^(-2i/d_qk).",
                              min=1.0, min_open=True)
    attention: str = option("standard", "standard; mta: Multi-Token Attention, a learned convolution over "
                                        "each head's score map (identity at initialisation); gqa: grouped-query "
                                        "attention, --n-kv-head key/value heads shared by the query heads.",
                            choices=ATTENTIONS, gpt2="standard")
    n_kv_head: int | None = option(None, "Grouped-query attention: key/value heads, dividing n_head (1: multi-query "
                                         "attention); the KV cache is n_head / n_kv_head times smaller.",
                                   min=1, max=128)
    mta_cq: int = option(2, "MTA: query rows of the key-query kernel (the current and cq - 1 past).", min=1, max=64)
    mta_ck: int = option(9, "MTA: key columns of the key-query kernel, centred on the key (odd).", min=1, max=255)
    mta_layers: str = option("all", "MTA: the layers with the key-query convolution, all or e.g. 0,2 (every "
                                    "layer gets the other MTA steps switched on).")
    mta_post: bool = option(False, "MTA: a second key-query convolution after the softmax.",
                            flag="--mta-post/--no-mta-post")
    mta_mix: bool = option(False, "MTA: mix the heads' scores before the softmax (an H x H matrix).",
                           flag="--mta-mix/--no-mta-mix")
    mta_group: int = option(0, "MTA: mix the heads' weights after the softmax in groups of this many (0: off).",
                            min=0, max=128)
    mta_norm: bool = option(False, "MTA: RMS-normalise each head's output, then gate it.",
                            flag="--mta-norm/--no-mta-norm")
    mta_depth_scale: bool = option(False, "MTA: scale the normed output by 1 - lambda(l), lambda(l) = 0.8 - "
                                          "0.6 exp(-0.3 l) for layer l (the paper's, off in its released "
                                          "configs; needs --mta-norm).",
                                   flag="--mta-depth-scale/--no-mta-depth-scale")
    residual: str = option("sum", "How each sublayer's input is formed: sum (the residual stream) or attention "
                                  "(Attention Residuals: a learned per-token softmax over the embedding and every "
                                  "earlier sublayer's output; the mean of them at initialisation).",
                           choices=RESIDUALS, gpt2="sum")
    residual_blocks: int = option(0, "Attention Residuals over blocks: the 2 x n_layer sublayers summed in this many "
                                     "blocks, each a source (0: every sublayer its own source, full AttnRes).",
                                  min=0, max=192)
    residual_query_scale: float = option(1.0, "Attention Residuals: a factor c on the depth logits, q = c g w. "
                                              "Under Adam it sets the pseudo-queries' own learning rate (c times "
                                              "the shared one); 0 freezes them at zero, each input the mean of its "
                                              "sources (1: the paper's).", min=0.0)
    proj_init: str = option("flat", "Initial spread of the projections that write into the residual stream: flat "
                                    "(N(0, 0.02), as every matrix) or scaled (GPT-2's N(0, 0.02 / sqrt(S)), S the "
                                    "residual additions of the stack: 2 per block, 3 in a decoder block).",
                            choices=PROJ_INITS)
    recompute: bool = option(False, "Activation recomputation: keep only each block's input in the forward and run "
                                    "the block again in the backward (one block's activations in memory at a time, "
                                    "a quarter to a third more time per step, the same gradients).",
                             flag="--recompute/--no-recompute")
    dropout: float = option(0.0, "Dropout probability on attention weights and on each sublayer's output, in "
                                 "training only (nanoGPT's Shakespeare recipe uses 0.2; 0: off).",
                            min=0.0, max=1.0, max_open=True)
    pad_id: int | None = option(None, "The padding token: an encoder-decoder masks padded source keys and "
                                      "targets (set from the tokenizer).", min=0, cli=False)
    KIND = "model config"

    def __post_init__(self) -> None:
        registry.complete()     # every choice registered, and the builder's checks installed
        super().__post_init__()
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.d_qk is None:
            self.d_qk = self.d_v
        for check in CHECKS:
            check(self)
        if self.pad_id is not None and self.pad_id >= self.vocab_size:
            raise ConfigError(f"pad_id {self.pad_id} is outside the vocabulary ({self.vocab_size})")

    @property
    def attn_kernel(self) -> str:
        """The kernel attn_impl stands for at this context (every kernel gives the same results):
        for ``auto``, the one registered to take over at the longest context up to n_ctx that no
        variant of this model refuses (flash from 2,048: registry.KERNEL_FROM), else dense."""
        if self.attn_impl == "auto":
            fits = [(T, name) for name, T in registry.KERNEL_FROM.items()
                    if self.n_ctx >= T and not any(r(self, name) for r in REFUSALS)]
            return max(fits)[1] if fits else "dense"
        return self.attn_impl

    @property
    def d_v(self) -> int:
        """Dv: value width per head, C / H, so the heads concatenate back to C."""
        return self.d_model // self.n_head
