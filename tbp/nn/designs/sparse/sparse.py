"""Sparse attention while decoding: which cached tokens a new token attends to.
[LessIsMore: Yang et al., arXiv 2508.07101, as its authors' code implements it]

At a *selection layer* the new token attends densely, and its pre-softmax scores pick a set of
K cached positions; the layers after it, up to the next selection layer, attend only to that
set. Layers before the first selection layer stay dense. Three rules pick the set:

- ``lessismore``: K = sinks + middle + recent, middle = int(0.75 K) (``1 - recency``), the first
  ``sinks`` = 4 positions, and the last ``recent`` positions; the middle is ranked per head by
  score over the positions in between, and the heads' rankings are merged rank-major (every
  head's best, then every head's second best, ...), keeping each position once, until
  ``middle`` are chosen. One set, shared by all heads.
- ``topk``: each head keeps its own K best-scoring positions (the per-head baseline).
- ``window``: the sinks and the last K - sinks positions, no scores (the StreamingLLM baseline).
- ``layer-topk``: from the first selection layer on, *every* layer scores all cached positions
  and each head attends to its own K best there (Quest's per-layer choice, with exact scores
  where Quest bounds them page by page): the baseline that never reuses another layer's set,
  and so saves no score products -- a quality reference, not a speed-up.

With K >= the number of cached positions every rule keeps them all and decoding is dense.

Each kind is a :class:`Selection` in :data:`SELECTIONS` (``@selection("name")``), so a new rule
is its selection function and one registration. A :class:`SparseRule` is a decoding strategy
(decode.Inference's ``strategy``): each one-token step past its budget gets a
:class:`step.SparseStep`, the hook the attention layers ask which positions they read; the
decoder asks the rule (``per_head``, ``every_layer``, ``chooses_at``, ``keep``), never its name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ... import registry
from ...config import Options, option
from .step import SparseStep

SELECTIONS: dict = {}           # each kind of rule's Selection, registered below, in the command line's order


def selection(name: str) -> Callable:
    """Register a Selection as the rule kind ``name``."""
    return registry.register_in(SELECTIONS, "sparse rule", name)


@dataclass(frozen=True)
class Selection:
    """What a kind of rule is: ``keep(scores (B, H, n), rule)`` -> the kept positions, (B, K)
    one set for every head or (B, H, K) a set per head (``per_head``); ``every_layer``: every
    layer from the first selection layer on chooses its own set, rather than reusing the last
    selection layer's."""
    keep: Callable
    per_head: bool = False
    every_layer: bool = False


@dataclass(frozen=True)
class SparseFlags(Options):
    """Sparse decoding's options on the command lines that decode (tbp generate, attention,
    view, bench): ``sparse`` is the switch (None: dense decoding), the rest its companions."""
    sparse: str | None = option(None, "", choices=SELECTIONS)    # the kinds, as registered below
    budget: int = option(64, "With --sparse: cached tokens each new token attends to.", min=2)
    sparse_layers: str = option("1", "With --sparse: comma-separated selection layers (dense, and choosing the set "
                                     "for the layers after them); layers before the first stay dense.")
    recency: float = option(0.25, "With --sparse lessismore: the share of the budget given to the most recent "
                                  "tokens.", min=0, max=1, max_open=True)


@registry.strategy("sparse")
@dataclass(frozen=True)
class SparseRule:
    """How the decoder thins attention: the rule, the budget K, the selection layers (dense,
    and choosing the set for the layers after them), the share of the budget given to the
    recency window (LessIsMore), and the number of sink tokens."""
    kind: str = "lessismore"
    budget: int = 64
    layers: tuple[int, ...] = (1,)
    recency: float = 0.25
    sinks: int = 4
    use = "thin"                       # what a variant that cannot decode sparsely refuses (registry.USES)
    kinds = SELECTIONS                 # the rule kinds, the command line's choices
    # the command line (registry.STRATEGY's protocol): the flags, the switch's help for each use
    # of a decoder, and the flags only a command that samples has
    FLAGS = SparseFlags
    HELP = {"sample": "Sparse decoding: each new token attends to --budget cached tokens, chosen at the selection "
                      "layers (lessismore: one set merged across heads, plus sinks and a recency window; topk: per "
                      "head; window: sinks + the most recent).",
            "time": "Also time sparse decoding with this rule against dense, paired in one process, at a cache of "
                    "nearly the whole context (decode_*_tokens_per_s in --json).",
            "show": "Also show the positions a sparse decoder keeps at each step of the prompt.",
            "show instead": "Instead of weights, show which positions a sparse decoder keeps at each step of the "
                            "prompt (rows: the token being decoded; for topk, the share of heads keeping it)."}
    SAMPLING_ONLY = ("recency",)

    def __post_init__(self) -> None:
        if self.kind not in SELECTIONS:
            raise ValueError(f"sparse kind must be one of {', '.join(SELECTIONS)}, got {self.kind!r}")
        if self.budget < (1 if self.per_head else self.sinks + 2):
            raise ValueError(f"a budget of {self.budget} leaves no room beside {self.sinks} sink tokens")
        if not 0 <= self.recency < 1:
            raise ValueError(f"the recency share must be in [0, 1), got {self.recency}")
        if not self.layers or min(self.layers) < 0:
            raise ValueError("sparse decoding needs at least one selection layer (>= 0)")

    @property
    def per_head(self) -> bool:
        """Each head keeps its own set (topk, layer-topk), rather than one set for all heads."""
        return SELECTIONS[self.kind].per_head

    @property
    def every_layer(self) -> bool:
        """Every layer from the first selection layer on chooses its own set from its own scores
        (layer-topk), rather than reusing the last selection layer's."""
        return SELECTIONS[self.kind].every_layer

    @classmethod
    def from_flags(cls, flags: dict, given: set) -> SparseRule:
        """The rule the command line's flags (:class:`SparseFlags`, switched on) ask for;
        ``given``: the flags the user set. ValueError, naming the flag, for a bad budget or
        layer list or a flag this rule does not read."""
        if "recency" in given and flags["sparse"] != "lessismore":
            raise ValueError("--recency is for --sparse lessismore; drop it or add --sparse lessismore")
        try:
            layers = tuple(int(x) for x in flags["sparse_layers"].split(",") if x.strip())
            return cls(flags["sparse"], flags["budget"], layers, flags.get("recency", cls.recency))
        except ValueError as e:
            raise ValueError(f"--sparse-layers / --budget: {e}") from None

    def record(self) -> dict:
        """The rule as a JSON record (tbp generate --json, tbp bench --json)."""
        return {"kind": self.kind, "budget": self.budget, "layers": list(self.layers), "recency": self.recency}

    def describe(self) -> str:
        """The rule in a few words, for a stats line or a table."""
        return (f"sparse {self.kind}, budget {self.budget}, selection layer{'s' * (len(self.layers) > 1)} "
                f"{','.join(map(str, self.layers))}")

    def check(self, cfg) -> None:
        """ValueError unless every selection layer is one of the model's."""
        if max(self.layers) >= cfg.n_layer:
            raise ValueError(f"selection layer {max(self.layers)} does not exist: the model has {cfg.n_layer} layers")

    def step(self, t0: int, t1: int, n_ctx: int) -> SparseStep | None:
        """The hook of a one-token step at position t0: thinned once more than the budget is
        cached (within the cache: past n_ctx the ring reads every slot); None, a dense step."""
        return SparseStep(self) if self.budget < t1 <= n_ctx else None

    def chooses_at(self, layer: int) -> bool:
        """Whether ``layer`` scores every cached position densely and chooses a set."""
        return layer >= min(self.layers) if self.every_layer else layer in self.layers

    def keep(self, scores: np.ndarray) -> np.ndarray:
        """The positions to keep from a new row's scores (B, H, n): :func:`select`."""
        return select(scores, self)

    def split(self) -> tuple[int, int, int]:
        """(sinks, middle, recent) with sinks + middle + recent == budget."""
        middle = int((1 - self.recency) * self.budget)
        middle = min(middle, self.budget - self.sinks)
        return self.sinks, middle, self.budget - self.sinks - middle


def select(scores: np.ndarray, rule: SparseRule) -> np.ndarray:
    """Positions to keep, from the new token's pre-softmax scores (B, H, n) over n positions.

    Returns (B, K) sorted positions for lessismore and window (one set for every head), or
    (B, H, K) for topk and layer-topk (a set per head).
    """
    return SELECTIONS[rule.kind].keep(scores, rule)


def _best_per_head(scores: np.ndarray, rule: SparseRule) -> np.ndarray:
    """Each head's own K best-scoring positions, (B, H, K) sorted."""
    n, K = scores.shape[-1], rule.budget
    part = np.argpartition(scores, n - K, axis=-1)[..., n - K:]       # (B, H, K), any order
    return np.sort(part, axis=-1)


def _one_set(scores: np.ndarray, rule: SparseRule, middle: int, recent: int) -> np.ndarray:
    """The sinks, ``middle`` positions ranked rank-major over the heads, and the last
    ``recent``: one sorted set for every head, (B, K)."""
    B, H, n = scores.shape
    head = np.arange(rule.sinks)                                           # the sink positions
    tail = np.arange(n - recent, n)                                        # the recency window
    out = np.empty((B, rule.budget), dtype=np.int64)
    lo, hi = rule.sinks, n - recent                                        # the ranked range
    for b in range(B):
        picked = merge_rank_major(scores[b, :, lo:hi], middle) + lo
        out[b] = np.sort(np.concatenate([head, picked, tail]))
    return out


def _lessismore(scores: np.ndarray, rule: SparseRule) -> np.ndarray:
    _, middle, recent = rule.split()
    return _one_set(scores, rule, middle, recent)


def _window(scores: np.ndarray, rule: SparseRule) -> np.ndarray:
    return _one_set(scores, rule, 0, rule.budget - rule.sinks)            # no scores read


selection("lessismore")(Selection(_lessismore))
selection("topk")(Selection(_best_per_head, per_head=True))
selection("window")(Selection(_window))
selection("layer-topk")(Selection(_best_per_head, per_head=True, every_layer=True))


def merge_rank_major(scores: np.ndarray, count: int) -> np.ndarray:
    """``count`` distinct positions from per-head scores (H, m): rank each head's positions by
    score, then read the ranks row by row (every head's best first), keeping first occurrences;
    returned in that reading order.

    Without walking the reading: a position's first occurrence is at min over heads of
    rank * H + head, so the ``count`` positions with the smallest such key are the answer
    (keys are distinct, so the set is exact), one ``minimum.at`` and one partition away."""
    H, m = scores.shape
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    top = min(count, m)
    best = np.argpartition(scores, m - top, axis=-1)[:, m - top:]          # (H, top), unordered
    order = np.take_along_axis(scores, best, axis=-1).argsort(axis=-1, kind="stable")[:, ::-1]
    ranked = np.take_along_axis(best, order, axis=-1)                      # (H, top), best first
    never = H * top
    first = np.full(m, never, dtype=np.int64)                              # where each position is first read
    np.minimum.at(first, ranked.reshape(-1), (np.arange(top) * H + np.arange(H)[:, None]).reshape(-1))
    seen = np.flatnonzero(first < never)
    if seen.size > count:
        seen = seen[np.argpartition(first[seen], count - 1)[:count]]
    return seen[np.argsort(first[seen])].astype(np.int64)
