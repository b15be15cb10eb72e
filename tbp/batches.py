"""Batches for training and evaluation: what a model's loss reads, drawn from a dataset.

A batch is a dict of the model's loss arguments, one row per example (see parallel.py):

* text, any model: ``idx`` and ``targets`` (B, n_ctx), random windows, targets shifted by one;
* pairs, GPT: ``source <|sep|> target <|endoftext|>`` as one sequence, ``idx`` and ``targets``
  shifted by one, and ``weights`` 1 where the target is predicted (its tokens and the end
  token), 0 on the source and the padding: completion-only training;
* pairs, encoder-decoder: ``src`` (the source), ``tgt_in`` (``<|sep|>`` + target) and
  ``tgt_out`` (target + ``<|endoftext|>``), with ``weights`` 0 on padding;
* conversations, GPT: each conversation one row, ``weights`` its loss mask (chat.py).

Pair and conversation batches are as long as their longest example, padded with <|pad|>;
examples are never cut. Every draw comes from the generator passed in, so the same state gives the same batch.
"""
from __future__ import annotations

import numpy as np

from .data import Dataset, get_batch
from .errors import TbpError
from .nn import model_class


class DoesNotFit(TbpError):
    """The data does not suit this model's context. The message says why; ``new_run`` is the
    remedy a new run has (a flag of tbp train, worded to follow the message), which a fixed model
    -- resumed, fine-tuned or evaluated -- has not: only the caller that can take it adds it
    (:func:`tbp.runs.new_run`)."""

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

    def sample(self, split: str, batch_size: int, rng: np.random.Generator) -> dict:
        x, y = get_batch(getattr(self.ds, split), batch_size, self.n_ctx, rng)
        self._check(split, x)
        self._check(split, y[:, -1:])
        return {"idx": x, "targets": y}

    def _check(self, split: str, window: np.ndarray) -> None:
        """A split load did not scan (tbp.data._read_tokens) is checked a batch at a time."""
        if window.size and int(window.max()) >= self.vocab:
            raise TbpError(f"{self.ds.path / (split + '.bin')}: token id {int(window.max())} is outside the "
                           f"vocabulary ({self.vocab}); the file is damaged or belongs to another tokenizer")

    @staticmethod
    def tokens(batch: dict) -> int:
        return batch["idx"].size

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
            yield {"idx": window[:, :-1], "targets": window[:, 1:]}


class PairBatches:
    """Whole examples of a pairs dataset, laid out for the model's architecture."""

    def __init__(self, ds: Dataset, cfg):
        self.ds = ds
        self.two_streams = model_class(cfg).reads_source      # an encoder-decoder: source and target apart
        meta = ds.meta
        self.sep, self.eot, self.pad = meta["sep_id"], meta["eot_id"], meta["pad_id"]
        for split in ("train", "val"):
            if not len(getattr(ds, split)):
                raise TbpError(f"{ds.path}: the {split} split has no examples; prepare it with --val-fraction > 0")
        if not self.two_streams:
            need = meta["max_example_tokens"] + 1            # source, <|sep|>, target (inputs)
            if need > cfg.n_ctx:
                raise DoesNotFit(f"{ds.path}: its longest example is {need} tokens as one sequence (source, "
                                 f"separator, target), more than this model's context of {cfg.n_ctx}",
                                 f"; pass --n-ctx {need} or more")
        else:
            need = max(meta["max_source_tokens"], meta["max_target_tokens"] + 1)
            if need > cfg.n_ctx:
                raise DoesNotFit(f"{ds.path}: its longest source or target is {need} tokens (a target with its "
                                 f"start token), more than this model's context of {cfg.n_ctx}",
                                 f"; pass --n-ctx {need} or more")

    def sample(self, split: str, batch_size: int, rng: np.random.Generator) -> dict:
        n = len(getattr(self.ds, split))
        return self.collate(split, rng.integers(0, n, batch_size))

    @staticmethod
    def tokens(batch: dict) -> int:
        return int(np.count_nonzero(batch["weights"]))     # target tokens the loss is on

    def ordered(self, split: str, batch_size: int, every: int = 1):
        """Every example of the split once, in order (``every``: read whole, examples are few)."""
        n = len(getattr(self.ds, split))
        for i in range(0, n, batch_size):
            yield self.collate(split, np.arange(i, min(n, i + batch_size)))

    def examples(self, split: str, ids) -> list[tuple[np.ndarray, np.ndarray]]:
        part = getattr(self.ds, split)
        return [part.example(int(i)) for i in ids]

    def collate(self, split: str, ids) -> dict:
        pairs = self.examples(split, ids)
        B = len(pairs)
        if not self.two_streams:
            seqs = [np.concatenate([s, [self.sep], t, [self.eot]]) for s, t in pairs]
            T = max(len(q) for q in seqs) - 1
            idx = np.full((B, T), self.pad, np.int64)
            targets = np.full((B, T), self.pad, np.int64)
            weights = np.zeros((B, T), np.float32)
            for r, ((s, t), q) in enumerate(zip(pairs, seqs)):
                idx[r, :len(q) - 1], targets[r, :len(q) - 1] = q[:-1], q[1:]
                weights[r, len(s):len(q) - 1] = 1.0                  # predicting the target and the end
            return {"idx": idx, "targets": targets, "weights": weights}
        S = max(len(s) for s, _ in pairs)
        T = max(len(t) for _, t in pairs) + 1
        src = np.full((B, S), self.pad, np.int64)
        tgt_in = np.full((B, T), self.pad, np.int64)
        tgt_out = np.full((B, T), self.pad, np.int64)
        weights = np.zeros((B, T), np.float32)
        for r, (s, t) in enumerate(pairs):
            src[r, :len(s)] = s
            tgt_in[r, :len(t) + 1] = np.concatenate([[self.sep], t])
            tgt_out[r, :len(t) + 1] = np.concatenate([t, [self.eot]])
            weights[r, :len(t) + 1] = 1.0
        return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out, "weights": weights}


class ChatBatches:
    """Whole conversations (chat.py), one per row: ``idx`` and ``targets`` shifted by one,
    ``weights`` the dataset's loss mask (0 on the padding)."""

    def __init__(self, ds: Dataset, cfg):
        self.ds, self.pad = ds, ds.meta["pad_id"]
        if model_class(cfg).reads_source:
            raise TbpError(f"{ds.path}: conversations train a GPT (drop --arch encoder-decoder)")
        for split in ("train", "val"):
            if not len(getattr(ds, split)):
                raise TbpError(f"{ds.path}: the {split} split has no conversations")
        need = ds.meta["max_example_tokens"] - 1
        if need > cfg.n_ctx:
            raise DoesNotFit(f"{ds.path}: its longest conversation is {need} tokens of input, more than this "
                             f"model's context of {cfg.n_ctx}; prepare it with --max-tokens {cfg.n_ctx + 1} "
                             f"(whole messages are kept)", f", or pass --n-ctx {need} or more")

    def sample(self, split: str, batch_size: int, rng: np.random.Generator) -> dict:
        return self.collate(split, rng.integers(0, len(getattr(self.ds, split)), batch_size))

    @staticmethod
    def tokens(batch: dict) -> int:
        return int(np.count_nonzero(batch["weights"]))

    def ordered(self, split: str, batch_size: int, every: int = 1):
        """Every conversation of the split once, in order (``every``: read whole)."""
        n = len(getattr(self.ds, split))
        for i in range(0, n, batch_size):
            yield self.collate(split, np.arange(i, min(n, i + batch_size)))

    def collate(self, split: str, ids) -> dict:
        part = getattr(self.ds, split)
        rows = [part.row(int(i)) for i in ids]
        T = max(len(r[0]) for r in rows) - 1
        idx = np.full((len(rows), T), self.pad, np.int64)
        targets = np.full((len(rows), T), self.pad, np.int64)
        weights = np.zeros((len(rows), T), np.float32)
        for r, (seq, mask) in enumerate(rows):
            n = len(seq) - 1
            idx[r, :n], targets[r, :n], weights[r, :n] = seq[:-1], seq[1:], mask[1:]
        return {"idx": idx, "targets": targets, "weights": weights}


def batches_for(ds: Dataset, cfg) -> TextBatches | PairBatches | ChatBatches:
    """The batch maker for a dataset and a model config (it checks the examples fit the context)."""
    if ds.kind == "pairs":
        return PairBatches(ds, cfg)
    if ds.kind == "chat":
        return ChatBatches(ds, cfg)
    if model_class(cfg).reads_source:
        raise TbpError(f"{ds.path}: an encoder-decoder trains on paired data "
                       f"(tbp prepare --format pairs, or --task reverse); this dataset is plain text")
    return TextBatches(ds, cfg)
