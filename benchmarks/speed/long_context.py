"""Long context: peak memory and step time of one training step, dense vs flash attention.

A 4-layer, 4-head, 128-wide model with rotary positions, batch 1, trained on random tokens at
T = 512 ... 8192. Each (T, attention) pair runs in its own process: a warm-up step, then
--steps timed steps (forward + handwritten backward + clipping + AdamW); the step time is
their median, and the peak memory is the process's peak resident set size (ru_maxrss, which
includes the interpreter and NumPy, about 40 MiB). ``--rounds`` rounds each run every (T,
kernel) once, the kernels' order alternating from round to round; a record per (T, kernel) in
results/flash_long_context.jsonl holds every round's step time (the table gives their median
and range) and peak memory. Run it on a quiet machine.

    python benchmarks/speed/long_context.py                        # the table in docs/designs/flash-attention.md
    python benchmarks/speed/long_context.py --lengths 1024 2048 --steps 7 --only flash   # print, record nothing
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402

NAME = "flash_long_context"

CHILD = r"""
import json, resource, sys, time
import numpy as np
from tbp.nn import GPT, ModelConfig
from tbp.train.optim import AdamW, clip_grads
from tbp.machine.cores import blas_threads
T, impl, steps, threads, tile = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                 int(sys.argv[5]))
cfg = ModelConfig(vocab_size=65, n_ctx=T, n_layer=4, n_head=4, d_model=128, positions="rope", attn_impl=impl)
model = GPT(cfg, seed=0)
if tile:
    for block in model.blocks:
        block.attn.kernel.tiles = (tile, tile)
opt = AdamW(model.layout)
rng = np.random.default_rng(0)
times = []
with blas_threads(threads) if threads else open("/dev/null"):
    for i in range(steps + 1):
        x, y = rng.integers(0, 65, (1, T)), rng.integers(0, 65, (1, T))
        t = time.perf_counter()
        model.loss_and_backward(x, y)
        clip_grads(model.layout.grads, 1.0)
        opt.step(1e-4)
        if i:
            times.append(time.perf_counter() - t)
print(json.dumps({"T": T, "impl": impl, "step_s": float(np.median(times)),
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def one(T: int, impl: str, a) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(T), impl, str(a.steps), str(a.blas_threads),
                          str(a.tile)], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=5, help="timed steps per process (the median is kept)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; each runs every (T, kernel) once, interleaved")
    p.add_argument("--blas-threads", type=int, default=0, help="0: NumPy's default; 1: one thread")
    p.add_argument("--tile", type=int, default=0, help="flash tile rows (queries and keys); 0: flash.py's")
    p.add_argument("--only", choices=["dense", "flash"], help="run one implementation, print, record nothing")
    a = p.parse_args()
    if a.only:
        print(json.dumps([one(T, a.only, a) for T in a.lengths]))
        return
    runs = {(T, impl): [] for T in a.lengths for impl in ("dense", "flash")}
    for r in range(a.rounds):
        for T in a.lengths:
            for impl in (("dense", "flash") if r % 2 == 0 else ("flash", "dense")):   # the order alternates
                got = one(T, impl, a)
                runs[T, impl].append(got)
                print(f"round {r + 1}  T {T:5d}  {impl:5s}  step {got['step_s']:7.3f} s   peak {got['peak_mib']:7.0f} MiB",
                      flush=True)
    commit = records.commit()
    for (T, impl), got in runs.items():
        records.append(NAME, {"T": T, "impl": impl, "rounds": a.rounds, "steps": a.steps,
                              "blas_threads": a.blas_threads, "tile": a.tile,
                              "step_s": statistics.median(g["step_s"] for g in got),
                              "step_s_rounds": [g["step_s"] for g in got],
                              "peak_mib": max(g["peak_mib"] for g in got),
                              "peak_mib_rounds": [g["peak_mib"] for g in got], "commit": commit})


if __name__ == "__main__":
    main()
