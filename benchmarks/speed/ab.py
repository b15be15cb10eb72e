"""Two versions of tbp, interleaved: training and generation tokens/s of each, and their ratio.

Runs `tbp bench --json` from source tree A and source tree B alternately (A, B, A, B, ...),
--repeats times each, for the same cases as compare_torch.py, and prints the medians and the
ratio B / A. Use it to show that a change did not slow tbp down, for example against a
worktree of the previous commit:

    git worktree add /tmp/before HEAD~1
    python benchmarks/speed/ab.py /tmp/before . --repeats 5

Each engine runs in a process of its own, as a user runs it; ab_inprocess.py takes turns in one
process, which a drifting machine needs for differences of a few per cent. Both stay, as
compare_torch.py and paired_torch.py do. Each case is one record in results/ab.jsonl, naming
both trees' commits.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))      # compare_torch's cases
import records
from compare_torch import CASES, tbp_cmd


def run(src: Path, cmd: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src.resolve())}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=src).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("a", type=Path, help="source tree A (the baseline)")
    p.add_argument("b", type=Path, help="source tree B (the change)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", help="run only the cases whose name contains this text")
    args = p.parse_args()
    commits = {"a_commit": records.commit(args.a), "b_commit": records.commit(args.b)}
    for name, model, batch, kind, (iters, _) in CASES:
        if args.only and args.only not in name:
            continue
        key = "train_tokens_per_s" if kind == "train" else "generate_tokens_per_s"
        cmd = tbp_cmd(model, batch, kind, iters)
        a, b = [], []
        for _ in range(args.repeats):
            a.append(run(args.a, cmd)[key])
            b.append(run(args.b, cmd)[key])
        ma, mb = statistics.median(a), statistics.median(b)
        records.append("ab", {**commits, "case": name, "a": ma, "b": mb, "ratio": mb / ma, "a_runs": a, "b_runs": b})
        print(f"{name:28s} A {ma:10.0f} tok/s   B {mb:10.0f} tok/s   B/A {mb / ma:5.2f}", flush=True)


if __name__ == "__main__":
    main()
