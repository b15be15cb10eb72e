"""A batch, as every language model reads it, and how an architecture lays paired examples out.

``Batch`` is one value for every architecture: ``idx`` what the (decoder) stack reads,
``targets`` what it predicts, ``weights`` the loss mask, ``source`` what an encoder reads
first (None for a GPT), ``noise`` each row's dropout seed. A model's ``batch_loss`` and
``batch_accumulate`` take it, so the trainer, the evaluator and the data-parallel split
never ask which architecture they hold.

A pair (source, target) is laid out by the architecture that reads it (its ``collation``:
``need(meta)``, ``collate(pairs, sep, eot, pad)``, ``derived(kind, meta)`` (the config fields
the architecture takes from a dataset), ``describe`` and ``refuses``, the refusal of text and
conversations or None). Here the GPT's, :class:`OneSequence`: ``source <|sep|>
target <|endoftext|>`` as one sequence, ``idx``/``targets`` shifted by one, ``weights`` 1 on
the target and its end token only -- completion-only training. An architecture of the
designs wing brings its own (the encoder-decoder's ``SourceApart``, designs/encdec). Every
collation pads to the batch's longest example with <|pad|>; examples are never cut. This module is a
leaf: the data layer (tbp/data/batches.py) uses it without loading a layer of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Batch:
    """B rows: ``idx``, ``targets`` (B, T) int64; ``weights`` (B, T) float32 or None (every
    token counts); ``source`` (B, S) int64 or None; ``noise`` (B,) dropout seeds or None."""

    idx: np.ndarray
    targets: np.ndarray
    weights: np.ndarray | None = None
    source: np.ndarray | None = None
    noise: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.idx)

    @property
    def tokens(self) -> int:
        """Tokens the loss is on: every one, or those of nonzero weight."""
        return self.idx.size if self.weights is None else int(np.count_nonzero(self.weights))

    def rows(self, lo: int, hi: int) -> "Batch":
        """Rows [lo, hi) of every field (a worker's or a rank's part)."""
        return Batch(*(None if a is None else a[lo:hi]
                       for a in (self.idx, self.targets, self.weights, self.source, self.noise)))

    def with_noise(self, noise: np.ndarray) -> "Batch":
        return replace(self, noise=noise)


class OneSequence:
    """A GPT's pairs: source, <|sep|>, target and <|endoftext|> as one sequence."""

    describe = "GPT, loss on the targets"
    refuses = None                  # text and conversations are one sequence too

    @staticmethod
    def need(meta: dict) -> tuple[int, str]:
        """Context the longest example needs (its inputs: the end token is only predicted), and
        that said as the end of "its longest ..."."""
        n = meta["max_example_tokens"] + 1
        return n, f"example is {n} tokens as one sequence (source, separator, target)"

    @staticmethod
    def derived(kind: str, meta: dict) -> dict:
        """Nothing: a GPT reads every dataset with the config it is given."""
        return {}

    @staticmethod
    def collate(pairs: list, sep: int, eot: int, pad: int) -> Batch:
        seqs = [np.concatenate([s, [sep], t, [eot]]) for s, t in pairs]
        B, T = len(seqs), max(len(q) for q in seqs) - 1
        idx = np.full((B, T), pad, np.int64)
        targets = np.full((B, T), pad, np.int64)
        weights = np.zeros((B, T), np.float32)
        for r, ((s, _), q) in enumerate(zip(pairs, seqs)):
            idx[r, :len(q) - 1], targets[r, :len(q) - 1] = q[:-1], q[1:]
            weights[r, len(s):len(q) - 1] = 1.0                  # predicting the target and the end
        return Batch(idx, targets, weights)
