"""Data parallelism across processes and machines, over MPI (mpi4py).   [the `mpi` extra]

``mpiexec -n N tbp train ...`` starts N copies of tbp, the *ranks*; each holds a whole replica
of the model. Every rank draws the same global batch (the same seed, the same generator), takes
its contiguous share of the rows, and runs forward and backward on them with its own threads
(parallel.py), its loss gradient scaled by its share of the rows (or of the loss weight). One
``Allreduce`` then sums the packed gradient buffer over the ranks, in chunks, which gives every
rank exactly the gradient of the mean loss over the whole batch; clipping, AdamW and the
schedule then run identically everywhere, so the replicas never drift apart (checked at every
checkpoint). Evaluation batches are shared out over the ranks and their losses summed. The
sharded optimizer (ZeRO-1) and the sum overlapped with the backward are gradsync.py's, on the
collectives below.

Only rank 0 reads and writes the run directory (and prints): it sets the run up exactly as a
single process would, then broadcasts what the others need -- the configs, the training state,
the dataset's path -- and, once they have built their replicas, every parameter and optimizer
moment, so that all ranks start from rank 0's bits. Every rank must see the dataset at that
path (one machine, a shared file system, or the same copy on each).

Faults end the job, never hang it. An error one rank alone raises aborts every rank; a rank
that exits before the job's end for any other reason does too (MPI is finalised only by
:meth:`World.finish`, which every rank calls at the clean end, so the launcher sees any other
exit as abnormal); and every collective is waited for in Python, so a rank waiting for another
still handles SIGTERM and Ctrl-C, and gives up, ending the job with one line, when the others
have not answered for ``TBP_MPI_TIMEOUT`` seconds (default 600, as PyTorch's NCCL watchdog):
a host that vanished or a link that went down, which TCP alone would wait out for many minutes. A program of its own that calls :func:`world` ends with
``world().finish()``.

Without an MPI launcher nothing here imports mpi4py: :func:`world` is then a world of one whose
every collective is the identity, and ``tbp train`` runs exactly as it always has.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
import zlib

import numpy as np

from ..errors import TbpError

# what MPI launchers put in each rank's environment (MPICH/Hydra and Intel MPI: PMI_*; Open MPI:
# OMPI_COMM_WORLD_*; PMIx launchers such as srun --mpi=pmix: PMIX_RANK)
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_LAUNCH_VARS = _SIZE_VARS + ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")

CHUNK = 1 << 20        # elements per Allreduce: 4 MiB pieces measured 1.4-2x faster than one call
TIMEOUT_S = 600.0      # a collective's longest wait for the other ranks (TBP_MPI_TIMEOUT)
MIN_TIMEOUT_S = 1.0    # below this no rank could finish a step in time
STOP_GRACE_S = 20.0    # after a stop signal, the wait for the other ranks, at least (schedulers kill at ~30 s)


def comm_timeout() -> float:
    """Seconds a rank waits in one collective before ending the job (TBP_MPI_TIMEOUT)."""
    raw = os.environ.get("TBP_MPI_TIMEOUT")
    if raw is None:
        return TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not MIN_TIMEOUT_S <= value < float("inf"):
        raise TbpError(f"TBP_MPI_TIMEOUT={raw!r}: give the seconds a rank may wait for the others, at least "
                       f"{MIN_TIMEOUT_S:g} (a step's work happens between two collectives: a shorter wait ends "
                       f"healthy jobs and blames the network)")
    return value


class World:
    """A world of one process: what tbp runs in without MPI. Every collective is the identity."""

    rank, size, local_size = 0, 1, 1
    is_root = True

    def sum_(self, buf: np.ndarray) -> np.ndarray:
        """Sum ``buf`` over the ranks, in place; returns it."""
        return buf

    def sum_values(self, *values: float) -> tuple[float, ...]:
        return values

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return bool(flag)

    def bcast_(self, buf: np.ndarray) -> np.ndarray:
        """Rank 0's ``buf`` on every rank, in place."""
        return buf

    def bcast(self, obj=None):
        """Rank 0's (small, picklable) object on every rank."""
        return obj

    def check_same(self, buf: np.ndarray, what: str) -> None:
        """Raise TbpError unless ``buf`` holds the same bits on every rank."""

    # --- for a sharded optimizer and overlapped gradient sums (gradsync.py) ---------------------
    # ``counts[r]``: how many elements of the buffer rank r owns, in rank order, contiguously.
    def isum(self, buf: np.ndarray):
        """Start summing ``buf`` over the ranks in place; :meth:`wait` for the returned request."""
        return None

    def ireduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int]):
        """Start summing ``send`` over the ranks into ``recv``, which receives only this rank's
        part (``counts[rank]`` elements, after those of the ranks before it)."""
        np.copyto(recv, send)
        return None

    def wait(self, request) -> None:
        """Wait for a request of :meth:`isum` or :meth:`ireduce_scatter` (under the timeout)."""

    def allgather_(self, buf: np.ndarray, counts: list[int]) -> np.ndarray:
        """Every rank's part of ``buf`` (where ``counts`` puts it) on every rank, in place."""
        return buf

    def gather_(self, buf: np.ndarray, counts: list[int]) -> np.ndarray:
        """Every rank's part on rank 0: there ``buf`` is the whole buffer, its own part in place;
        elsewhere ``buf`` is the rank's part alone, sent."""
        return buf

    def scatter_(self, buf: np.ndarray, counts: list[int]) -> np.ndarray:
        """Rank 0's whole ``buf`` cut into the ranks' parts: elsewhere ``buf`` is the rank's part
        alone, received in place."""
        return buf

    def abort(self, code: int) -> None:
        """End every rank of the job at once (nothing to do alone: the process is exiting)."""

    def finish(self) -> None:
        """The job's clean end, on every rank (nothing to do alone)."""

    def leave(self) -> None:
        """This rank exits as every rank does (nothing to do alone)."""

    def stopping(self, signum: int) -> None:
        """A stop signal (SIGTERM, Ctrl-C) reached this rank: from now on a collective waits for
        the others at most STOP_GRACE_S (nothing to wait for alone)."""


class MPIWorld(World):
    """``MPI.COMM_WORLD`` of an mpiexec job (mpi4py's buffer methods: no pickling of arrays).

    Every collective is started non-blocking and waited for in Python (:meth:`_wait`), so that a
    signal -- SIGTERM from the launcher or a scheduler, Ctrl-C -- is handled while a rank waits
    for the others, as it is everywhere else: a rank blocked inside a C call would never see it.
    """

    is_root = False

    def __init__(self, comm):
        from mpi4py import MPI
        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.is_root = self.rank == 0
        # ranks on this machine, which share its cores
        self.local_size = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank).Get_size()
        self.ending = False             # every rank leaves alike (an error they all raised): see leave()
        self.timeout = comm_timeout()
        self.stop_signal: tuple[int, float] | None = None      # (signal, when), see stopping()
        self.step_done: float | None = None      # when the last any() completed (one a training step)
        self.longest_step = 0.0                  # the longest interval between two of them so far
        atexit.register(self._at_exit)

    def leave(self) -> None:
        """Say that this rank exits as every rank does (each on its own, rank 0 saying why)."""
        self.ending = True

    def _at_exit(self) -> None:
        """A rank that leaves before the job's end, for no reason every rank shares (an early
        exit; an error a front end did not see), ends every rank with one line saying so: the
        others would otherwise wait for it for ever."""
        if self.ending or self.MPI.Is_finalized():
            return
        print(f"rank {self.rank}: left the job before its end; stopping every rank", file=sys.stderr)
        self.abort(1)

    def _wait(self, request, patient: bool = False) -> None:
        """Poll ``request`` to completion. Python runs its signal handlers between the polls; past
        the timeout the other ranks are taken for gone, and the job ends -- except ``patient``ly
        in the set-up, where the others wait for rank 0 to prepare a dataset of any size."""
        deadline = time.monotonic() + (float("inf") if patient else self.timeout)
        while not request.Test():
            now = time.monotonic()
            if self.stop_signal is not None and now > self.stop_signal[1] + self.stop_grace():
                self.give_up_stopping()
            if now > deadline:
                self.give_up()

    def stop_grace(self) -> float:
        """After a stop signal, how long the others may take to answer: STOP_GRACE_S, or twice the
        longest interval between two steps' any() so far where that is longer -- a step with its
        evaluation and rank 0's save: the others may be that far from the next collective when
        the signal comes, and rank 0 may be writing a checkpoint."""
        return max(STOP_GRACE_S, 2 * self.longest_step)

    def stopping(self, signum: int) -> None:
        if self.stop_signal is None:
            self.stop_signal = (signum, time.monotonic())

    def give_up_stopping(self) -> None:
        """Asked to stop, and the other ranks have not answered within the grace: end the job now,
        with the signal's exit status, rather than wait out TBP_MPI_TIMEOUT (which a scheduler's
        kill would cut short anyway). The last committed checkpoint stays; this step is not saved."""
        signum = self.stop_signal[0]
        print(f"rank {self.rank}: asked to stop ({signal.Signals(signum).name}), and the other ranks have not "
              f"answered for {self.stop_grace():.0f} s; stopping every rank without a final save", file=sys.stderr)
        self.ending = True
        self.abort(128 + signum)

    def test(self, request) -> bool:
        """Whether a non-blocking collective has completed (moving it on)."""
        return request.Test()

    def give_up(self) -> None:
        """The other ranks have not answered within the timeout: end the job with one line."""
        print(f"rank {self.rank}: the other ranks have not answered for {self.timeout:g} s (a host, its "
              f"rank or the network between them is gone?); stopping every rank (TBP_MPI_TIMEOUT sets "
              f"the wait)", file=sys.stderr)
        self.ending = True
        self.abort(1)

    def sum_(self, buf: np.ndarray) -> np.ndarray:
        flat = buf.reshape(-1)
        for s in range(0, flat.size, CHUNK):
            self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, flat[s:s + CHUNK], op=self.MPI.SUM))
        return buf

    def sum_values(self, *values: float) -> tuple[float, ...]:
        buf = np.array(values, dtype=np.float64)
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM))
        return tuple(float(v) for v in buf)

    def any(self, flag: bool) -> bool:
        buf = np.array([1 if flag else 0], dtype=np.int32)
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.MAX))
        now = time.monotonic()                # the training loop asks once a step: its pace
        if self.step_done is not None:
            self.longest_step = max(self.longest_step, now - self.step_done)
        self.step_done = now
        return bool(buf[0])

    def bcast_(self, buf: np.ndarray) -> np.ndarray:
        flat = buf.reshape(-1)
        for s in range(0, flat.size, CHUNK):
            self._wait(self.comm.Ibcast(flat[s:s + CHUNK], root=0))
        return buf

    def bcast(self, obj=None):
        """Rank 0's ``obj`` (JSON: strings, numbers, lists, dicts) on every rank; its length
        first, then its UTF-8 bytes."""
        data = json.dumps(obj).encode() if self.is_root else b""
        n = np.array([len(data)], dtype=np.int64)
        self._wait(self.comm.Ibcast(n, root=0), patient=True)
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.is_root else np.empty(int(n[0]), np.uint8)
        self._wait(self.comm.Ibcast(buf, root=0))
        return json.loads(buf.tobytes().decode())

    def isum(self, buf: np.ndarray):
        return self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def ireduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int]):
        return self.comm.Ireduce_scatter(send, recv, list(counts), op=self.MPI.SUM)

    def wait(self, request) -> None:
        self._wait(request)

    def _parts(self, buf: np.ndarray, counts: list[int]) -> list:
        """``buf`` cut into the ranks' parts, as MPI's v-collectives take it."""
        from mpi4py.util.dtlib import from_numpy_dtype
        displs = [sum(counts[:r]) for r in range(len(counts))]
        return [buf, (list(counts), displs), from_numpy_dtype(buf.dtype)]

    def allgather_(self, buf: np.ndarray, counts: list[int]) -> np.ndarray:
        self._wait(self.comm.Iallgatherv(self.MPI.IN_PLACE, self._parts(buf, counts)))
        return buf

    def gather_(self, buf: np.ndarray, counts: list[int]) -> np.ndarray:
        if self.is_root:
            self._wait(self.comm.Igatherv(self.MPI.IN_PLACE, self._parts(buf, counts), root=0))
        else:
            self._wait(self.comm.Igatherv(buf, None, root=0))
        return buf

    def scatter_(self, buf: np.ndarray, counts: list[int]) -> np.ndarray:
        if self.is_root:
            self._wait(self.comm.Iscatterv(self._parts(buf, counts), self.MPI.IN_PLACE, root=0))
        else:
            self._wait(self.comm.Iscatterv(None, buf, root=0))
        return buf

    def check_same(self, buf: np.ndarray, what: str) -> None:
        crc = np.array([zlib.crc32(np.ascontiguousarray(buf).view(np.uint8))], dtype=np.int64)
        crcs = np.empty(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(crc, crcs))
        if len(set(crcs.tolist())) != 1:
            differ = [r for r, c in enumerate(crcs) if c != crcs[0]]
            raise _everywhere(TbpError(f"{what} differ between ranks (rank{'s' * (len(differ) > 1)} "
                           f"{', '.join(map(str, differ))} vs rank 0): the ranks are not running the same "
                           f"computation; stopping rather than saving a run that depends on the rank"))

    def finish(self) -> None:
        """The job's clean end: every rank finalises MPI. A rank that leaves without it (an early
        exit, a crash) is then an abnormal end to the launcher, which ends every other rank --
        instead of leaving them waiting for ever in a collective the leaver never joins."""
        if not self.MPI.Is_finalized():
            self.MPI.Finalize()

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        # the launcher forwards a rank's output through its own pipes, and an abort can end the
        # job before the last lines (the one saying why) are through: give them a moment
        time.sleep(0.2)
        self.comm.Abort(code)
        os._exit(code)                 # Abort may return before the launcher's signal arrives


def _everywhere(e: Exception) -> Exception:
    """Mark an error that every rank raises at the same point (each then exits on its own)."""
    e.everywhere = True
    return e


def current() -> World:
    """The world :func:`world` connected to, or a world of one if nothing has asked (no MPI
    is initialised here)."""
    return _WORLD or World()


def launched() -> bool:
    """Whether an MPI launcher started this process."""
    return any(v in os.environ for v in _LAUNCH_VARS)


_WORLD: World | None = None


def world() -> World:
    """The world this process runs in: an :class:`MPIWorld` when an MPI launcher started two or
    more ranks, else a world of one. MPI is initialised on the first call, only when launched."""
    global _WORLD
    if _WORLD is None:
        if not launched():
            _WORLD = World()
            return _WORLD
        # MPI_Init waits inside C for every rank to start: a Python handler would not run there, so
        # a rank whose peers never come (one exited before joining) could neither be stopped nor
        # time out. Until the world is made, SIGTERM does what it does by default -- end the
        # process at once, with nothing yet to save -- and so does SIGALRM, set to ring after
        # TBP_MPI_TIMEOUT: the launcher then reports the rank ended by "Alarm clock".
        timeout = comm_timeout()
        alarm = hasattr(signal, "SIGALRM")           # not on Windows: SIGTERM's default there alone
        previous = {sig: signal.signal(sig, signal.SIG_DFL)
                    for sig in (signal.SIGTERM, *((signal.SIGALRM,) if alarm else ()))}
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            _WORLD = _connect()
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return _WORLD


def _connect() -> World:
    expected = next((int(os.environ[v]) for v in _SIZE_VARS if os.environ.get(v, "").isdigit()), None)
    try:
        import mpi4py
        mpi4py.rc.finalize = False     # finalised only by a clean end (MPIWorld.finish), never at exit
        from mpi4py import MPI
    except ImportError:
        if expected == 1:
            return World()
        raise TbpError("started by an MPI launcher, but mpi4py is not installed: "
                       "pip install 'tbp[mpi]' (or run without mpiexec)") from None
    except RuntimeError as e:          # mpi4py without an MPI library it can load
        raise TbpError(f"started by an MPI launcher, but mpi4py cannot load an MPI library ({e}); "
                       f"pip install 'tbp[mpi]' brings one") from None
    comm = MPI.COMM_WORLD
    if expected is not None and comm.Get_size() != expected:
        # the classic mismatch: one MPI's mpiexec, another MPI's library -> N worlds of one
        raise TbpError(f"the launcher started {expected} processes but MPI sees a world of {comm.Get_size()}: "
                       f"this mpiexec belongs to another MPI than the one mpi4py loaded "
                       f"({MPI.Get_library_version().splitlines()[0].strip()}); use the mpiexec installed "
                       f"beside {sys.executable}")
    return MPIWorld(comm) if comm.Get_size() > 1 else World()
