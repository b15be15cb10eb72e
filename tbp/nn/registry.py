"""The registry: the axes of choice a model config has, and what each choice stands for.

A leaf: it imports no layer and no design. Designs register themselves into it when their
module is imported (``tbp/nn/designs/``; the builder, build.py, imports them), and the config's
checks and the command line's choices read it, so a new choice is its own module and one
registration, with no edit of the modules that read the axis. :func:`complete` loads them all
where a reader needs every choice (a config being checked) and may not have imported the builder.

    ARCH        ``arch``: name -> the model class (GPT, EncoderDecoder)
    ATTENTION   ``attention``: name -> the self-attention class, built by its ``from_config``
    RESIDUAL    ``residual``: name -> the residual scheme's class, built by its ``from_config``
    POSITIONS   ``positions``: name -> make(cfg), the model's positions object (positions.py)
    NORM        ``norm``: name -> the normalisation's class (layernorm.py; RMSNorm), built by its
                ``from_config(cfg, dtype)``, one before each sublayer and before the head
    MLP         ``mlp``: name -> the feed-forward sublayer's class (mlp.py; SwiGLU), built by its
                ``from_config(cfg, rng, dtype, proj_std)``
    KERNEL      ``attn_impl``: name -> make(causal, window, rows, tiles, bias), the attention
                kernel object (kernels.py: dense in query blocks; designs/flash: in tiles);
                KERNEL_FROM: name -> the context from which ``auto`` picks it; KERNEL_ONE_THREAD:
                the kernels whose products are small tiles, which run best on one BLAS thread
    STRATEGY    a decoding strategy's class by name (decode.Inference's ``strategy``): "sparse" ->
                designs/sparse's SparseRule, which the commands that decode build from their options
    VARIANTS    each design's declaration (variant.py): what the rest of tbp asks of it
"""
from __future__ import annotations

from importlib import import_module
from typing import Callable

ARCH: dict[str, type] = {}
ATTENTION: dict[str, type] = {}
RESIDUAL: dict[str, type] = {}
POSITIONS: dict[str, Callable] = {}
NORM: dict[str, type] = {}
MLP: dict[str, type] = {}
KERNEL: dict[str, Callable] = {}
KERNEL_FROM: dict[str, int] = {}
KERNEL_ONE_THREAD: set[str] = set()
STRATEGY: dict[str, type] = {}
VARIANTS: list = []


def has(axis: str, name: str) -> bool:
    """Whether a choice is registered: ``has("positions", "rope")``; axis one of arch,
    attention, residual, positions, norm, mlp, kernel (a case that combines two designs asks it)."""
    return name in {"arch": ARCH, "attention": ATTENTION, "residual": RESIDUAL, "positions": POSITIONS,
                    "norm": NORM, "mlp": MLP, "kernel": KERNEL}[axis]


def complete() -> None:
    """Make every axis list every choice: import the builder's module, which imports each module
    that registers one -- the core's and the designs wing (build.py). By name, because the
    registry is the leaf those modules import; once imported, this costs a dictionary look-up."""
    import_module(".build", __package__)


# what a variant may refuse beside other variants (its ``refuses``), the uses outside the model:
# "thin" is a decoding step that reads a subset of the cached positions (a decoding strategy's,
# decode.Inference; sparse decoding's rules thin); "speculate" is speculative decoding (generate/speculative.py)
USES = ("thin", "export", "gguf", "lora", "chat", "bench", "rewind", "rows", "speculate")


def register_in(axis: dict, what: str, name: str) -> Callable:
    """A decorator entering a thing into ``axis`` as ``name``, refusing a second one (every axis
    here, and a design's own, such as sparse decoding's rule kinds)."""
    def register(thing):
        if name in axis:
            raise ValueError(f"{what} {name!r} is registered twice")
        axis[name] = thing
        return thing
    return register


def arch(name: str) -> Callable:
    """Register a model class as the architecture ``name`` (a class decorator)."""
    return register_in(ARCH, "arch", name)


def attention(name: str) -> Callable:
    """Register a self-attention class as the attention kind ``name`` (a class decorator)."""
    return register_in(ATTENTION, "attention", name)


def residual(name: str) -> Callable:
    """Register a residual scheme's class as ``name`` (a class decorator)."""
    return register_in(RESIDUAL, "residual", name)


def norm(name: str) -> Callable:
    """Register a normalisation's class as ``name`` (a class decorator)."""
    return register_in(NORM, "norm", name)


def mlp(name: str) -> Callable:
    """Register a feed-forward sublayer's class as ``name`` (a class decorator)."""
    return register_in(MLP, "mlp", name)


_RANK: dict[str, int] = {}


def declare(variant, rank: int | None = None):
    """Add a declaration (a variant.Variant) to the ones the config checks and tbp asks: the
    core's training options first, in their fixed ``rank``, then the designs in the order they
    were declared -- whichever module is imported first. VARIANTS stays one list, so whoever
    holds it (build.VARIANTS) sees every declaration."""
    if rank is not None:
        _RANK[variant.key] = rank
    VARIANTS.append(variant)
    VARIANTS.sort(key=lambda v: (v.key not in _RANK, _RANK.get(v.key, 0)))   # stable among the designs
    return variant


def positions(name: str) -> Callable:
    """Register ``make(cfg) -> Positions`` as the positions scheme ``name`` (a decorator)."""
    return register_in(POSITIONS, "positions", name)


def kernel(name: str, auto_from: int | None = None, one_thread: bool = False) -> Callable:
    """Register ``make(causal, window, rows, tiles, bias)`` as the attention kernel ``name``;
    ``auto_from``: the context from which ``attn_impl auto`` picks it over the dense kernel;
    ``one_thread``: training holds BLAS to one thread with it (its products are small tiles)."""
    enter = register_in(KERNEL, "attention kernel", name)

    def register(make):
        enter(make)                                # refuses a second registration before any table changes
        if auto_from is not None:
            KERNEL_FROM[name] = auto_from
        if one_thread:
            KERNEL_ONE_THREAD.add(name)
        return make
    return register


def strategy(name: str) -> Callable:
    """Register a decoding strategy's class as ``name`` (a class decorator)."""
    return register_in(STRATEGY, "decoding strategy", name)
