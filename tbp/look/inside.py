"""What a trained model computes for a prompt, as numbers: the one source of `tbp attention`
(its terminal maps, pictures and --json) and of `tbp view`'s page.

Every function runs the model's own forward (or its decoder) and returns plain arrays; nothing
here draws, prints or writes.
"""
from __future__ import annotations

import numpy as np

from ..generate.sampling import Sampling, generate_ids
from ..nn.decode import Inference


def self_attention(model, ids: list[int]) -> list[np.ndarray]:
    """Each layer's attention weights (H, T, T) for the tokens ids: row t is what query t
    gives each key (a row sums to 1)."""
    return [w[0] for w in model.attention_weights(np.array([ids]))]


def cross(model, tok, ids: list[int]) -> dict:
    """An encoder-decoder's cross-attention for the source ids: the target is the model's greedy
    completion; row t of a map (H, T, S) is the decoder position that predicts target token t
    (``target[t]``), its cells what it reads in the source."""
    banned = tuple(i for i in (tok.sep_id, tok.pad_id) if i is not None)
    target = []
    for nxt in generate_ids(model, ids, model.config.n_ctx, Sampling(0.0, banned=banned),
                            np.random.default_rng(0), start=tok.sep_id):
        if int(nxt[0]) == tok.eot_id:
            break
        target.append(int(nxt[0]))
    tgt_in = np.array([[tok.sep_id, *target]])[:, :model.config.n_ctx]
    maps = model.attention_weights(np.array([ids]), tgt_in)["cross"]      # L x (1, H, T, S)
    rows = ([tok.decode([i]) for i in target] + ["<|endoftext|>"])[:tgt_in.shape[1]]
    return {"source": [tok.decode([i]) for i in ids], "target": rows, "maps": [m[0] for m in maps]}


def kept_positions(model, ids: list[int], rule) -> np.ndarray:
    """(T, T): row t is 1 where decoding token t (after tokens 0 .. t-1, one at a time) attends,
    under ``rule``, in the layers after its selection layer; a share of heads for per-head top-k.
    Rows whose cache holds no more than the budget are dense."""
    T = len(ids)
    kept = np.tril(np.ones((T, T)))
    decoder = Inference(model, 1, rule)
    decoder.forward(np.array([ids[:1]]))
    for t in range(1, T):
        decoder.forward(np.array([ids[t:t + 1]]), check=False)
        if decoder.last is not None and decoder.last.keep is not None:
            sets = decoder.last.keep[0]
            kept[t] = 0
            for s in (sets if sets.ndim == 2 else sets[None]):
                kept[t, s] += 1.0 / (len(sets) if sets.ndim == 2 else 1)
    return kept
