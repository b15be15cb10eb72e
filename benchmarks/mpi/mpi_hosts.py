"""Two hosts over a real link: what overlapping the gradient sum with the backward hides, and what
the sharded optimizer (ZeRO-1) saves, measured rather than projected.

Two network namespaces of this machine stand in for two machines (netns.py), one rank in each
(1 thread: the machine's 2 cores, one per host), talking over TCP through veth pairs whose
sending rate a token bucket (tc tbf) holds to 1 or 10 Gbit/s, or leaves free. For each model and
link, in one MPI job, rounds interleave five ways of taking the same training step:

- ``alone``: forward + backward + clip + AdamW with no communication at all (the compute);
- ``plain``: then one allreduce of the whole gradient (tbp's default);
- ``overlap``: each block's gradient summed by a communication thread during the backward;
- ``sharded``: reduce-scatter, clip and update this rank's slice, allgather (ZeRO-1);
- ``sharded+overlap``: both.

Each step is timed phase by phase (backward, the wait for the sum, clip, update, allgather),
with a barrier before it so the ranks start together; medians of the steps of a round, the
slower rank's time. The hidden fraction of a round is (plain - overlap) / (plain - alone): the
share of the communication's cost the overlap took off the step.

    sudo python benchmarks/mpi/mpi_hosts.py --rounds 5          # root (namespaces), the mpi extra

Records: benchmarks/results/mpi_hosts.jsonl, one per model x link x round. On this stand-in the
TCP stack runs on the same two cores as the compute (a real pair of machines has its own), so
what the kernel spends on the link is charged to the step here.
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
import netns  # noqa: E402
import records  # noqa: E402

MODELS = {"4x128": dict(n_layer=4, n_head=4, d_model=128, n_ctx=64, batch=12),
          "6x384": dict(n_layer=6, n_head=6, d_model=384, n_ctx=256, batch=8)}
MODES = {"alone": (False, False), "plain": (False, False), "overlap": (False, True),
         "sharded": (True, False), "sharded+overlap": (True, True)}
PHASES = ("backward", "wait", "clip", "update", "gather", "step")


def rank_program(args) -> None:
    """One rank of the measurement: prints one JSON line per round (rank 0)."""
    from tbp.train import distributed
    from tbp.train.distributed import World
    from tbp.train.gradsync import GradientSync
    from tbp.nn.gpt import GPT
    from tbp.nn.config import ModelConfig
    from tbp.nn.batch import Batch
    from tbp.train.optim import AdamW
    from tbp.train.loop import rank_workers
    world = distributed.world()
    spec = MODELS[args.model]
    B, T = spec["batch"], spec["n_ctx"]
    model = GPT(ModelConfig(vocab_size=65, n_ctx=T, n_layer=spec["n_layer"], n_head=spec["n_head"],
                            d_model=spec["d_model"]), seed=0)
    workers = rank_workers(model, world, 1, B)
    layout = model.layout
    syncs = {mode: GradientSync(World() if mode == "alone" else world, model, shard, overlap)
             for mode, (shard, overlap) in MODES.items()}
    whole = AdamW(layout)
    opts = {mode: whole.slice(*s.owned) if s.shard else whole for mode, s in syncs.items()}
    for o in opts.values():
        o.workers = workers.local
    moments = {mode: int(o.m.nbytes + o.v.nbytes) for mode, o in opts.items()}
    rng = np.random.default_rng(0)
    batch = Batch(rng.integers(0, 65, (B, T)), rng.integers(0, 65, (B, T)))
    with workers:
        for r in range(args.rounds):
            out = {"round": r}
            for mode, sync in syncs.items():
                opt, times = opts[mode], {p: [] for p in PHASES}
                for i in range(args.warmup + args.steps):
                    world.comm.Barrier()
                    t0 = time.perf_counter()
                    model.zero_grad()
                    sync.arm()
                    loss = workers.accumulate(batch, 1.0, sync if sync.overlap else None)
                    t1 = time.perf_counter()
                    sync.finish()
                    if mode != "alone":
                        world.sum_values(loss)
                    t2 = time.perf_counter()
                    sync.clip(1.0)
                    t3 = time.perf_counter()
                    opt.step(1e-5)
                    t4 = time.perf_counter()
                    sync.share_update()
                    t5 = time.perf_counter()
                    if i >= args.warmup:
                        for p, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
                            times[p].append(v)
                mine = {p: statistics.median(v) for p, v in times.items()}
                slowest = world.comm.allreduce(mine["step"], op=world.MPI.MAX)
                out[mode] = {**{f"{p}_ms": 1e3 * v for p, v in mine.items()}, "step_max_ms": 1e3 * slowest,
                             "moments_bytes": moments[mode]}
                world.bcast_(layout.params)                # the same weights again on every rank
            # the gradient's sum alone, every rank entering together
            ts = []
            for _ in range(5):
                world.comm.Barrier()
                t = time.perf_counter()
                world.sum_(layout.grads)
                ts.append(world.comm.allreduce(time.perf_counter() - t, op=world.MPI.MAX))
            out["allreduce_alone_ms"] = 1e3 * statistics.median(ts)
            if world.is_root:
                print(json.dumps(out), flush=True)
    if world.is_root:
        print(json.dumps({"grad_bytes": int(layout.grads.nbytes), "params": int(layout.size),
                          "tokens_per_step": B * T}), flush=True)
    world.finish()


def measure(hosts, args, model: str, link) -> list[dict]:
    """One job over the two hosts with the link at ``link`` Gbit/s (None: free)."""
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    hosts.shape(link)
    cmd = hosts.command(mpiexec, [__file__, "--rank-program", "--model", model, "--rounds", args.rounds,
                                  "--steps", args.steps, "--warmup", args.warmup])
    env = {**os.environ, **hosts.ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(netns.ROOT)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return lines[:-1], lines[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=list(MODELS), default="4x128")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--links", nargs="+", default=["free", "10", "1"], help="Gbit/s, or free")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dry", action="store_true", help="print the records instead of appending them")
    args = ap.parse_args()
    if args.rank_program:
        return rank_program(args)
    hosts = netns.Hosts()
    try:
        for model in args.models:
            for link in args.links:
                gbit = None if link == "free" else float(link)
                rounds, about = measure(hosts, args, model, gbit)
                for r in rounds:
                    rec = {"bench": "mpi_hosts", "commit": records.commit(), "model": model, **MODELS[model],
                           "n_layer": MODELS[model]["n_layer"], "link_gbit": gbit, "hosts": 2, "ranks": 2,
                           "threads": 1, "steps": args.steps, **about, **r}
                    if args.dry:
                        print(json.dumps(rec))
                    else:
                        records.append("mpi_hosts", rec)
                plain = statistics.median(r["plain"]["step_max_ms"] for r in rounds)
                over = statistics.median(r["overlap"]["step_max_ms"] for r in rounds)
                alone = statistics.median(r["alone"]["step_max_ms"] for r in rounds)
                print(f"{model} link {link}: alone {alone:.1f} ms, plain {plain:.1f}, overlap {over:.1f}, "
                      f"sum alone {statistics.median(r['allreduce_alone_ms'] for r in rounds):.1f} ms", flush=True)
    finally:
        hosts.shape(None)
        hosts.close()


if __name__ == "__main__":
    main()
