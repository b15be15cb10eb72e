"""The README's commands run as typed, in order, in a fresh folder holding only examples/.

Every line of every ```bash block is run by bash, with the installed `tbp` first on PATH,
except installs (pip), the test suite itself and other machines (mpiexec, srun: the MPI
tests cover one machine): docs/blocks.py's rules, which tests/test_docs.py applies to every
page of the documentation. Sizes are kept small by appending options a user would not type:
`tbp train` runs 2 steps at batch 2, `tbp generate` and `tbp chat` write 8 tokens. A command
that fails fails this test with its line number, its output and the commands before it.
"""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import blocks  # noqa: E402  (the docs' own reader of runnable blocks: the same rules everywhere)

SMALL = {"train": "--max-iters 2 --eval-interval 2 --eval-batches 1 --batch-size 2 -q",
         "generate": "--max-new-tokens 8", "chat": "--max-new-tokens 8"}


def readme_commands() -> list[tuple[int, str]]:
    """(line number, command) of every runnable line of the README's bash blocks, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [c for b in blocks.blocks(text) if b.kind == "bash" for c in blocks.commands(b)]


def small(command: str) -> str:
    """The command with the small sizes appended to each of its tbp commands (one per ``&&``
    part; in a pipeline, the last command is the tbp one)."""
    parts = []
    for part in command.split(" && "):
        found = re.findall(r"\btbp (\w+)", part)
        parts.append(f"{part} {SMALL[found[-1]]}" if found and found[-1] in SMALL else part)
    return " && ".join(parts)


def test_the_readme_names_commands_to_run():
    commands = [c for _, c in readme_commands()]
    assert len(commands) >= 6 and commands[0] == "tbp train && tbp generate"


def test_every_readme_command_runs_as_typed(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "80", "TBP_GEMM": "numpy"}
    done, lacking = [], []
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    for n, command in readme_commands():
        need = blocks.missing(blocks.line_needs(lines[n - 1]))
        if need:                               # a line marked tbp[extra] whose extra is not installed
            lacking.append(f"README.md line {n} needs {', '.join(need)}: {blocks.pip(need)}")
            continue
        t0 = time.perf_counter()
        r = subprocess.run(["bash", "-o", "pipefail", "-c", small(command)], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (f"README.md line {n}: {command}\nexit {r.returncode}\n{r.stdout[-2000:]}"
                                   f"\n{r.stderr[-3000:]}\nafter:\n" + "\n".join(done))
        done.append(f"{time.perf_counter() - t0:6.1f}s  {command}")
    print("\n".join(done))
    if lacking:                                # the others ran and passed; say what did not run
        pytest.skip("; ".join(lacking) + f" (the other {len(done)} commands ran)")
