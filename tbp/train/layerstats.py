"""Per-layer training statistics: what each layer's gradient, update and input do over training.

At every evaluation the training loop records, under ``layers`` in that metrics line:

- ``grad_norm``: each parameter group's gradient norm, ||g_group||, summed over the batch and
  before clipping (the total ``grad_norm`` is the root of their squares' sum);
- ``update_ratio``: each group's update over its weights, ||theta' - theta|| / ||theta||, of
  that step's AdamW update (a healthy run sits near 1e-3; far above, the step is too large);
- ``stream_rms``: the RMS of what each sublayer reads before its norm, then of the state
  handed to ln_f (2 L + 1 numbers): the residual stream under a sum, whose growth with depth
  is what Attention Residuals address; measured on two rows of the first fixed validation batch;
- ``stats_ms``: what computing all of it took, so that its cost is measured in every run.

Groups are the model's layers: wte, wpe, h.0.attn, h.0.mlp, h.0.ln_1, ..., ln_f (an
encoder-decoder's encoder under enc.). Numbers only: nothing here prints or writes.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict

import numpy as np

from ..nn.batch import Batch


def group_of(name: str) -> str:
    """The layer a parameter belongs to: h.0.attn.c_attn.weight -> h.0.attn, wte -> wte."""
    enc = name.startswith("enc.")
    parts = name.split(".")[enc:]
    return ("enc." if enc else "") + (".".join(parts[:3]) if parts[0] == "h" else parts[0])


IN_BLOCK = {"attn_res": 0, "ln_1": 1, "attn": 2, "ln_cross": 3, "cross": 4, "mlp_res": 5, "ln_2": 6, "mlp": 7}


def _order(group: str):
    enc = group.startswith("enc.")
    parts = group.split(".")[enc:]
    if parts[0] == "h":                        # a block's layers in the order its forward runs them
        return (not enc, 1, int(parts[1]), IN_BLOCK.get(parts[2], 8), parts[2])
    return (not enc, {"wte": 0, "wpe": 0}.get(parts[0], 2), {"wte": 0, "wpe": 1}.get(parts[0], 0), 0, parts[0])


def groups(names) -> "OrderedDict[str, list[str]]":
    """Parameter names by layer, in the model's order (embeddings, blocks, final norm, head)."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(group_of(name), []).append(name)
    return OrderedDict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _norm(arrays) -> float:
    return math.sqrt(sum(float(np.vdot(a, a)) for a in arrays))


class LayerStats:
    """The statistics of one training step, in its order: ``gradients()`` after the gradient
    is complete, ``before_update()`` just before the optimizer step, ``updates()`` after it,
    and ``stream(batch)`` at the evaluation; ``record()`` hands the line's ``layers`` entry."""

    def __init__(self, model):
        self.model = model
        self.groups = groups(model.layout.entries)
        self.out: dict = {}
        self.seconds = 0.0
        self._before = None

    def _timed(self, f):
        t0 = time.perf_counter()
        try:
            return f()
        finally:
            self.seconds += time.perf_counter() - t0

    def gradients(self, sync=None) -> None:
        """``sync`` (gradsync.GradientSync): under a sharded optimizer each rank holds the summed
        gradient of its own slice only, so each group's squares are summed over the ranks."""
        layout = self.model.layout
        lo, hi = sync.owned if sync is not None else (0, layout.size)

        def norms():
            squares = np.zeros(len(self.groups))
            for j, names in enumerate(self.groups.values()):
                for n in names:                  # the part of each tensor inside the owned slice
                    e = layout.entries[n]
                    g = layout.grads[max(e.offset, lo):min(e.offset + e.size, hi)]
                    squares[j] += float(np.vdot(g, g))
            if sync is not None and sync.shard:
                sync.world.sum_(squares)
            return {g: math.sqrt(q) for g, q in zip(self.groups, squares)}
        self.out["grad_norm"] = self._timed(norms)

    def before_update(self) -> None:
        self._before = self._timed(lambda: self.model.layout.params.copy())

    def updates(self) -> None:
        def ratios():
            layout = self.model.layout
            old, new = layout.views(self._before), layout.views(layout.params)
            out = {}
            for g, names in self.groups.items():
                size = _norm(old[n] for n in names)
                out[g] = _norm(new[n] - old[n] for n in names) / size if size > 0 else 0.0
            return out
        self.out["update_ratio"] = self._timed(ratios)
        self._before = None

    def stream(self, batch: Batch) -> None:
        """RMS of each sublayer's input and of the final state, on two rows of a batch (cheap,
        and enough for an RMS); models without one residual stream to read (the encoder-decoder)
        record none."""
        if batch.source is not None:
            return
        def rms():
            inputs: list = []
            self.model.forward(batch.idx[:2], inputs=inputs)
            return [math.sqrt(float(np.vdot(h, h)) / h.size) for h in inputs]
        self.out["stream_rms"] = self._timed(rms)

    def record(self) -> dict:
        out = {**self.out, "stats_ms": 1e3 * self.seconds}
        self.out, self.seconds = {}, 0.0
        return out
