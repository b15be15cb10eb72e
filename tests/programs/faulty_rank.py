"""`tbp train` under mpiexec with one rank made to fail at a step, as a bug or a crash would.

    mpiexec -n 2 python tests/programs/faulty_rank.py RANK STEP raise|kill  train ARGS...

``raise``: the rank raises an unexpected exception at that step; ``kill``: the process dies
on the spot (SIGKILL), as when the kernel's out-of-memory killer takes it.
"""
import os
import signal
import sys

from tbp.train import loop
from tbp.cli.main import main

rank, step, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
unguarded = loop.Trainer._step_unguarded


def failing_step(self, lr, *rest):
    if self.world.rank == rank and self.state.step + 1 == step:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"deliberate failure on rank {rank}")
    return unguarded(self, lr, *rest)


loop.Trainer._step_unguarded = failing_step
sys.argv = ["tbp", *sys.argv[4:]]
main()
