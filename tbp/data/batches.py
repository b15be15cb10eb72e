"""Batches for training and evaluation, drawn from a dataset as :class:`tbp.nn.batch.Batch`
values, one row per example:

* text: ``idx`` and ``targets`` (B, n_ctx), random windows, targets shifted by one;
* pairs: laid out by the architecture that reads them (its ``collation``: tbp/nn/batch.py, designs/encdec): one
  sequence with the loss on the target for a GPT, the source apart for an encoder-decoder;
* conversations: each conversation one row, ``weights`` its loss mask (chat.py).

Pair and conversation batches are as long as their longest example, padded with <|pad|>;
examples are never cut. Every draw comes from the generator passed in, so the same state gives
the same batch.
"""
from __future__ import annotations

import numpy as np

from .datasets import Dataset, get_batch
from ..errors import TbpError
from ..nn.batch import Batch


class DoesNotFit(TbpError):
    """The data does not suit this model's context. The message says why; ``new_run`` is the
    remedy a new run has (a flag of tbp train, worded to follow the message), which a fixed model
    -- resumed, fine-tuned or evaluated -- has not: only the caller that can take it adds it
    (:func:`tbp.train.launch.new_run`)."""

    def __init__(self, message: str, new_run: str):
        super().__init__(message)
        self.new_run = new_run


class TextBatches:
    """Random windows of n_ctx + 1 tokens."""

    def __init__(self, ds: Dataset, cfg):
        self.ds, self.n_ctx, self.vocab = ds, cfg.n_ctx, ds.meta["vocab_size"]
        for split in ("train", "val"):
            n = getattr(ds, split).size
            if n < self.n_ctx + 1:
                raise DoesNotFit(f"{ds.path}: the {split} split has {n} tokens, fewer than one block "
                                 f"of this model's context {self.n_ctx} + 1; use more text", " or a smaller --n-ctx")

    def sample(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        x, y = get_batch(getattr(self.ds, split), batch_size, self.n_ctx, rng)
        self._check(split, x)
        self._check(split, y[:, -1:])
        return Batch(x, y)

    def _check(self, split: str, window: np.ndarray) -> None:
        """A split load did not scan (tbp.data.datasets._read_tokens) is checked a batch at a time."""
        if window.size and int(window.max()) >= self.vocab:
            raise TbpError(f"{self.ds.path / (split + '.bin')}: token id {int(window.max())} is outside the "
                           f"vocabulary ({self.vocab}); the file is damaged or belongs to another tokenizer")

    def ordered(self, split: str, batch_size: int, every: int = 1):
        """Every whole window of the split once, in order (evaluation): non-overlapping
        n_ctx-token windows, batch_size at a time; with ``every`` k, every k-th of them."""
        data = getattr(self.ds, split)
        T = self.n_ctx
        starts = np.arange(0, data.size - T, T)[::every]
        for i in range(0, len(starts), batch_size):
            rows = starts[i:i + batch_size, None] + np.arange(T + 1)[None, :]
            window = np.asarray(data[rows], dtype=np.int64)
            self._check(split, window)
            yield Batch(window[:, :-1], window[:, 1:])


class PairBatches:
    """Whole examples of a pairs dataset, laid out as the model's architecture reads them
    (``collation``: the model's, tbp.nn.batch.OneSequence or the encoder-decoder's SourceApart)."""

    def __init__(self, ds: Dataset, cfg, collation):
        self.ds, self.collation = ds, collation
        meta = ds.meta
        self.sep, self.eot, self.pad = meta["sep_id"], meta["eot_id"], meta["pad_id"]
        for split in ("train", "val"):
            if not len(getattr(ds, split)):
                raise TbpError(f"{ds.path}: the {split} split has no examples; prepare it with --val-fraction > 0")
        need, said = collation.need(meta)
        if need > cfg.n_ctx:
            raise DoesNotFit(f"{ds.path}: its longest {said}, more than this model's context of {cfg.n_ctx}",
                             f"; pass --n-ctx {need} or more")

    def sample(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        n = len(getattr(self.ds, split))
        return self.collate(split, rng.integers(0, n, batch_size))

    def ordered(self, split: str, batch_size: int, every: int = 1):
        """Every example of the split once, in order (``every``: read whole, examples are few)."""
        n = len(getattr(self.ds, split))
        for i in range(0, n, batch_size):
            yield self.collate(split, np.arange(i, min(n, i + batch_size)))

    def examples(self, split: str, ids) -> list[tuple[np.ndarray, np.ndarray]]:
        part = getattr(self.ds, split)
        return [part.example(int(i)) for i in ids]

    def collate(self, split: str, ids) -> Batch:
        return self.collation.collate(self.examples(split, ids), self.sep, self.eot, self.pad)


class ChatBatches:
    """Whole conversations (chat.py), one per row: ``idx`` and ``targets`` shifted by one,
    ``weights`` the dataset's loss mask (0 on the padding)."""

    def __init__(self, ds: Dataset, cfg, collation):
        self.ds, self.pad = ds, ds.meta["pad_id"]
        if collation.refuses:
            raise TbpError(f"{ds.path}: conversations train a GPT; {collation.refuses}")
        for split in ("train", "val"):
            if not len(getattr(ds, split)):
                raise TbpError(f"{ds.path}: the {split} split has no conversations")
        need = ds.meta["max_example_tokens"] - 1
        if need > cfg.n_ctx:
            raise DoesNotFit(f"{ds.path}: its longest conversation is {need} tokens of input, more than this "
                             f"model's context of {cfg.n_ctx}; prepare it with --max-tokens {cfg.n_ctx + 1} "
                             f"(whole messages are kept)", f", or pass --n-ctx {need} or more")

    def sample(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        return self.collate(split, rng.integers(0, len(getattr(self.ds, split)), batch_size))

    def ordered(self, split: str, batch_size: int, every: int = 1):
        """Every conversation of the split once, in order (``every``: read whole)."""
        n = len(getattr(self.ds, split))
        for i in range(0, n, batch_size):
            yield self.collate(split, np.arange(i, min(n, i + batch_size)))

    def collate(self, split: str, ids) -> Batch:
        part = getattr(self.ds, split)
        rows = [part.row(int(i)) for i in ids]
        T = max(len(r[0]) for r in rows) - 1
        idx = np.full((len(rows), T), self.pad, np.int64)
        targets = np.full((len(rows), T), self.pad, np.int64)
        weights = np.zeros((len(rows), T), np.float32)
        for r, (seq, mask) in enumerate(rows):
            n = len(seq) - 1
            idx[r, :n], targets[r, :n], weights[r, :n] = seq[:-1], seq[1:], mask[1:]
        return Batch(idx, targets, weights)


def batches_for(ds: Dataset, cfg, collation) -> TextBatches | PairBatches | ChatBatches:
    """The batch maker for a dataset and a model config (it checks the examples fit the
    context); ``collation``: how the model's architecture reads a pair (its class's ``collation``)."""
    if ds.kind == "pairs":
        return PairBatches(ds, cfg, collation)
    if ds.kind == "chat":
        return ChatBatches(ds, cfg, collation)
    if collation.refuses:
        raise TbpError(f"{ds.path}: {collation.refuses}; this dataset is plain text")
    return TextBatches(ds, cfg)
