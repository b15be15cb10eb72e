"""The registry: the axes of choice a model config has, and what each choice stands for.

A leaf: it imports no layer and no design. Designs register themselves into it when their
module is imported (``tbp/nn/designs/``; the builder, build.py, imports them), and the config's
checks and the command line's choices read it, so a new choice is its own module and one
registration, with no edit of the modules that read the axis.

    POSITIONS   ``positions``: name -> make(cfg), the model's positions object (positions.py)
    VARIANTS    each design's declaration (variant.py): what the rest of tbp asks of it
"""
from __future__ import annotations

from typing import Callable

POSITIONS: dict[str, Callable] = {}
VARIANTS: list = []


def declare(variant):
    """Add a design's declaration (a variant.Variant) to the ones the config checks and tbp asks."""
    VARIANTS.append(variant)
    return variant


def positions(name: str) -> Callable:
    """Register ``make(cfg) -> Positions`` as the positions scheme ``name`` (a decorator)."""
    def register(make: Callable) -> Callable:
        if name in POSITIONS:
            raise ValueError(f"positions {name!r} is registered twice")
        POSITIONS[name] = make
        return make
    return register
