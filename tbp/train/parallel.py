"""Data parallelism over the machine's cores for a training step.

A NumPy training step is half matrix products, which BLAS spreads over the cores, and half
element-wise work (GELU, softmax, layer norm) and small per-head products, which run on one
core. Splitting the *batch* instead puts every part of the step on every core: each thread
runs forward and backward on its share of the rows with single-threaded BLAS, and the
gradients are summed. On two cores this measured 20-25 % faster per step than one thread
with two-threaded BLAS, for the 4 x 128 and the 6 x 384 models alike.

Replicas share the model's parameter arrays (the same memory: nothing to synchronise, since
a step only reads them) and keep their own activations and gradients. Each replica's loss
gradient is scaled by its share of the rows, so the sum is exactly the gradient of the mean
loss over the whole batch; the order of every sum is fixed, so a run is repeatable bit for
bit at a given thread count.

One level up, :class:`Ranks` splits a batch's rows over the ranks of an MPI job (distributed.py)
before each rank splits its rows over its threads.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..machine import libraries as blaslib
from ..machine.cores import available_cores, blas_threads, openblas
from ..nn.gpt import LanguageModel
from ..nn import registry
from ..nn.batch import Batch


def _engage_gemm(worker) -> contextlib.AbstractContextManager:
    """Choose the library for the engine's products (machine/libraries.py) at this worker's BLAS setting,
    for the rows each thread multiplies, and install it: one measurement per shape, process-wide."""
    cfg = worker.model.config
    get = openblas()
    shapes, threads = blaslib.products(cfg.d_model, worker.rows), int(get[0]()) if get else None
    worker.gemm = blaslib.choose(shapes, threads, worker.precision)
    # evaluations measure the float32 weights as tbp eval and generation use them: fp32 products
    worker.eval_gemm = worker.gemm if worker.precision == "fp32" else blaslib.choose(shapes, threads, "fp32")
    return blaslib.engaged(worker.gemm)


def _evaluating(worker) -> contextlib.AbstractContextManager:
    """The products of an evaluation: the run's own in fp32 (nothing changes), fp32's in a bf16 run."""
    if worker.precision == "fp32" or worker.eval_gemm is None:
        return contextlib.nullcontext()
    return blaslib.engaged(worker.eval_gemm)


class Serial:
    """One thread: the interface of :class:`DataParallel` with nothing to share out, so the
    training loop and the benchmark never ask which of the two they hold.

    With a kernel of small tile products (flash attention), BLAS runs one thread inside, as
    the kernel's registration asks (registry.KERNEL_ONE_THREAD): a second thread slows them.

    ``blas``: hold BLAS to that many threads (the threads a run asked for, an MPI rank's share);
    None leaves it as it is. ``rows``: tokens per batch (the products' size, for choosing
    their library on entering); by default one context's worth. ``precision``: the products'
    ("fp32" or "bf16", blas.choose)."""

    workers = 1

    def __init__(self, model: LanguageModel, blas: int | None = None, rows: int | None = None,
                 precision: str = "fp32"):
        self.model, self.blas, self.precision = model, blas, precision
        self.rows = rows or model.config.n_ctx
        self.gemm = self.eval_gemm = None        # blas.Choice, made on entering

    def __enter__(self) -> "Serial":
        n = 1 if self.model.config.attn_kernel in registry.KERNEL_ONE_THREAD else self.blas
        with contextlib.ExitStack() as stack:          # undone at once if entering fails
            if n is not None:
                stack.enter_context(blas_threads(n))
            stack.enter_context(_engage_gemm(self))
            self._context = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)

    def accumulate(self, batch: Batch, scale: float = 1.0, sync=None) -> float:
        """``sync`` (gradsync.GradientSync): told of each block whose gradient is final."""
        self.model.block_done = None if sync is None else sync.block_done
        try:
            return self.model.batch_accumulate(batch, scale)
        finally:
            self.model.block_done = None

    def each(self, fn) -> None:
        fn(0)

    def losses(self, batches: list) -> list[float]:
        with _evaluating(self):
            return [self.model.batch_loss(batch) for batch in batches]


class DataParallel:
    """Loss and gradients of one batch, its rows split over ``workers`` threads.

    A batch is a dict of the model's loss arguments, every array (B, ...) with one row per
    example (a GPT's ``idx``, ``targets`` and maybe ``weights``; an encoder-decoder's ``src``,
    ``tgt_in``, ``tgt_out``, ``weights``). ``accumulate(batch, scale)`` *adds* ``scale`` times
    the gradient of the mean loss over all rows into ``model.grads`` (like ``GPT.accumulate``,
    so gradient accumulation works unchanged) and returns the mean loss. A worker's share of
    the gradient is its share of the rows, or with ``weights`` its share of the total weight,
    so the sum is exactly the gradient of the batch's (weighted) mean. ``losses(batches)``
    evaluates a list of batches, spread over the threads; ``each(fn)`` runs fn(k) on every
    worker k (AdamW uses it to share its update).
    Use it as a context manager: inside, BLAS runs one thread (each worker is a core's worth
    of work already) and the engine's products use the library measured fastest for a
    worker's ``rows`` tokens (machine/libraries.py); on leaving, both are restored and the worker threads stop.
    """

    def __init__(self, model: LanguageModel, workers: int, rows: int | None = None, precision: str = "fp32"):
        if workers < 2:
            raise ValueError(f"data parallelism needs 2 or more workers, got {workers}")
        self.model, self.workers, self.precision = model, workers, precision
        self.rows = rows or model.config.n_ctx
        self.replicas = [model] + [model.replica() for _ in range(workers - 1)]
        self.pool = None
        self.gemm = self.eval_gemm = None        # blas.Choice, made on entering

    def close(self) -> None:
        """Stop the worker threads (started again by the next call)."""
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def __enter__(self) -> "DataParallel":
        with contextlib.ExitStack() as stack:          # undone at once if entering fails
            stack.callback(self.close)
            stack.enter_context(blas_threads(1))
            stack.enter_context(_engage_gemm(self))
            self._context = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)

    def _submit(self, fn, *args):
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.workers - 1, thread_name_prefix="tbp-worker")
        # NumPy's floating-point error settings are per thread: workers use the caller's
        err = np.geterr()

        def run():
            with np.errstate(**err):
                return fn(*args)
        return self.pool.submit(run)

    def accumulate(self, batch: Batch, scale: float = 1.0, sync=None) -> float:
        """``sync`` (gradsync.GradientSync): told of each block whose gradient is final, once
        every worker has passed it and their shares of it are summed (:meth:`_arrived`)."""
        B = len(batch)
        n = min(self.workers, B)
        bounds = [B * i // n for i in range(n + 1)]          # rows of each worker, in order
        w = batch.weights
        if w is None:
            shares = [(b - a) / B for a, b in zip(bounds, bounds[1:])]
        else:                                                # a slice's share of the total weight
            total_w = float(np.sum(w, dtype=np.float64))
            shares = [float(np.sum(w[a:b], dtype=np.float64)) / total_w for a, b in zip(bounds, bounds[1:])]
        parts = [batch.rows(a, b) for a, b in zip(bounds, bounds[1:])]

        def work(replica, part, share):        # a replica starts from zero, in its own thread
            replica.zero_grad()
            return replica.batch_accumulate(part, scale * share)
        if sync is not None:
            arrived = [0] * sync.buckets.n_blocks
            lock = threading.Lock()
            for r in self.replicas[:n]:
                r.block_done = lambda i: self._arrived(i, n, arrived, lock, sync)
        try:
            futures = [self._submit(work, r, part, share)
                       for r, part, share in zip(self.replicas[1:n], parts[1:], shares[1:])]
            losses = [self.model.batch_accumulate(parts[0], scale * shares[0])]
            losses += [f.result() for f in futures]
        finally:
            for r in self.replicas:
                r.block_done = None
        if sync is None or not sync.buckets.n_blocks:
            self._sum_gradients(n)
        else:                                   # the blocks are summed already
            self._sum_gradients(n, sync.buckets.rest)
        return sum(loss * share for loss, share in zip(losses, shares))

    def _arrived(self, i: int, n: int, arrived: list, lock, sync) -> None:
        """A worker has passed block i; the last of the n sums their shares of it and tells sync."""
        with lock:
            arrived[i] += 1
            last = arrived[i] == n
        if last:
            total = self.model.layout.grads
            for a, b in sync.buckets.blocks[i]:
                for r in self.replicas[1:n]:            # in worker order, as _sum_gradients
                    total[a:b] += r.layout.grads[a:b]
            sync.block_done(i)

    def _sum_gradients(self, n: int, ranges=None) -> None:
        """model.grads += each of the first n replicas' gradients (over ``ranges`` of the buffer,
        [a, b) pairs, or all of it). Every thread sums one contiguous share; each element
        still adds the replicas in worker order, so the result is the same bit for bit as one
        thread's sum, whatever the split."""
        total = self.model.layout.grads
        others = [r.layout.grads for r in self.replicas[1:n]]
        if not others:
            return
        ranges = [(0, total.size)] if ranges is None else ranges
        size = sum(b - a for a, b in ranges)

        def add(k: int) -> None:            # worker k's share: elements [size k / w, size (k + 1) / w) of the ranges
            lo, hi, seen = size * k // self.workers, size * (k + 1) // self.workers, 0
            for a, b in ranges:
                s, e = max(a, a + lo - seen), min(b, a + hi - seen)
                for g in others:
                    total[s:e] += g[s:e]
                seen += b - a
        self.each(add)

    loss_and_backward = accumulate      # the name earlier releases documented

    def each(self, fn) -> None:
        """Run fn(k) for every worker k at once, fn(0) on the calling thread; wait for all."""
        futures = [self._submit(fn, k) for k in range(1, self.workers)]
        fn(0)
        for f in futures:
            f.result()

    def losses(self, batches: list) -> list[float]:
        """Mean loss of each batch, forward only; the batches are shared out in turn."""
        out: list = [None] * len(batches)

        def run(k: int) -> None:
            for i in range(k, len(batches), self.workers):
                out[i] = self.replicas[k].batch_loss(batches[i])
        with _evaluating(self):
            self.each(run)
        return out


def data_parallel(model: LanguageModel, threads: int, batch_size: int,
                  precision: str = "fp32") -> Serial | DataParallel:
    """What a run with ``threads`` (0: one per core) and this batch size computes its gradients
    with: a DataParallel over that many workers (at most one per row), or Serial for one, with
    BLAS held to the ``threads`` asked for -- so ``threads=1`` is one core, not one worker
    beside a BLAS on every core (0 leaves BLAS as it is); products in ``precision``."""
    workers = min(threads or available_cores(), batch_size)
    rows = -(-batch_size // workers) * model.config.n_ctx            # tokens each thread multiplies
    if workers > 1:
        return DataParallel(model, workers, rows, precision)
    return Serial(model, threads or None, rows, precision)


def share(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share [lo, hi) of n things split over ``size`` ranks, in rank
    order (a batch's rows; a sharded optimizer's slice of the parameters)."""
    return n * rank // size, n * (rank + 1) // size


class Ranks:
    """The interface of parallel.Serial / DataParallel (what the trainer calls), one level up:
    a batch's rows split over the ranks, each rank's rows over its own threads (``local``).

    ``accumulate`` adds this rank's part of the gradient -- scaled by its share of the whole
    batch -- and returns its part of the mean loss; :meth:`World.sum_` of the gradient buffer
    and of the loss, once per optimizer step (after every micro-batch), completes both.
    """

    def __init__(self, local, world):
        self.local, self.world = local, world
        self.workers = local.workers

    def __enter__(self) -> "Ranks":
        self.local.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.local.__exit__(*exc)

    @property
    def gemm(self):
        """The library this rank's products use (blas.Choice), once entered."""
        return self.local.gemm

    def rows(self, B: int) -> tuple[int, int]:
        """This rank's rows [lo, hi) of a batch of B (some ranks get none when B < ranks)."""
        return share(B, self.world.size, self.world.rank)

    def accumulate(self, batch: Batch, scale: float = 1.0, sync=None) -> float:
        B = len(batch)
        lo, hi = self.rows(B)
        w = batch.weights
        if w is None:
            share = (hi - lo) / B
        else:                                   # every rank has the whole batch: the same total
            share = float(np.sum(w[lo:hi], dtype=np.float64)) / float(np.sum(w, dtype=np.float64))
        if share == 0.0:                        # no rows, or no loss on them: nothing to add
            for i in range(sync.buckets.n_blocks if sync is not None else 0):
                sync.block_done(i)
            return 0.0
        return self.local.accumulate(batch.rows(lo, hi), scale * share, sync) * share

    def each(self, fn) -> None:
        self.local.each(fn)

    def losses(self, batches: list) -> list[float]:
        """Every batch's mean loss on every rank: batch i is evaluated on rank i mod size."""
        mine = list(range(self.world.rank, len(batches), self.world.size))
        out = np.zeros(len(batches))
        out[mine] = self.local.losses([batches[i] for i in mine]) if mine else []
        return list(self.world.sum_(out))
