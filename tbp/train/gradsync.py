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

Either way every element of the gradient is the sum of the ranks' parts, as with the plain
allreduce: the same bits at 2 ranks (a + b either way round); at more, MPI may order a sum's
terms differently for messages of different sizes, so the same to rounding.
"""
from __future__ import annotations

import math
import threading
import time

import numpy as np

from ..errors import TbpError
from .optim import clip_grads
from .parallel import share

# While the backward runs, the communication thread polls its collectives in bursts of BURST
# tests every POLL_S: an MPI library moves a non-blocking message on only when called (over TCP,
# a segment or so a call). Measured over a 1 Gbit/s link (benchmarks/mpi/mpi_hosts.py), one test
# per pause starved a 40 MB sum (210 ms for what busy polling sends in 45), bursts of 100 slowed
# the backward by a third (the poller took its core), and bursts of 10 hid three quarters of
# the sum at no cost to the backward. Once the backward is over it polls without pause.
POLL_S = 2e-4
BURST = 10
CHUNK = 1 << 20        # elements per collective, as distributed.CHUNK
SHORT = 1 << 14        # ranges shorter than this are packed together into one collective


def shard_counts(n: int, size: int) -> list[int]:
    """How many of the ``n`` packed entries each of ``size`` ranks owns (parallel.share)."""
    return [hi - lo for lo, hi in (share(n, size, r) for r in range(size))]


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
        self.n_blocks, late = n_blocks, set(late)
        own = [[n for n in layout.entries if n.startswith(f"h.{i}.") and n not in late] for i in range(n_blocks)]
        self.blocks = [_ranges(layout, names) for names in own]
        taken = {n for names in own for n in names}
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


class Message:
    """One collective over some ranges of the gradient: a view of the buffer where it is one
    range, else the (short) ranges packed in buffer order into a small array of its own.
    Sharded, rank r receives the part of the message inside its slice -- one contiguous stretch
    of it, since the packing and the slices both follow the buffer's order."""

    def __init__(self, ranges, sync: "GradientSync"):
        grads = sync.layout.grads
        self.ranges, self.shard = ranges, sync.shard
        self.packed = len(ranges) > 1
        a, b = ranges[0]
        self.buf = np.empty(sum(b - a for a, b in ranges), grads.dtype) if self.packed else grads[a:b]
        if self.shard:
            self.counts = [sum(max(0, min(b, s + c) - max(a, s)) for a, b in ranges)
                           for s, c in zip(sync.starts, sync.counts)]
            self.recv = np.empty(self.counts[sync.world.rank], grads.dtype)

    def post(self, world, grads):
        """Start it; the request to wait for."""
        if self.packed:
            k = 0
            for a, b in self.ranges:
                self.buf[k:k + b - a] = grads[a:b]
                k += b - a
        if self.shard:
            return world.ireduce_scatter(self.buf, self.recv, self.counts)
        return world.isum(self.buf)

    def land(self, grads, owned) -> None:
        """Once it is done: the sums into the gradient buffer (sharded: into the owned slice)."""
        if self.shard:
            lo, hi, k = *owned, 0
            for a, b in self.ranges:
                s, e = max(a, lo), min(b, hi)
                if e > s:
                    grads[s:e] = self.recv[k:k + e - s]
                    k += e - s
        elif self.packed:
            k = 0
            for a, b in self.ranges:
                grads[a:b] = self.buf[k:k + b - a]
                k += b - a


def messages(ranges, limit: int = CHUNK) -> list[list[tuple[int, int]]]:
    """A bucket's ranges as messages, in order: each long range on its own (cut at ``limit``
    elements), sent from the gradient buffer itself; the short ones -- a block's biases and
    norms -- packed together, since every collective costs rounds of messages and each round a
    poll, while a copy of a long range would cost a gradient's worth of memory."""
    out, cur, size = [], [], 0
    for a, b in ranges:
        if b - a >= SHORT:
            out += [[(s, min(s + limit, b))] for s in range(a, b, limit)]
            continue
        if cur and size + b - a > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append((a, b))
        size += b - a
    return out + ([cur] if cur else [])


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
        self.owned = share(layout.size, world.size, world.rank) if self.shard else (0, layout.size)
        self.buckets = Buckets.of(model, self.overlap)
        if self.overlap:
            _check_threads(world)
        # every bucket's messages, in posting order (with neither option: one allreduce, World.sum_)
        self.plan = [[Message(m, self) for m in messages(bucket)] for bucket in self.buckets.order()] \
            if self.shard or self.overlap else []
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
        elif self.plan:                                        # sharded, all at the end
            todo = [m for bucket in self.plan for m in bucket]
            for m, r in [(m, m.post(self.world, grads)) for m in todo]:
                self.world.wait(r)
                m.land(grads, self.owned)
        elif self.world.size > 1:
            self.world.sum_(grads)

    # --- clipping and the update -----------------------------------------------------------------
    def clip(self, max_norm: float) -> float:
        """Scale the owned gradient so the global norm is at most ``max_norm`` (0: never); returns
        the norm before clipping: optim.clip_grads on the owned slice, the norm (when sharded)
        summed from every rank's slice."""
        lo, hi = self.owned
        g = self.layout.grads[lo:hi]
        norm = math.sqrt(self.world.sum_values(float(np.vdot(g, g)))[0]) if self.shard else None
        return clip_grads(g, max_norm, norm)

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
        part = opt.slice(*self.owned)                # rank 0's own slice is its moments already
        self.world.scatter_(opt.m if self.world.is_root else part.m, self.counts)
        self.world.scatter_(opt.v if self.world.is_root else part.v, self.counts)
        return part

    def whole(self, opt):
        """Every rank calls it: on rank 0 an optimizer holding the whole moments, gathered from
        every rank's slice (what a checkpoint saves); elsewhere None (each sends its slice)."""
        if not self.shard:
            return opt if self.world.is_root else None
        if not self.world.is_root:
            self.world.gather_(opt.m, self.counts)
            self.world.gather_(opt.v, self.counts)
            return None
        full = opt.whole()
        self.world.gather_(full.m, self.counts)
        self.world.gather_(full.v, self.counts)
        return full

    def abandon(self) -> None:
        """The step failed before its gradient was complete: stop the communication thread
        (the job is ending; what it had in flight is left to the abort)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()


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
        self.plan = sync.plan
        self.done = [False] * len(self.plan)       # bucket k's gradient is final
        self.error: BaseException | None = None
        self.changed = threading.Condition()
        self.finished = threading.Event()
        self.stopping = False

    def stop(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify()
        self.join(timeout=5)

    def ready(self, block: int | None) -> None:
        """Block ``block`` (None: the whole backward) is final."""
        with self.changed:
            if block is None:
                self.done = [True] * len(self.plan)
            else:
                self.done[self.sync.buckets.n_blocks - 1 - block] = True
            self.changed.notify()

    def run(self) -> None:
        try:
            grads, owned = self.sync.layout.grads, self.sync.owned
            pending: list = []                                # (message, request), in posting order
            posted, deadline = 0, None
            while (posted < len(self.plan) or pending) and not self.stopping:
                with self.changed:
                    if not pending:                           # nothing in flight: sleep until a bucket is ready
                        self.changed.wait_for(lambda: self.done[posted] or self.stopping)
                    go = posted < len(self.plan) and self.done[posted] and not self.stopping
                if go:
                    pending += [(m, m.post(self.world, grads)) for m in self.plan[posted]]
                    posted += 1
                    continue
                for _ in range(BURST):                        # each test moves every request on a little
                    while pending and self.world.test(pending[0][1]):
                        pending.pop(0)[0].land(grads, owned)
                        deadline = None                       # the others answer: a new wait begins
                    if not pending:
                        break
                if posted == len(self.plan) and pending:      # the backward is over: only the network is
                    deadline = deadline or time.monotonic() + self.world.timeout   # left, polled without pause
                    if time.monotonic() > deadline:
                        self.world.give_up()
                elif pending:
                    time.sleep(POLL_S)
        except BaseException as e:                            # handed to the step, in the main thread
            self.error = e
        finally:
            self.finished.set()

    def finish(self) -> None:
        """Wait for every bucket (in slices, so the main thread still takes its signals)."""
        while not self.finished.wait(0.05):
            pass
        if self.error is not None:
            raise self.error
