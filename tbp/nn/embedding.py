"""Token + position embedding.   [paper §2]"""
from __future__ import annotations

import numpy as np

from .module import Module


class Embedding(Module):
    """x[b, t] = wte[idx[b, t]] + wpe[pos0 + t].

    idx: (B, T) ints; x: (B, T, C); wte: (V, C); wpe: (n_ctx, C).
    """

    def __init__(self, vocab_size: int, n_ctx: int, d_model: int,
                 rng: np.random.Generator, dtype=np.float32, std: float = 0.02):
        super().__init__()
        self.param("wte", (rng.standard_normal((vocab_size, d_model)) * std).astype(dtype))
        self.param("wpe", (rng.standard_normal((n_ctx, d_model)) * std).astype(dtype))
        self.cache = None

    def forward(self, idx: np.ndarray, pos0: int = 0) -> np.ndarray:
        T = idx.shape[-1]
        self.cache = idx, pos0
        return self.params["wte"][idx] + self.params["wpe"][pos0:pos0 + T]   # (B, T, C)

    def backward(self, dout: np.ndarray) -> None:
        """dwte[v] += sum of dout over every (b, t) with idx[b, t] == v;  dwpe[t] += sum_b dout[b, t].

        Rows are scattered with ``np.add.at`` so a token repeated in the batch accumulates
        (plain fancy-index assignment would keep only the last write). The input is integer
        token ids, so there is no input gradient to return.
        """
        idx, pos0 = self.cache
        C = dout.shape[-1]
        if "wte" in self.grads:
            np.add.at(self.grads["wte"], idx.reshape(-1), dout.reshape(-1, C))
        if "wpe" in self.grads:
            self.grads["wpe"][pos0:pos0 + idx.shape[-1]] += dout.reshape(-1, idx.shape[-1], C).sum(0)
