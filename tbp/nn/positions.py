"""Positions: how attention knows where a token is, as one object the builder hands in.

The core layers ask a positions object four things and never its name:

    embeds          a learned vector per position is added to the input (Embedding's wpe);
                    without it a model reads any length, past the context as a sliding
                    window of ``n_ctx`` positions, and its KV cache slides with it
    rotates         queries and keys are transformed by position before their product, so a
                    constant shift of the keys no longer cancels in the softmax
    rotate(q, k) / rotate_back(dq, dk) / rotate_rows(qk, out, step)
                    that transform, its transpose, and its in-place form for a decoding step
    bias(rows, keys, dtype)
                    an additive term on the scaled scores S[h, i, j] for queries at positions
                    ``rows`` (..., Tq) and keys at positions ``keys`` (Tk,): (..., H, Tq, Tk);
                    ``bias = None`` where the scheme has none. It has no parameter and enters S
                    additively, so the backward of attention is unchanged by it (dS is dS):
                    only the forward, the flash backward's recomputed P and the KV cache add it.

:class:`Positions` is the base and, as it is, learned positions (GPT-2's, the default): the
vector per position is the embedding's, so it transforms nothing and adds nothing. Other schemes live with the designs
(rotary positions and more in ``tbp/nn/designs/``) and register with
``registry.positions``.
"""
from __future__ import annotations

import numpy as np

from . import registry


class Positions:
    """The positions protocol; as it is, learned absolute positions: wpe (n_ctx, C) added to
    the token embedding (embedding.py), nothing done in attention."""

    embeds = True
    rotates = False

    def window(self, n_ctx: int) -> int | None:
        """How many positions a query reads at most: all of them (None) when positions are
        learned (nothing reads past the table); else the context, so that a sequence longer
        than it is sliding-window attention, exactly what the sliding KV cache computes."""
        return None if self.embeds else n_ctx

    def rotate(self, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """q (B, H, T, Dk), k (B, Hkv, T, Dk) at positions 0 .. T-1 -> what the kernel reads."""
        return q, k

    def rotate_back(self, dq: np.ndarray, dk: np.ndarray) -> None:
        """The transpose of :meth:`rotate`, in place on the gradients."""

    def rotate_rows(self, qk: np.ndarray, out: np.ndarray, step) -> None:
        """A decoding step's queries and keys (B, Tn, H + Hkv, Dk), in place (``out`` is scratch
        of that shape) at the step's positions (decode.Step)."""

    # A scheme with a score term defines bias(rows, keys, dtype) -> (..., H, Tq, Tk); None here
    # says there is none, so the kernels and the decoding step skip it without a call.
    bias = None


LEARNED = Positions()


def add_bias(scores: np.ndarray, bias, rows: np.ndarray, keys: np.ndarray) -> None:
    """scores (B, H, Tq, Tk) += bias(rows, keys) (H, Tq, Tk), the positions term of queries at
    positions ``rows`` (Tq,) and keys at ``keys`` (Tk,)."""
    scores += bias(rows, keys, scores.dtype)


@registry.positions("learned")
def learned(cfg) -> Positions:
    return LEARNED
