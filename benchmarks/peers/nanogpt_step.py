"""The engine ratio of the speedrun: nanoGPT's own train.py, its Shakespeare recipe, on these cores.

nanoGPT (github.com/karpathy/nanoGPT) is not vendored: give the folder of a checkout (``git clone``
it, or any copy of its public source). It is copied into a scratch folder with
data/tinyshakespeare.txt as its input.txt (so its prepare.py reads it instead of downloading), and
its train.py runs ``config/train_shakespeare_char.py`` on the CPU in float32, eagerly and under
``torch.compile`` (its two arms), for ``--steps`` steps each; the step time is the median of the
times train.py prints for its steps after the first ``--skip``. tbp's step for the same recipe is
timed in the same rounds (``tbp train --config recipes/nanogpt-shakespeare-char.json``, its
metrics' clock), the engines alternating, so a drifting machine moves both. One record per
engine and round in benchmarks/results/nanogpt_step.jsonl.

Run it with tbp's Python; ``--torch-python`` is a venv's that has torch (never a tbp dependency)
and numpy:

    python benchmarks/peers/nanogpt_step.py --nanogpt ~/nanoGPT --torch-python ~/torchenv/bin/python
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "nanogpt-shakespeare-char.json"
STEP = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms")


def nanogpt_commit(src: Path) -> str:
    done = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def scratch_copy(src: Path, work: Path, python: str) -> Path:
    """nanoGPT's train.py, model.py, configurator.py and the Shakespeare folder, with our text as input.txt."""
    dst = work / "nanoGPT"
    if not (dst / "data" / "shakespeare_char" / "train.bin").is_file():
        shutil.rmtree(dst, ignore_errors=True)
        (dst / "data").mkdir(parents=True)
        for name in ("train.py", "model.py", "configurator.py"):
            shutil.copy(src / name, dst / name)
        shutil.copytree(src / "config", dst / "config")
        shutil.copytree(src / "data" / "shakespeare_char", dst / "data" / "shakespeare_char")
        shutil.copy(ROOT / "data" / "tinyshakespeare.txt", dst / "data" / "shakespeare_char" / "input.txt")
        done = subprocess.run([python, "prepare.py"], cwd=dst / "data" / "shakespeare_char",
                              capture_output=True, text=True)
        if done.returncode:     # its prepare.py imports requests even when input.txt is there
            sys.exit(f"nanoGPT's prepare.py failed (its Python needs numpy and requests):\n{done.stderr[-2000:]}")
    return dst


def nanogpt_steps(python: str, dst: Path, compiled: bool, steps: int, threads: int) -> list[float]:
    """Seconds of each step train.py reports, for ``steps`` steps (no evaluation beyond its first, of one batch)."""
    cmd = [python, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--dtype=float32",
           f"--compile={compiled}", f"--max_iters={steps}", "--eval_iters=1", "--eval_interval=100000",
           "--log_interval=1", "--always_save_checkpoint=False", f"--out_dir={dst / 'out'}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, cwd=dst, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"nanoGPT's train.py failed:\n{done.stderr[-3000:]}")
    found = [(int(m.group(1)), float(m.group(2)) / 1000) for m in map(STEP.match, done.stdout.splitlines()) if m]
    return [t for i, t in found if i >= 1]          # iter 0's time includes the first evaluation


def tbp_steps(work: Path, steps: int, threads: int) -> list[float]:
    """Seconds of each of tbp's steps on nanoGPT's recipe (its metrics' clock, one line a step)."""
    from tbp.runs.disk import read_metrics
    out = work / "tbp-run"
    cmd = [sys.executable, "-m", "tbp", "train", "--config", str(RECIPE), "--data", str(ROOT / "data" / "tinyshakespeare.txt"),
           "--out", str(out), "--force", "--max-iters", str(steps), "--eval-interval", "100000", "--eval-batches", "1",
           "--log-interval", "1", "--threads", str(threads), "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"tbp train failed:\n{done.stderr[-3000:]}")
    clock = [m["elapsed_s"] for m in read_metrics(out) if "elapsed_s" in m and "val_loss" not in m]
    return [b - a for a, b in zip(clock, clock[1:])]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a checkout of nanoGPT's public source")
    p.add_argument("--torch-python", required=True, help="a Python that has torch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="steps left out at the start of each arm (warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--arms", default="tbp,eager,compile")
    args = p.parse_args()
    records.pin_gemm()
    work = Path(tempfile.mkdtemp(prefix="nanogpt-step-"))
    dst = scratch_copy(args.nanogpt, work, args.torch_python)
    torch_version = subprocess.run([args.torch_python, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    commit, theirs = records.commit(), nanogpt_commit(args.nanogpt)
    for rnd in range(args.rounds):
        for arm in args.arms.split(","):
            if arm == "tbp":
                # step 1's clock starts with the run, and the last step's line carries the final
                # evaluation: two steps more give as many step times as train.py's arms
                times = tbp_steps(work, args.steps + 2, args.threads)
            else:
                # a compiled arm's first steps compile: skip them as warm-up, as for every arm
                times = nanogpt_steps(args.torch_python, dst, arm == "compile", args.steps + 1, args.threads)
            kept = times[args.skip:]
            rec = {"study": "nanogpt_step", "engine": "tbp" if arm == "tbp" else f"pytorch {arm}", "round": rnd,
                   "commit": commit, "nanogpt_commit": theirs, "torch": torch_version, "threads": args.threads,
                   "recipe": str(RECIPE.relative_to(ROOT)), "tokens_per_step": 64 * 256, "step_times_s": kept,
                   "median_step_s": statistics.median(kept)}
            records.append("nanogpt_step", rec)
            print(json.dumps({k: rec[k] for k in ("engine", "round", "median_step_s")}), flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
