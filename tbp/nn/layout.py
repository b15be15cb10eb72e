"""Layout: the trainable parameters of a model packed into one flat buffer, and their gradients
into another, so the optimizer, clipping, zeroing and the data-parallel gradient sum are each
a few operations over one array instead of a few per tensor.

Only trainable leaves are packed (everything for full training, the adapters for LoRA);
frozen tensors stay plain arrays. Matrices come first, so weight decay (matrices only) is
one contiguous prefix of the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .module import Module, _join


@dataclass(frozen=True)
class Entry:
    """Where one trainable tensor lives in the flat buffers."""
    offset: int
    shape: tuple[int, ...]
    decays: bool                # AdamW's weight decay applies (a matrix: ndim >= 2)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def view(self, flat: np.ndarray) -> np.ndarray:
        return flat[self.offset:self.offset + self.size].reshape(self.shape)


class Layout:
    """name -> Entry over the trainable leaves of ``module``; ``params`` and ``grads`` are the
    flat buffers every trainable parameter and gradient of the module is now a view into.

    >>> from tbp.nn import GPT, ModelConfig
    >>> model = GPT(ModelConfig(vocab_size=11, n_ctx=8, n_layer=1, n_head=2, d_model=8))
    >>> model.layout.entries["wte"].shape, model.layout.size == model.num_params()
    ((11, 8), True)
    """

    def __init__(self, module: Module):
        leaves = [(_join(prefix, k), m, k) for prefix, m in module.modules() for k in m._grads]
        if not leaves:
            raise ValueError("nothing to train: every parameter is frozen")
        leaves.sort(key=lambda leaf: leaf[1]._params[leaf[2]].ndim < 2)      # stable: matrices first
        dtype = leaves[0][1]._params[leaves[0][2]].dtype
        self.entries: dict[str, Entry] = {}
        offset = 0
        for name, m, k in leaves:
            p = m._params[k]
            self.entries[name] = Entry(offset, p.shape, p.ndim >= 2)
            offset += p.size
        self.size = offset
        self.n_decay = sum(e.size for e in self.entries.values() if e.decays)   # the decayed prefix
        self.params = np.empty(self.size, dtype)
        self.grads = np.zeros(self.size, dtype)
        for (name, m, k), e in zip(leaves, self.entries.values()):
            view = e.view(self.params)
            view[...] = m._params[k]
            m._params[k] = view
            m._grads[k] = e.view(self.grads)

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """name -> the tensor-shaped view of a buffer laid out like ``params`` (moments, grads)."""
        return {name: e.view(flat) for name, e in self.entries.items()}

    def with_grads(self, replica: Module) -> "Layout":
        """The layout of ``replica`` (a copy of the same tree that shares the parameters): the
        same entries and parameter buffer, and a gradient buffer of its own, which the
        replica's trainable gradients become views into."""
        twin = object.__new__(Layout)
        twin.__dict__.update(self.__dict__)                   # the same entries and parameters
        twin.grads = np.zeros_like(self.grads)
        leaves = {_join(prefix, k): (m, k) for prefix, m in replica.modules() for k in m._grads}
        if leaves.keys() != self.entries.keys():
            raise ValueError("the replica's trainable parameters differ from this layout's")
        for name, e in self.entries.items():
            m, k = leaves[name]
            m._grads[k] = e.view(twin.grads)
        return twin
