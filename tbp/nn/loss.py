"""Softmax cross-entropy on shifted next-token targets, optionally weighted per token.   [paper §1]"""
from __future__ import annotations

import numpy as np


def cross_entropy(logits: np.ndarray, targets: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Mean of -log softmax(logits)[target] over all N = B*T positions (weighted mean with
    ``weights``). logits (B, T, V)."""
    return CrossEntropy().forward(logits, targets, weights)


class CrossEntropy:
    """loss = -(1/N) sum_n log p[n, y_n],  p = softmax(logits).   [paper §1]

    logits: (B, T, V); targets: (B, T) ints with targets[:, t] the token after input t.

    ``weights`` (B, T), w >= 0 with a positive sum: loss = sum_n w_n CE_n / sum_n w_n, the
    masked loss of completion-only training and of padded batches (w = 0 on a prompt or a pad
    token, 1 on a target token). With every weight 1 it equals the unweighted loss bit for bit:
    the same sum of the same terms, divided by the same N.
    """

    def __init__(self) -> None:
        self.cache = None

    def forward(self, logits: np.ndarray, targets: np.ndarray, weights: np.ndarray | None = None,
                overwrite: bool = False) -> float:
        """The mean loss. ``overwrite``: the logits are the caller's to lose, and become the
        probabilities (then the gradient) in place: one (N, V) array at the peak instead of three,
        the same numbers (a training step's largest array at a large vocabulary)."""
        V = logits.shape[-1]
        t = targets.reshape(-1)
        rows = np.arange(t.size)
        flat = logits.reshape(-1, V)
        top = flat.max(-1, keepdims=True)
        if overwrite:
            z = np.subtract(flat, top, out=flat)                           # (N, V)
            z_t = z[rows, t]                                               # read before exp overwrites z
            p = np.exp(z, out=z)
        else:
            z = flat - top
            z_t = z[rows, t]
            p = np.exp(z)
        s = p.sum(-1, keepdims=True)                                       # (N, 1)
        ce = np.log(s[:, 0]) - z_t                                         # (N,) per-token loss
        if weights is None:
            loss, w, total = float(np.mean(ce)), None, t.size
        else:
            w = np.asarray(weights, dtype=logits.dtype).reshape(-1)        # (N,)
            if w.shape != t.shape:
                raise ValueError(f"weights shape {np.shape(weights)} differs from targets {targets.shape}")
            total = np.add.reduce(w)
            if not total > 0 or (w < 0).any():
                raise ValueError("loss weights must be >= 0 with a positive sum")
            loss = float(np.add.reduce(w * ce) / total)
        p /= s
        self.cache = p, rows, t, w, total, logits.shape
        return loss

    def backward(self) -> np.ndarray:
        """[paper §1]  dlogits = (p - onehot(targets)) / N: softmax and log fused, no division by p.
        Weighted: row n is scaled by w_n / sum(w) (the derivative of the weighted mean)."""
        p, rows, t, w, total, shape = self.cache
        p[rows, t] -= 1
        if w is not None:
            p *= w[:, None]
        p /= p.dtype.type(total)
        self.cache = None
        return p.reshape(shape)
