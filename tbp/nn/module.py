"""Module: the parameter bookkeeping every layer shares; Stack: a numbered list of modules."""
from __future__ import annotations

import functools

import numpy as np

from . import init


class Module:
    """A layer: its own leaf parameters, and child modules that register on assignment.

    ``self.param("weight", array)`` registers a leaf parameter with a zeroed gradient of the
    same shape; ``self.c_fc = Linear(...)`` registers a child (assigning a new module to the
    same attribute replaces it, which is how LoRA wraps a layer). ``params`` and ``grads`` are
    computed from the tree on each access, as dicts under dotted names (``h.0.ln_1.weight``),
    so they are never stale. A frozen parameter stays in ``params`` with no entry in ``grads``,
    and the layer skips its gradient's matmul entirely.

    The arrays are only ever updated in place (the optimizer, loading, ``zero_grad``), except
    by :meth:`Layout.pack`, which moves the trainable ones into one flat buffer.

    ``CHILD_NAMES`` maps an attribute to the name its parameters appear under, where the two
    differ (GPT's embedding contributes bare ``wte``/``wpe``; its blocks are ``h``); several
    children may share the bare name "" (the embedding and the residual scheme).
    """

    CHILD_NAMES: dict[str, str] = {}

    def __init__(self) -> None:
        object.__setattr__(self, "_params", {})
        object.__setattr__(self, "_grads", {})
        object.__setattr__(self, "_children", {})
        self.cache = None

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, Module):
            self._children[name] = value
        elif name in self.__dict__.get("_children", ()):   # a subclass may set a number before __init__
            del self._children[name]     # e.g. lm_head = None
        object.__setattr__(self, name, value)

    def param(self, name: str, value: np.ndarray) -> np.ndarray:
        """Register a leaf parameter and a zeroed gradient of the same shape and dtype."""
        self._params[name] = value
        self._grads[name] = init.zeros(value.shape, value.dtype)
        return value

    # --- the tree ---------------------------------------------------------------------------
    def modules(self, prefix: str = ""):
        """Yield (dotted name, module) for this module and every descendant, depth first."""
        yield prefix, self
        for attr, child in self._children.items():
            yield from child.modules(_join(prefix, self.CHILD_NAMES.get(attr, attr)))

    @property
    def params(self) -> dict[str, np.ndarray]:
        """Every parameter of the tree under its dotted name (a leaf returns its own dict)."""
        if not self._children:
            return self._params
        return {_join(prefix, k): v for prefix, m in self.modules() for k, v in m._params.items()}

    @property
    def grads(self) -> dict[str, np.ndarray]:
        """The gradient of every trainable parameter, same names and shapes as ``params``."""
        if not self._children:
            return self._grads
        return {_join(prefix, k): v for prefix, m in self.modules() for k, v in m._grads.items()}

    def num_params(self) -> int:
        return sum(p.size for p in self.params.values())

    # --- training state ---------------------------------------------------------------------
    def freeze(self) -> None:
        """Stop computing the gradient of every parameter in the tree (LoRA trains adapters only)."""
        for _, m in self.modules():
            m._grads.clear()

    def zero_grad(self) -> None:
        for _, m in self.modules():
            for g in m._grads.values():
                g.fill(0)

    def replica(self) -> "Module":
        """A copy of the tree that shares every parameter array and owns zeroed gradients and
        empty activation caches: what a data-parallel worker runs its share of a batch on."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)                   # a shallow copy: the same arrays
        object.__setattr__(twin, "_params", dict(self._params))
        object.__setattr__(twin, "_grads", {k: np.zeros_like(g) for k, g in self._grads.items()})
        object.__setattr__(twin, "_children", {})
        twin.cache = None
        for attr, value in list(vars(self).items()):
            if isinstance(value, Module):
                setattr(twin, attr, value.replica())
        return twin


class Stack(Module):
    """Modules numbered 0, 1, ...: GPT's ``h.0``, ``h.1``; iterable and indexable like a list."""

    def __init__(self, modules) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def __len__(self) -> int:
        return len(self._children)

    def __iter__(self):
        return iter(list(self._children.values()))

    def __getitem__(self, i: int) -> Module:
        return getattr(self, str(range(len(self))[i]))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else (prefix or name)


class DecodeState:
    """One layer's state for decoding (decode.py): ``folded``, its matrices prepared by the
    layer's ``fold`` (called with no arguments, on first use, so that another decoder of the
    same weights can lend its own instead: :meth:`share`); its caches, as named arrays (``keys``,
    ``values``, ...); and its scratch, made by ``make(Tn)`` for Tn new rows -- kept for one-row
    steps, made afresh for a prefill."""

    def __init__(self, fold, make, **caches: np.ndarray):
        self._fold, self._make, self.caches = fold, make, caches
        self.__dict__.update(caches)
        self._step = make(1)

    @functools.cached_property
    def folded(self):
        return self._fold()

    def share(self, other: "DecodeState") -> None:
        """Read ``other``'s folded matrices (the same layer's, of unchanged weights) instead of
        folding them again: they are only read while decoding."""
        self.folded = other.folded

    def scratch(self, Tn: int):
        return self._step if Tn == 1 else self._make(Tn)

    @property
    def nbytes(self) -> int:
        """Bytes of the caches (what a longer context or a larger batch costs)."""
        return sum(a.nbytes for a in self.caches.values())
