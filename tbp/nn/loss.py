"""Softmax cross-entropy on shifted next-token targets.   [paper §1]"""
from __future__ import annotations

import numpy as np


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean of -log softmax(logits)[target] over all N = B*T positions. logits (B, T, V)."""
    return CrossEntropy().forward(logits, targets)


class CrossEntropy:
    """loss = -(1/N) sum_n log p[n, y_n],  p = softmax(logits).   [paper §1]

    logits: (B, T, V); targets: (B, T) ints with targets[:, t] the token after input t.
    """

    def __init__(self) -> None:
        self.cache = None

    def forward(self, logits: np.ndarray, targets: np.ndarray) -> float:
        V = logits.shape[-1]
        z = logits.reshape(-1, V) - logits.reshape(-1, V).max(-1, keepdims=True)   # (N, V)
        p = np.exp(z)
        s = p.sum(-1, keepdims=True)                                       # (N, 1)
        t = targets.reshape(-1)
        rows = np.arange(t.size)
        loss = float(np.mean(np.log(s[:, 0]) - z[rows, t]))
        p /= s
        self.cache = p, rows, t, logits.shape
        return loss

    def backward(self) -> np.ndarray:
        """[paper §1]  dlogits = (p - onehot(targets)) / N: softmax and log fused, no division by p."""
        p, rows, t, shape = self.cache
        p[rows, t] -= 1
        p /= p.dtype.type(t.size)
        self.cache = None
        return p.reshape(shape)
