"""Parts: what a model is made of beyond its own layers, each the registered choice its config
names -- the positions object every layer shares, the residual scheme, and how each block's
self-attention, each norm and each feed-forward sublayer are made. The builder (build.py) makes them and hands them to the model's
constructor, as torchtune's component builders do; a model built straight from a config
(``GPT(cfg)``) asks :func:`parts` itself. Nothing here names a design: the registry does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import registry


@dataclass(frozen=True)
class Parts:
    """positions: the positions object (positions.py); residual: the residual scheme's object
    (residual.py); attention(rng, dtype, layer, proj_std): block ``layer``'s self-attention;
    norm(dtype): a normalisation over the model's width; mlp(rng, dtype, proj_std): a
    feed-forward sublayer."""
    positions: object
    residual: object
    attention: Callable
    norm: Callable
    mlp: Callable


def parts(cfg, dtype) -> Parts:
    """The parts ``cfg`` names, from the registry's ``positions``, ``residual``, ``attention``,
    ``norm`` and ``mlp`` axes; one positions object for the whole model."""
    positions = registry.POSITIONS[cfg.positions](cfg)
    kind, norm_kind, mlp_kind = registry.ATTENTION[cfg.attention], registry.NORM[cfg.norm], registry.MLP[cfg.mlp]

    def attention(rng, dtype, layer: int, proj_std: float):
        return kind.from_config(cfg, rng, dtype, layer, proj_std, positions)

    def norm(dtype):
        return norm_kind.from_config(cfg, dtype)

    def mlp(rng, dtype, proj_std: float):
        return mlp_kind.from_config(cfg, rng, dtype, proj_std)
    return Parts(positions, registry.RESIDUAL[cfg.residual].from_config(cfg, dtype), attention, norm, mlp)
