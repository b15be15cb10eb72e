"""`tbp train` under mpiexec with rank 1 unlike rank 0, as a second machine set up differently
would be.

    mpiexec -n 2 python tests/programs/rank_differs.py version|data  train ARGS...

``version``: rank 1 runs another tbp version; ``data``: rank 1 finds other data at rank 0's
dataset path (another machine's copy).
"""
import os
import sys

from tbp.train import launch
from tbp import version
from tbp.cli.main import main

how = sys.argv[1]
if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
    if how == "version":
        version.__version__ = "0.0.1+elsewhere"
    else:
        load = launch.Dataset.load

        def other_copy(path):
            ds = load(path)
            ds.meta["source_sha256"] = "0" * 64
            return ds
        launch.Dataset.load = other_copy
sys.argv = ["tbp", *sys.argv[2:]]
main()
