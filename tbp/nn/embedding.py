"""Token + position embedding.   [paper §2]"""
from __future__ import annotations

import numpy as np

from . import init
from .module import Module


class Embedding(Module):
    """x[b, t] = wte[idx[b, t]] + wpe[t]   (without wpe when positions are rotary: designs/rope).

    idx: (B, T) ints; x: (B, T, C); wte: (V, C); wpe: (n_ctx, C).
    """

    def __init__(self, vocab_size: int, n_ctx: int, d_model: int,
                 rng: np.random.Generator, dtype=np.float32, std: float = 0.02, learned_positions: bool = True):
        super().__init__()
        self.param("wte", init.normal(rng, (vocab_size, d_model), std, dtype))
        if learned_positions:
            self.param("wpe", init.normal(rng, (n_ctx, d_model), std, dtype))

    def forward(self, idx: np.ndarray) -> np.ndarray:
        self.cache = idx
        x = self.params["wte"][idx]                                        # (B, T, C), a copy
        if "wpe" in self.params:
            x += self.params["wpe"][:idx.shape[-1]]
        return x

    def backward(self, dout: np.ndarray) -> None:
        """[paper §2]  dwte[v] += sum of dout over every (b, t) with idx[b, t] == v;
        dwpe[t] += sum_b dout[b, t].

        A token repeated in the batch must accumulate (plain fancy-index assignment would
        keep only the last write): rows are sorted by token id and each run of equal ids is
        summed with ``np.add.reduceat`` -- a segment sum, much faster than ``np.add.at``.
        The input is integer token ids, so there is no input gradient to return.
        """
        idx = self.cache
        B, T = idx.shape
        C = dout.shape[-1]
        if "wte" in self.grads:
            ids = idx.reshape(-1)                                          # (N,)
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
            sums = np.add.reduceat(dout.reshape(-1, C)[order], starts, axis=0)   # (unique, C)
            self.grads["wte"][sorted_ids[starts]] += sums                  # unique rows: no collision
        if "wpe" in self.grads:
            self.grads["wpe"][:T] += dout.reshape(B, T, C).sum(0)

    # --- inference (decode.py) --------------------------------------------------------------
    def decode(self, idx: np.ndarray, t0: int, out: np.ndarray, positions: np.ndarray | None = None) -> None:
        """out (B*Tn, C) = the embeddings of tokens idx (B, Tn) at positions t0 .. t0+Tn-1, or with
        ``positions`` (B,) one token per row, each at its own position."""
        B, Tn = idx.shape
        self.params["wte"].take(idx.reshape(-1), axis=0, out=out)
        wpe = self.params.get("wpe")
        if wpe is None:
            return
        if positions is not None:
            out += wpe[positions]
        elif Tn == 1:
            out += wpe[t0]
        else:
            out.reshape(B, Tn, -1)[...] += wpe[t0:t0 + Tn]
