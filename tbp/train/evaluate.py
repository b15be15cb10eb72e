"""Evaluating a trained model on a dataset's validation split: loss, bits per byte, and for
paired data the exact match of greedy completions. Numbers only; the CLI renders them."""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..data.batches import PairBatches, batches_for
from ..data.datasets import Dataset
from ..nn.gpt import LanguageModel, drop_caches
from ..nn.decode import Inference


SPLIT_EVAL_TOKENS = 1 << 20      # the most a run's final evaluation reads: beyond, every k-th window


def split_loss(model: LanguageModel, ds: Dataset, split: str = "val", batch_size: int = 32, losses=None,
               every: int = 1) -> tuple[float, int]:
    """(mean loss per loss-bearing token, tokens) over the whole split, in order: every
    non-overlapping window of text, or every example of a pairs dataset (its target tokens).
    ``losses`` maps a list of batches to their mean losses (a trainer's workers; default: the
    model, one batch at a time); ``every``: a text split's every k-th window only. The sum runs
    batch by batch in order, so a trainer's figure and ``tbp eval``'s are the same number."""
    batches = batches_for(ds, model.config, model.collation)
    losses = losses or (lambda group: [model.batch_loss(b) for b in group])
    total, tokens = 0.0, 0
    ordered = batches.ordered(split, batch_size, every)
    with np.errstate(over="ignore", invalid="ignore"):
        while group := list(itertools.islice(ordered, 8)):          # a few batches at a time, for the workers
            for b, loss in zip(group, losses(group)):
                n = b.tokens
                total += loss * n
                tokens += n
    return total / max(tokens, 1), tokens


def split_stride(ds: Dataset, limit: int = SPLIT_EVAL_TOKENS) -> int:
    """k such that every k-th window of a text split reads at most about ``limit`` tokens (1:
    the whole split); paired and chat splits are read whole."""
    if ds.kind != "text":
        return 1
    return max(1, -(-ds.val.size // limit))


def fixed_batches_loss(losses, eval_sets: dict, ds: Dataset) -> dict:
    """A training curve's point: the mean loss over each split's fixed eval batches
    (``eval_sets``: split -> batches, the same windows at every evaluation, so points compare)
    as val_loss and eval_train_loss, and val_bpb. ``losses`` maps batches to their losses (a
    trainer's workers)."""
    out = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for split, batches in eval_sets.items():
            out[f"{split if split == 'val' else 'eval_train'}_loss"] = float(np.mean(losses(batches)))
    out["val_bpb"] = out["val_loss"] / math.log(2) / ds.bytes_per_loss_token
    return out


def val_split_figures(model: LanguageModel, ds: Dataset, batch_size: int, losses) -> dict:
    """A run's final figures: the mean loss over the validation split itself, in order -- what
    ``tbp eval`` reports -- rather than the fixed batches' estimate: every window of a text split
    up to SPLIT_EVAL_TOKENS, every k-th beyond (``val_split_every``). Batches of the training's
    rows, one per worker at a time: within the step's memory (memory.py)."""
    every = split_stride(ds)
    loss, tokens = split_loss(model, ds, "val", batch_size, losses=losses, every=every)
    return {"val_split_loss": loss, "val_split_tokens": tokens, "val_split_every": every,
            "val_split_bpb": loss / math.log(2) / ds.bytes_per_loss_token}


def token_accuracy(model: LanguageModel, ds: Dataset, split: str = "val", batch_size: int = 32) -> float:
    """Share of a pairs split's target tokens (each with its end token) that the model ranks
    first given the true tokens before it (teacher forcing): 1/V is chance."""
    batches = batches_for(ds, model.config, model.collation)
    right = total = 0
    for batch in batches.ordered(split, batch_size):
        if batch.source is None:
            logits = model.forward(batch.idx, keep=False)            # nothing kept for a backward
        else:
            logits = model.forward(batch.source, batch.idx)
            drop_caches(model)
        scored = batch.weights > 0
        right += int(np.count_nonzero((logits.argmax(-1) == batch.targets) & scored))
        total += int(np.count_nonzero(scored))
    return right / max(total, 1)


def greedy_targets(model: LanguageModel, batches: PairBatches, split: str, ids: np.ndarray,
                   max_new_tokens: int | None = None) -> list[np.ndarray]:
    """The greedy completion of each example ``ids`` of the split, up to <|endoftext|>, with
    the KV cache: an encoder-decoder's examples in one batch (padded sources, masked), a GPT's
    grouped by prompt length (source + <|sep|>), so that each group is one batch."""
    examples = batches.examples(split, ids)
    n_ctx = model.config.n_ctx
    out: list = [None] * len(examples)
    if model.reads_source:
        src = batches.collate(split, ids).source
        limit = n_ctx if max_new_tokens is None else min(n_ctx, max_new_tokens)
        return _greedy(model, src, np.full((len(ids), 1), batches.sep), limit, batches)
    by_length: dict[int, list[int]] = {}
    for r, (s, _) in enumerate(examples):
        by_length.setdefault(len(s), []).append(r)
    for length, rows in by_length.items():
        prompts = np.array([np.concatenate([examples[r][0], [batches.sep]]) for r in rows])
        limit = n_ctx - prompts.shape[1] + 1
        limit = limit if max_new_tokens is None else min(limit, max_new_tokens)
        for r, got in zip(rows, _greedy(model, None, prompts, limit, batches)):
            out[r] = got
    return out


def _greedy(model, src, prompts: np.ndarray, limit: int, batches: PairBatches) -> list[np.ndarray]:
    """Argmax decoding of len(prompts) sequences until each gives <|endoftext|> or ``limit``
    tokens; <|sep|> and <|pad|> are never chosen (no target holds them)."""
    B, eot = len(prompts), batches.eot
    banned = [batches.sep, batches.pad]
    decoder = Inference(model, B)
    if src is not None:
        decoder.encode(src)
    logits = decoder.forward(prompts)[:, -1]
    done = np.zeros(B, bool)
    got: list[list[int]] = [[] for _ in range(B)]
    for step in range(limit):
        logits[:, banned] = -np.inf
        nxt = logits.argmax(-1)
        for r in np.flatnonzero(~done):
            if nxt[r] == eot:
                done[r] = True
            else:
                got[r].append(int(nxt[r]))
        if done.all() or step == limit - 1:
            break
        logits = decoder.forward(nxt[:, None].astype(np.int64), check=False)[:, -1]
    return [np.array(g, dtype=np.int64) for g in got]


def exact_match(model: LanguageModel, ds: Dataset, split: str = "val", limit: int | None = None,
                batch_size: int = 256) -> tuple[float, int]:
    """(share of examples whose greedy completion is exactly the target, examples)."""
    batches = batches_for(ds, model.config, model.collation)
    n = len(getattr(ds, split))
    n = n if limit is None else min(n, limit)
    right = 0
    for start in range(0, n, batch_size):
        ids = np.arange(start, min(n, start + batch_size))
        for (_, target), got in zip(batches.examples(split, ids), greedy_targets(model, batches, split, ids)):
            right += len(got) == len(target) and bool(np.all(got == target))
    return right / max(n, 1), n


def evaluate(model: LanguageModel, ds: Dataset, limit: int | None = None, batch_size: int = 32) -> dict:
    """val_loss, val_bpb and the number of loss-bearing tokens; for pairs also token_accuracy,
    exact_match and examples. ``batch_size``: sequences per forward (memory.eval_bytes)."""
    loss, tokens = split_loss(model, ds, batch_size=batch_size)
    out = {"val_loss": loss, "val_bpb": loss / math.log(2) / ds.bytes_per_loss_token, "val_tokens": tokens}
    if ds.kind == "pairs":
        out["token_accuracy"] = token_accuracy(model, ds, batch_size=batch_size)
        out["exact_match"], out["examples"] = exact_match(model, ds, limit=limit)
    return out
