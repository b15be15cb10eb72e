"""Parameter initialisation, and a shapes-only mode that sizes a model before it is built.

Every layer makes its parameters through these functions. Inside ``shapes_only()`` they
return zero-cost placeholders (a read-only broadcast of one zero) instead of drawing random
numbers, so ``GPT.shapes(cfg)`` knows every parameter's name and shape for the price of a few
Python objects: a configuration that asks for 100,000 layers is measured, not allocated.
"""
from __future__ import annotations

import numpy as np

_shapes_only = False


class shapes_only:
    """``with shapes_only():`` build layers whose parameters have the right names, shapes and
    dtypes but no memory."""

    def __enter__(self) -> None:
        global _shapes_only
        self.before, _shapes_only = _shapes_only, True

    def __exit__(self, *exc) -> None:
        global _shapes_only
        _shapes_only = self.before


def abstract() -> bool:
    """True inside ``shapes_only()``: the arrays being made are placeholders."""
    return _shapes_only


def _placeholder(shape, dtype) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype), shape)


def residual_proj_std(cfg, additions: int) -> float:
    """The initial std of a projection that writes into the residual stream: 0.02, or with
    ``proj_init="scaled"`` GPT-2's 0.02 / sqrt(additions), where ``additions`` counts the sums
    into the stream (2 per block), so that the stream's variance at initialisation does not
    grow with depth (Radford et al. 2019, section 2.3)."""
    return 0.02 / np.sqrt(additions) if cfg.proj_init == "scaled" else 0.02


def normal(rng: np.random.Generator, shape, std: float, dtype) -> np.ndarray:
    """N(0, std^2) entries, drawn in float64 and cast (the same numbers for either dtype)."""
    if _shapes_only:
        return _placeholder(shape, dtype)
    return (rng.standard_normal(shape) * std).astype(dtype)


def uniform(rng: np.random.Generator, bound: float, shape, dtype) -> np.ndarray:
    """U(-bound, bound) entries."""
    if _shapes_only:
        return _placeholder(shape, dtype)
    return rng.uniform(-bound, bound, shape).astype(dtype)


def zeros(shape, dtype) -> np.ndarray:
    return _placeholder(shape, dtype) if _shapes_only else np.zeros(shape, dtype)


def ones(shape, dtype) -> np.ndarray:
    return _placeholder(shape, dtype) if _shapes_only else np.ones(shape, dtype)


def eye(n: int, dtype, batch: tuple = ()) -> np.ndarray:
    """Identity matrices, shape batch + (n, n)."""
    shape = tuple(batch) + (n, n)
    return _placeholder(shape, dtype) if _shapes_only else np.broadcast_to(np.eye(n, dtype=dtype), shape).copy()
