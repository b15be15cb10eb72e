"""Every measuring script in benchmarks/ leaves a record: run at toy sizes into a fresh results
folder, each writes the lines its docstring names, with the CPU and the commit. (What the
figures are is for the scripts' own runs on a quiet machine; nothing here is timed.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import designs_named

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# the scripts that measure, and where their records go; the others are helpers (lib/: records,
# stats, runner, tables_*; report.py; mpi/netns.py) or need what a test machine lacks, each named here:
# ab.py (two source trees), compare_torch.py / ops.py / check_transformers.py / paired_torch.py
# (torch or transformers), gemm_step.py (MKL, and whole training steps), mpi_*.py (mpiexec;
# tests/test_mpi_hosts.py runs mpi_hosts), kill_loop.py (tests/test_reliability.py runs its loop),
# quality.py and torch_val.py (a 2,000-step training)
TOY = {
    "speed/kv_cache.py": (["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--n-ctx", "32",
                     "--tokens", "4", "8", "--rounds", "1"], "kv_cache", 2),
    "speed/sliding_generation.py": (["--tokens", "24", "--n-ctx", "16", "--block", "8"], "sliding_generation", 2),
    "speed/gpt2_124m.py": (["--n-layer", "1", "--d-model", "48", "--gen-tokens", "2", "--train-ctx", "8",
                      "--steps", "1"], "gpt2_124m", 1),
}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.design(*designs_named((BENCH / s).read_text())))
                                    for s in sorted(TOY)])
def test_a_measuring_script_writes_its_records(script, tmp_path):
    args, name, lines = TOY[script]
    env = {**os.environ, "TBP_RESULTS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert len(rows) == lines
    for r in rows:
        assert r["cpu"] and r["commit"] and r["python"]


def test_every_script_but_the_helpers_writes_records():
    """A new script that prints figures without a record fails here until it writes one."""
    for path in sorted(BENCH.glob("*/*.py")):
        if path.parent.name == "lib" or path.name == "netns.py":        # the helpers, and mpi's namespaces
            continue
        assert "records." in path.read_text(encoding="utf-8"), f"{path.name} writes no record"
