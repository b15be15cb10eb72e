"""Data parallelism over MPI on one machine, and what it projects to on several.

For each model (the 4 x 128 and 6 x 384 training shapes of compare_torch.py), in rounds that
alternate the two layouts of this 2-core machine:

- 1 process x 2 threads (plain `tbp train`: the batch's rows over two threads);
- 2 ranks x 1 thread (`mpiexec -n 2 tbp train --threads 1`: the rows over two processes);

it times training steps phase by phase -- forward + backward on the rank's rows, the Allreduce
of the packed gradient, clipping + AdamW -- and the Allreduce alone on buffers of several sizes
(bandwidth). From the measured compute time and a ring Allreduce's traffic, 2 (M - 1) / M times
the gradient per machine, it projects the speed-up on M = 2, 4, 8 machines over 1 and 10 Gbit/s
links: with the per-machine batch fixed (M times the tokens per step) and with the global batch
fixed (each machine 1/M of it). tbp does not overlap the Allreduce with the backward, so the
projection adds the two.

Every round's measurements of each model and layout are one record in results/mpi_scaling.jsonl
(the projection is computed from them again by whoever reads them).

    python benchmarks/mpi/mpi_scaling.py --rounds 5            # needs the mpi extra; a quiet machine
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

MODELS = {"4x128": dict(n_layer=4, n_head=4, d_model=128, n_ctx=64, batch=12),
          "6x384": dict(n_layer=6, n_head=6, d_model=384, n_ctx=256, batch=8)}


def rank_program(args) -> None:
    """One process of the measurement (under mpiexec, one rank): prints a JSON line (rank 0)."""
    from tbp.train import distributed
    from tbp.nn.gpt import GPT
    from tbp.nn.config import ModelConfig
    from tbp.nn.batch import Batch
    from tbp.train.optim import AdamW, clip_grads
    from tbp.train.parallel import data_parallel
    from tbp.train.loop import rank_workers
    world = distributed.world()
    spec = MODELS[args.model]
    B = spec["batch"]
    model = GPT(ModelConfig(vocab_size=65, n_ctx=spec["n_ctx"], n_layer=spec["n_layer"], n_head=spec["n_head"],
                            d_model=spec["d_model"]), seed=0)
    workers = rank_workers(model, world, args.threads, B) if world.size > 1 else \
        data_parallel(model, args.threads, B)
    opt = AdamW(model.layout)
    opt.workers = workers.local if world.size > 1 else workers
    rng = np.random.default_rng(0)
    times = {"compute": [], "allreduce": [], "update": [], "step": []}
    with workers:
        for i in range(args.steps + 2):
            batch = Batch(rng.integers(0, 65, (B, spec["n_ctx"])), rng.integers(0, 65, (B, spec["n_ctx"])))
            t0 = time.perf_counter()
            model.zero_grad()
            loss = workers.accumulate(batch)
            t1 = time.perf_counter()
            world.sum_(model.layout.grads)
            world.sum_values(loss)
            t2 = time.perf_counter()
            clip_grads(model.layout.grads, 1.0)
            opt.step(1e-4)
            t3 = time.perf_counter()
            if i >= 2:                                     # two warm-up steps
                for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    times[k].append(v)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["grad_bytes"] = model.layout.grads.nbytes
    out["tokens_per_step"] = B * spec["n_ctx"]
    if world.size > 1:
        # the Allreduce alone, every rank entering together: bandwidth at several sizes
        bw = {}
        for n in (model.layout.grads.size, 1 << 22, 1 << 24):
            buf = np.ones(n, np.float32)
            ts = []
            for _ in range(7):
                world.comm.Barrier()
                t = time.perf_counter()
                world.sum_(buf)
                ts.append(world.comm.allreduce(time.perf_counter() - t, op=world.MPI.MAX))
            bw[n * 4] = statistics.median(ts)
        out["allreduce_s_by_bytes"] = bw
        # the same 64 MiB in one call, against tbp's 4 MiB chunks above
        ts = []
        for _ in range(7):
            world.comm.Barrier()
            t = time.perf_counter()
            world.comm.Allreduce(world.MPI.IN_PLACE, buf, op=world.MPI.SUM)
            ts.append(world.comm.allreduce(time.perf_counter() - t, op=world.MPI.MAX))
        out["allreduce_one_call_s"] = {buf.nbytes: statistics.median(ts)}
        # the compute phase differs between ranks: the slower one sets the pace
        out["compute_max"] = world.comm.allreduce(out["compute"], op=world.MPI.MAX)
    if world.is_root:
        print(json.dumps(out), flush=True)
    world.finish()                                         # the job's clean end, on every rank


def run(args, model: str, layout: str) -> dict:
    me = [sys.executable, __file__, "--rank-program", "--model", model, "--steps", str(args.steps)]
    env = dict(os.environ)
    if layout == "1x2":
        cmd = me + ["--threads", "2"]
    else:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        cmd = [str(mpiexec), "-n", "2"] + me + ["--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def project(grad_bytes: int, link_gbit: float, machines: int, latency_s: float = 50e-6) -> float:
    """Ring Allreduce time of the gradient over ``machines`` on a link of ``link_gbit``."""
    traffic = 2 * (machines - 1) / machines * grad_bytes
    return traffic / (link_gbit * 1e9 / 8) + 2 * (machines - 1) * latency_s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=list(MODELS), default="4x128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    if args.rank_program:
        return rank_program(args)
    from tbp.machine.cores import machine
    print(json.dumps(machine()))
    for model in args.models:
        rows = {"1x2": [], "2x1": []}
        for i in range(args.rounds):
            for layout in rows:
                rows[layout].append(run(args, model, layout))
                records.append("mpi_scaling", {"commit": records.commit(), "model": model, "layout": layout,
                                               "round": i, "steps": args.steps, **rows[layout][-1]})
        one = {k: statistics.median(r[k] for r in rows["1x2"]) for k in ("step", "compute", "update")}
        two = {k: statistics.median(r[k] for r in rows["2x1"]) for k in ("step", "compute", "compute_max",
                                                                           "allreduce", "update")}
        tokens, grad = rows["1x2"][0]["tokens_per_step"], rows["1x2"][0]["grad_bytes"]
        print(f"\n{model}: gradient {grad / 2**20:.1f} MiB, {tokens} tokens per step")
        print(f"  1 process x 2 threads: step {one['step'] * 1e3:.1f} ms ({tokens / one['step']:,.0f} tokens/s)")
        print(f"  2 ranks x 1 thread:    step {two['step'] * 1e3:.1f} ms ({tokens / two['step']:,.0f} tokens/s); "
              f"compute {two['compute'] * 1e3:.1f} ms (slower rank {two['compute_max'] * 1e3:.1f}), "
              f"Allreduce (with the wait for the slower rank) {two['allreduce'] * 1e3:.1f} ms "
              f"({two['allreduce'] / two['step']:.0%} of the step), "
              f"update {two['update'] * 1e3:.1f} ms")
        bw = {}
        for r in rows["2x1"]:
            for size, t in r["allreduce_s_by_bytes"].items():
                bw.setdefault(int(size), []).append(t)
        for size, ts in sorted(bw.items()):
            t = statistics.median(ts)
            print(f"  Allreduce alone, {size / 2**20:6.1f} MiB: {t * 1e3:7.2f} ms ({size / t / 1e9:.2f} GB/s)")
        one_call = [t for r in rows["2x1"] for t in r["allreduce_one_call_s"].values()]
        size = int(next(iter(rows["2x1"][0]["allreduce_one_call_s"])))
        t = statistics.median(one_call)
        print(f"  the same {size / 2**20:.1f} MiB as one call: {t * 1e3:7.2f} ms ({size / t / 1e9:.2f} GB/s)")
        T1 = one["step"]
        print("  projection (machines like this one, 1 x 2 threads each):")
        print("  | machines | link | Allreduce | speed-up, batch per machine fixed | speed-up, global batch fixed |")
        for link in (1, 10):
            for M in (2, 4, 8):
                comm = project(grad, link, M)
                weak = M * T1 / (T1 + comm)
                strong = T1 / (one["compute"] / M + one["update"] + comm)
                print(f"  | {M} | {link} Gbit/s | {comm * 1e3:.1f} ms | {weak:.2f}x | {strong:.2f}x |")


if __name__ == "__main__":
    main()
