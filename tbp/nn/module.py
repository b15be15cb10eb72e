"""Module: the parameter bookkeeping every layer shares."""
from __future__ import annotations

import numpy as np


class Module:
    """A layer with ``params`` and ``grads``: dicts of arrays with the same keys and shapes.

    A composite module registers children with :meth:`add`; its ``params``/``grads`` then hold
    *references* to every descendant's arrays under dotted names (``h.0.ln_1.weight``). The
    arrays are never rebound, only updated in place (the optimizer, loading, ``zero_grad``),
    so those references stay live.

    A frozen parameter (LoRA's base) stays in ``params`` but has no entry in ``grads``, and
    the layer skips its gradient's matmul entirely.
    """

    def __init__(self) -> None:
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self.children: dict[str, Module] = {}
        self._own: list[str] = []
        self.flat = None                # (params, grads, n_matrix) once pack() has run

    def param(self, name: str, value: np.ndarray) -> np.ndarray:
        """Register a leaf parameter and a zeroed gradient of the same shape and dtype."""
        self._own.append(name)
        self.params[name] = value
        self.grads[name] = np.zeros_like(value)
        return value

    def add(self, name: str, module: "Module") -> "Module":
        """Register a child; its parameters appear here as ``name.key`` (bare when name is "")."""
        self.children[name] = module
        return module

    def collect(self) -> None:
        """Rebuild the flat dotted-name views after the tree of children changed."""
        self.params = {k: self.params[k] for k in self._own}
        self.grads = {k: self.grads[k] for k in self._own if k in self.grads}
        for cname, child in self.children.items():
            child.collect()
            prefix = f"{cname}." if cname else ""
            for k, v in child.params.items():
                self.params[prefix + k] = v
            for k, v in child.grads.items():
                self.grads[prefix + k] = v

    def freeze(self, name: str) -> None:
        """Stop computing the gradient of leaf parameter ``name``."""
        self.grads.pop(name, None)

    def zero_grad(self) -> None:
        if self.flat is not None:
            self.flat[1].fill(0)        # frozen entries of the buffer are never read
            return
        for g in self.grads.values():
            g.fill(0)

    def num_params(self) -> int:
        return sum(p.size for p in self.params.values())

    def modules(self, prefix: str = ""):
        """Yield (dotted name, module) for this module and every descendant, depth first."""
        yield prefix, self
        for cname, child in self.children.items():
            name = f"{prefix}.{cname}" if prefix and cname else (prefix or cname)
            yield from child.modules(name)

    def freeze_all(self) -> None:
        """Freeze every leaf parameter of the tree (LoRA fine-tuning trains adapters only)."""
        for _, m in self.modules():
            for name in m._own:
                m.freeze(name)
        self.flat = None                # adapters added next live outside the packed buffer
        self.collect()

    def pack(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Move every leaf parameter and gradient into one flat buffer each, matrices first.

        Afterwards each ``params``/``grads`` entry is a view into ``flat_params``/``flat_grads``,
        so the optimizer, clipping and ``zero_grad`` run as a handful of large array operations
        instead of a few per tensor. Returns (flat_params, flat_grads, n_matrix_entries): the
        first n entries are the matrices (what weight decay applies to).
        """
        leaves = [(m, k) for _, m in self.modules() for k in m._own]
        leaves.sort(key=lambda mk: mk[0].params[mk[1]].ndim < 2)          # stable: matrices first
        dtype = leaves[0][0].params[leaves[0][1]].dtype
        total = sum(m.params[k].size for m, k in leaves)
        flat_p, flat_g = np.empty(total, dtype), np.zeros(total, dtype)
        off = n_matrix = 0
        for m, k in leaves:
            p = m.params[k]
            view = flat_p[off:off + p.size].reshape(p.shape)
            view[...] = p
            m.params[k] = view
            if k in m.grads:
                m.grads[k] = flat_g[off:off + p.size].reshape(p.shape)
            off += p.size
            if p.ndim >= 2:
                n_matrix = off
        self.collect()
        self.flat = (flat_p, flat_g, n_matrix)
        return self.flat
