"""tbp vs the PyTorch reference: training tokens/s for two shapes, generation tokens/s at batch 1.

Runs `tbp bench --json` and `torch_ref.py` alternately, --repeats times each, and prints the
medians and the ratio tbp / PyTorch. With --gemm numpy,auto, tbp runs once per setting of
TBP_GEMM in each round (NumPy's BLAS only, and MKL where it measures faster: tbp/machine/libraries.py), so
both are compared with the same PyTorch runs. Example:

    python benchmarks/peers/compare_torch.py --torch-python .torchenv/bin/python --repeats 5 --gemm numpy,auto

Each engine runs in a process of its own here, as a user runs it; on a machine whose speed
drifts, paired_torch.py (both engines in one process, taking turns) gives steadier ratios. Both
stay: this one is what a user sees, that one the engines' own difference. Each case is one
record in results/compare_torch.jsonl.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

SHARED = Path(__file__).resolve().parents[3] / "shared"          # beside the repository
REF = SHARED / "bench" / "torch_ref.py"
DATA = SHARED / "data" / "tinyshakespeare.txt"

CASES = [
    # name, model (layers, heads, width, context), batch, kind, timed steps (tbp, torch)
    ("train 4L-128 T64 B12", (4, 4, 128, 64), 12, "train", (40, 50)),
    ("train 6L-384 T256 B8", (6, 6, 384, 256), 8, "train", (8, 25)),
    ("generate 4L-128 T1024 B1", (4, 4, 128, 1024), 1, "generate", (1, 0)),
]


def run_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def tbp_cmd(model, batch, kind, iters):
    L, H, C, T = model
    cmd = [sys.executable, "-m", "tbp", "bench", "--json", "--n-layer", str(L), "--n-head", str(H),
           "--d-model", str(C), "--n-ctx", str(T), "--batch-size", str(batch), "--iters", str(iters),
           "--precision", "fp32"]
    return cmd + (["--gen-tokens", "0"] if kind == "train" else ["--gen-tokens", "1000", "--iters", "1"])


def torch_cmd(py, model, batch, kind, iters):
    L, H, C, T = model
    cmd = [py, str(REF), "--data", str(DATA), "--n-layer", str(L), "--n-head", str(H), "--d-model", str(C),
           "--block-size", str(T), "--batch-size", str(batch), "--eval-batches", "1"]
    # torch_ref.py drops its first 10 steps from the median when it runs more than 20
    return cmd + (["--iters", str(iters)] if kind == "train" else ["--iters", "0", "--gen-tokens", "1000"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--torch-python", required=True, help="an interpreter with torch installed")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", help="run only the cases whose name contains this text")
    p.add_argument("--gemm", default="", help="comma-separated TBP_GEMM settings to run tbp with "
                                              "(default: the environment's)")
    a = p.parse_args()
    modes = [m for m in a.gemm.split(",") if m] or [None]
    for name, model, batch, kind, (ours_iters, torch_iters) in CASES:
        if a.only and a.only not in name:
            continue
        key = "train_tokens_per_s" if kind == "train" else "generate_tokens_per_s"
        ours, theirs, chosen = {m: [] for m in modes}, [], {m: set() for m in modes}
        for _ in range(a.repeats):
            for m in modes:
                env = {**os.environ, "TBP_GEMM": m} if m else None
                res = run_json(tbp_cmd(model, batch, kind, ours_iters), env)
                ours[m].append(res[key])
                chosen[m].add(res.get("train_gemm"))
            theirs.append(run_json(torch_cmd(a.torch_python, model, batch, kind, torch_iters))[key])
        t = statistics.median(theirs)
        for m in modes:
            o = statistics.median(ours[m])
            label = f"{name} [TBP_GEMM={m}]" if m else name
            used = ",".join(sorted(c for c in chosen[m] if c)) or "-"
            records.append("compare_torch", {"commit": records.commit(), "case": label, "model": model,
                                             "batch": batch, "kind": kind, "tbp_gemm": m or os.environ.get("TBP_GEMM", "auto"),
                                             "tbp": o, "torch": t, "ratio": o / t, "gemm_used": used,
                                             "tbp_runs": ours[m], "torch_runs": theirs})
            print(f"{label:44s} tbp {o:10.0f} tok/s   torch {t:10.0f} tok/s   ratio {o / t:5.2f}x   "
                  f"products: {used}", flush=True)


if __name__ == "__main__":
    main()
