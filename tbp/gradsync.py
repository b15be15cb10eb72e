"""How the ranks of an MPI job combine their gradients, and which rank updates what.

Plain data parallelism (distributed.py) sums the whole gradient on every rank, once the whole
backward is done, and every rank then runs the whole AdamW: N ranks make the same update N times
and hold N copies of its moments. Two refinements, each a training option:

``shard_optimizer`` -- ZeRO stage 1 (Rajbhandari et al., *ZeRO: memory optimizations toward
training trillion parameter models*, 2020). The packed layout (nn/layout.py) is cut into one
contiguous slice per rank. A reduce-scatter leaves each rank the sum of its own slice of the
gradient; the rank clips and updates that slice alone, holding the AdamW moments of that slice
alone; an allgather then gives every rank the whole updated parameter vector. An allreduce *is*
a reduce-scatter and an allgather, so the traffic is the same, while the update's time and the
moments' memory fall by the number of ranks. Checkpoints hold the whole moments, gathered on
rank 0, so a run resumes under any number of ranks.

``overlap`` -- gradient buckets, as PyTorch's DistributedDataParallel. The backward runs the
blocks last to first, and once it has passed block i nothing below writes block i's gradients:
during the last micro-batch's backward, a communication thread sums each block's gradient (or
reduce-scatters it) while the backward goes on with the blocks below; the embeddings, the final
norm and the head follow at the end. Buckets are posted in one fixed order on every rank (MPI's
collectives must match), whichever thread finishes a block first, and the thread polls them to
completion, since an MPI library moves a non-blocking message on only when it is called.

Either way the result is the plain sum's: every element is the same sum of the ranks' parts.
"""
from __future__ import annotations

import math
import threading
import time

import numpy as np

from .errors import TbpError

POLL_S = 2e-4          # the communication thread's pause between polls (its CPU cost: ~nothing)
CHUNK = 1 << 20        # elements per collective, as distributed.CHUNK


def shard_counts(n: int, size: int) -> list[int]:
    """How many of the ``n`` packed entries each of ``size`` ranks owns: contiguous, in rank order."""
    bounds = [n * r // size for r in range(size + 1)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _ranges(layout, names) -> list[tuple[int, int]]:
    """The entries ``names`` of ``layout`` as few contiguous [a, b) ranges, in buffer order."""
    spans = sorted((layout.entries[n].offset, layout.entries[n].offset + layout.entries[n].size) for n in names)
    out: list[list[int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class Buckets:
    """The gradient's buckets in the order the backward completes them: ``blocks[i]``, block i's
    ranges of the packed layout, final once the backward has passed block i (posted from the
    last block down); then ``rest``, everything else -- the embeddings, the final norm, the
    head, and the block parameters in ``late`` -- final when the backward ends."""

    def __init__(self, layout, n_blocks: int, late=()):
        self.n_blocks = n_blocks
        names = [n for n in layout.entries if n not in set(late)]
        self.blocks = [_ranges(layout, [n for n in names if n.startswith(f"h.{i}.")]) for i in range(n_blocks)]
        taken = {n for i in range(n_blocks) for n in names if n.startswith(f"h.{i}.")}
        self.rest = _ranges(layout, [n for n in layout.entries if n not in taken])

    @classmethod
    def of(cls, model, overlap: bool = True) -> "Buckets":
        """A model's buckets: one per block where its backward reports them, else one in all."""
        if not (overlap and model.reports_blocks):
            return cls(model.layout, 0)
        return cls(model.layout, model.config.n_layer, model.late_gradients())

    def order(self) -> list[list[tuple[int, int]]]:
        """Every bucket's ranges in posting order: the last block first, the rest last."""
        return [self.blocks[i] for i in reversed(range(self.n_blocks))] + [self.rest]


class GradientSync:
    """Combines a rank's gradient with the other ranks' once a step, and updates the parameters.

    The training step calls, in order: :meth:`arm` before the last micro-batch (with overlap, it
    starts the communication thread; the model's blocks then report through :meth:`block_done`);
    :meth:`finish` after it (every bucket summed); :meth:`clip`; the optimizer's step; and
    :meth:`share_update` (an allgather of the slices, when sharded). ``owned`` is the slice
    [lo, hi) of the packed layout this rank updates: all of it unless sharded.
    """

    def __init__(self, world, model, shard: bool = False, overlap: bool = False):
        layout = model.layout
        self.world, self.layout = world, layout
        self.shard, self.overlap = shard and world.size > 1, overlap and world.size > 1
        self.counts = shard_counts(layout.size, world.size) if self.shard else [layout.size] * world.size
        self.starts = [sum(self.counts[:r]) for r in range(world.size)] if self.shard else [0] * world.size
        lo = self.starts[world.rank]
        self.owned = (lo, lo + self.counts[world.rank] if self.shard else layout.size)
        self.buckets = Buckets.of(model, self.overlap)
        if self.overlap:
            _check_threads(world)
        # a sharded rank receives its slice of the summed gradient here (MPI may not alias send and receive)
        self.received = np.empty(self.owned[1] - self.owned[0], layout.grads.dtype) if self.shard else None
        self._thread: _Poster | None = None

    # --- the gradient ---------------------------------------------------------------------------
    def arm(self) -> None:
        """Before the last micro-batch: with overlap, begin waiting for the blocks' gradients."""
        if self.overlap:
            self._thread = _Poster(self)
            self._thread.start()

    def block_done(self, i: int) -> None:
        """Block i's gradient (every worker's share summed) is final: it may be sent. Thread-safe."""
        if self._thread is not None:
            self._thread.ready(i)

    def finish(self) -> None:
        """The gradient summed over the ranks: the whole of it, or when sharded the owned slice
        (the rest of the buffer is then this rank's own part, and is not read)."""
        grads = self.layout.grads
        if self._thread is not None:
            thread, self._thread = self._thread, None
            thread.ready(None)                                 # the backward is over: the rest too
            thread.finish()
        elif self.shard:
            self.world.wait(self.world.ireduce_scatter(grads, self.received, self.counts))
        elif self.world.size > 1:
            self.world.sum_(grads)
        if self.shard:
            lo, hi = self.owned
            grads[lo:hi] = self.received

    def _post(self, ranges) -> list:
        """Start summing these ranges of the gradient; the requests to wait for."""
        grads, (lo, hi), out = self.layout.grads, self.owned, []
        for a0, b0 in ranges:
            for a in range(a0, b0, CHUNK):
                b = min(a + CHUNK, b0)
                if not self.shard:
                    out.append(self.world.isum(grads[a:b]))
                    continue
                # each rank receives the part of [a, b) inside its slice (for most ranks, none)
                counts = [max(0, min(b, s + c) - max(a, s)) for s, c in zip(self.starts, self.counts)]
                s, e = max(a, lo), max(min(b, hi), max(a, lo))
                out.append(self.world.ireduce_scatter(grads[a:b], self.received[s - lo:e - lo], counts))
        return out

    # --- clipping and the update -----------------------------------------------------------------
    def norm(self) -> float:
        """The global gradient norm: of the whole summed gradient, from each rank's owned slice."""
        lo, hi = self.owned
        g = self.layout.grads[lo:hi]
        if not self.shard:
            return math.sqrt(float(np.vdot(g, g)))
        (squares,) = self.world.sum_values(float(np.vdot(g, g)))
        return math.sqrt(squares)

    def clip(self, max_norm: float) -> float:
        """Scale the owned gradient so the global norm is at most ``max_norm`` (0: never); returns
        the norm before clipping. Unsharded this is optim.clip_grads exactly."""
        norm = self.norm()
        if max_norm > 0 and norm > max_norm:
            lo, hi = self.owned
            g = self.layout.grads[lo:hi]
            g *= g.dtype.type(max_norm / (norm + 1e-6))
        return norm

    def share_update(self) -> None:
        """After the optimizer's step: every rank's updated slice on every rank (sharded only)."""
        if self.shard:
            self.world.allgather_(self.layout.params, self.counts)

    # --- the optimizer's state ---------------------------------------------------------------------
    def take_slice(self, opt):
        """The optimizer this rank steps: ``opt`` itself, or when sharded its owned slice, the
        moments for it scattered from rank 0's (after a resume, rank 0 alone holds them)."""
        if not self.shard:
            return opt
        self.world.scatter_(opt.m, self.counts)
        self.world.scatter_(opt.v, self.counts)
        return opt.slice(*self.owned)

    def whole(self, opt):
        """Every rank calls it: on rank 0 an optimizer holding the whole moments, gathered from
        every rank's slice (what a checkpoint saves); elsewhere None."""
        if not self.shard:
            return opt if self.world.is_root else None
        full = opt.whole()
        self.world.gather_(full.m, self.counts)
        self.world.gather_(full.v, self.counts)
        return full if self.world.is_root else None


def _check_threads(world) -> None:
    """Overlap sends from a thread of its own while the step computes: MPI must allow it."""
    MPI = getattr(world, "MPI", None)
    if MPI is not None and MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise TbpError("--overlap needs an MPI library initialised with thread support "
                       "(MPI_THREAD_SERIALIZED or more); this one gives less: train without --overlap")


class _Poster(threading.Thread):
    """The communication thread of one step: posts the buckets in order as the backward
    completes them, polls what it posted, and is done when every bucket is summed. No other
    thread calls MPI while it runs (the step waits for it before its next collective)."""

    def __init__(self, sync: GradientSync):
        super().__init__(name="tbp-gradsync", daemon=True)
        self.sync = sync
        self.world = sync.world
        self.order = sync.buckets.order()
        self.done = [False] * len(self.order)      # bucket k's gradient is final
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def ready(self, block: int | None) -> None:
        """Block ``block`` (None: the whole backward) is final."""
        k = len(self.order) - 1 if block is None else self.sync.buckets.n_blocks - 1 - block
        with self.lock:
            if block is None:
                self.done = [True] * len(self.order)
            else:
                self.done[k] = True

    def run(self) -> None:
        try:
            pending: list = []
            posted = 0
            deadline = None
            while posted < len(self.order) or pending:
                with self.lock:
                    go = posted < len(self.order) and self.done[posted]
                if go:
                    pending += self.sync._post(self.order[posted])
                    posted += 1
                    continue
                pending = [r for r in pending if not self.world.test(r)]
                if posted == len(self.order):               # all posted: only the network remains
                    deadline = deadline or time.monotonic() + self.world.timeout
                    if time.monotonic() > deadline:
                        self.world.give_up()
                time.sleep(POLL_S)
        except BaseException as e:                          # handed to the step, in the main thread
            self.error = e
        finally:
            self.finished.set()

    def finish(self) -> None:
        """Wait for every bucket (in slices, so the main thread still takes its signals)."""
        while not self.finished.wait(0.05):
            pass
        if self.error is not None:
            raise self.error
