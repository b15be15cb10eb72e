"""Full fine-tuning of a GPT-2 124M-shaped model: peak memory and step time with and without
activation recomputation (--recompute), each configuration in a fresh process.

    python benchmarks/speed/recompute_memory.py --record            # T 64 and T 1024, B 4

Each child builds the model (12 x 768, 12 heads, vocabulary 50,257, context 1,024; random
weights: the figures are the shapes'), an AdamW over every weight, and runs three full training
steps (forward, backward, update) on random tokens at one thread; it reports its peak resident
memory (ru_maxrss), the median step time and tbp's own estimate (memory.train_parts).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

CHILD = "--child"


def child(T: int, B: int, recompute: bool, steps: int) -> None:
    import numpy as np

    from tbp.machine import memory
    from tbp.train.config import TrainConfig
    from tbp.nn.gpt import GPT
    from tbp.nn.config import ModelConfig
    from tbp.train.optim import AdamW
    cfg = ModelConfig(vocab_size=50257, n_ctx=1024, n_layer=12, n_head=12, d_model=768, recompute=recompute)
    model = GPT(cfg, seed=0)
    opt = AdamW(model.layout)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        idx, tgt = rng.integers(0, 50257, (B, T)), rng.integers(0, 50257, (B, T))
        t0 = time.perf_counter()
        loss = model.loss_and_backward(idx, tgt)
        opt.step(1e-4)
        times.append(time.perf_counter() - t0)
    estimate = memory.train_parts(cfg.replace(n_ctx=T), TrainConfig(batch_size=B, threads=1))
    print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "step_s": times, "loss": float(loss), "estimate": estimate}))


def main() -> None:
    if CHILD in sys.argv:
        T, B, recompute, steps = sys.argv[2:6]
        child(int(T), int(B), recompute == "1", int(steps))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TBP_GEMM": "numpy"}
    for T in args.contexts:
        for recompute in (False, True):
            out = subprocess.run([sys.executable, __file__, CHILD, str(T), str(args.batch), str(int(recompute)),
                                  str(args.steps)], capture_output=True, text=True, env=env)
            if out.returncode:
                raise SystemExit(out.stderr[-2000:])
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rec = {"model": "gpt2-124m shape", "batch": args.batch, "context": T, "recompute": recompute,
                   "threads": 1, "steps": args.steps, "peak_rss_bytes": r["peak_rss_bytes"],
                   "step_s_median": statistics.median(r["step_s"][1:] or r["step_s"]), "step_s": r["step_s"],
                   "estimate_bytes": r["estimate"], "loss": r["loss"], "commit": records.commit()}
            print(T, recompute, f"peak {r['peak_rss_bytes'] / 2**30:.2f} GiB, step {rec['step_s_median']:.1f} s, "
                                f"estimate {sum(r['estimate'].values()) / 2**30:.2f} GiB")
            if args.record:
                records.append("recompute_memory", rec)


if __name__ == "__main__":
    main()
