"""`tbp train` under mpiexec with one rank leaving or stalling before the ranks join, as a
careless script or a slow file system would make it.

    mpiexec -n 2 python tests/programs/rank_leaves.py exit|stall  train ARGS...

``exit``: rank 1 exits with status 0 as soon as rank 0 has sent the set-up, before joining;
``stall``: rank 0 sleeps a minute before setting the run up, so rank 1 waits in the broadcast;
``stall-follower``: rank 1 sleeps a minute before building its replica, so rank 0 waits for it
in the join.
Each rank writes its pid to ``rankN.pid`` first.
"""
import os
import sys
import time
from pathlib import Path

from tbp.train import ranks, launch
from tbp.cli.main import main

how = sys.argv[1]
follow, start = ranks.follow, launch.start


def leaving(setup, callbacks, world):
    if how == "exit":
        sys.exit(0)
    if how == "stall-follower":
        time.sleep(60)
    return follow(setup, callbacks, world)


def stalling(*args, **kwargs):
    if how == "stall":
        time.sleep(60)
    return start(*args, **kwargs)


rank = next(os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK") if v in os.environ)
Path(f"rank{rank}.pid").write_text(str(os.getpid()))
ranks.follow, launch.start = leaving, stalling
sys.argv = ["tbp", *sys.argv[2:]]
main()
