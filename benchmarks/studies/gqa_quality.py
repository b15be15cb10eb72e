"""What grouped-query attention costs in quality: the default run with 4, 2 and 1 key/value heads.

The default model (4 x 128, 4 query heads, context 128, 1,500 steps on the built-in corpus) is
trained with standard attention (4 key/value heads: every query head its own keys and values)
and with ``--attention gqa --n-kv-head`` 2 (pairs of query heads share one) and 1 (multi-query
attention), and each run's final
validation loss over the whole validation split is recorded. Declared before any run: the
arms count as **equivalent if the paired difference's 95 % interval lies within ±0.02 nats**
(MARGIN), and as worse or better only if the interval excludes zero.

Fair tuning, in three phases (each skips the runs its records already hold):

- ``sweep``: the full-head arm at learning rates 5e-4, 1e-3 (the default) and 2e-3 on seeds 1
  and 2, extended by factors of 2 past an edge that holds the best (at most twice); its best
  rate (lowest mean loss) becomes every arm's rate;
- ``neighbours``: the shared-head arms at half and twice that rate on seed 1, so that a rate
  tuned for full heads cannot be what handicaps them (the reading says if a neighbour beats it);
- ``seeds``: every arm at the chosen rate on seeds 1-5, paired by seed (the same initialisation
  of what the arms share and the same batches).

``min_lr`` is a tenth of the peak in every run, the default's ratio. Beside the losses, each
arm's parameters and KV-cache bytes per token, and ``speed``: decoding tokens/s of the three
architectures paired in one process (random weights; speed needs the shape only) at the
default context and at a 4,096-token context with rotary positions. Records:
results/gqa_quality.jsonl, results/gqa_speed.jsonl; tables ``gqa_quality`` and ``gqa_speed``.

    python benchmarks/studies/gqa_quality.py sweep neighbours seeds --jobs 2
    python benchmarks/studies/gqa_quality.py speed

``TBP_GEMM`` is pinned to ``numpy`` unless set; ``TBP_RESULTS=DIR`` reruns it from scratch.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402
import runner                                             # noqa: E402

NAME, SPEED = "gqa_quality", "gqa_speed"
WORK = Path("bench-gqa")            # the prepared corpus the runs share (the runs themselves are temporary)
MARGIN = 0.02
ARMS = (4, 2, 1)
SWEEP = (5e-4, 1e-3, 2e-3)
EXTEND = 2                          # extensions of the grid past an edge best


def train_once(kv: int, lr: float, seed: int, threads: int, data: str) -> dict:
    commit = records.commit()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        arch = [] if kv == 4 else ["--attention", "gqa", "--n-kv-head", str(kv)]      # 4: standard attention
        cmd = [sys.executable, "-m", "tbp", "train", "--data", data, "--out", str(out), *arch, "--lr", repr(lr),
               "--min-lr", repr(lr / 10), "--seed", str(seed), "--threads", str(threads), "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        final = [m for m in metrics if "val_split_loss" in m][-1]
        state = json.loads((out / "state.json").read_text())
        config = json.loads((out / "config.json").read_text())
    from tbp import GPT, ModelConfig
    model = GPT(ModelConfig(**config["model"]), seed=0)
    return {"n_kv_head": kv, "lr": lr, "seed": seed, "threads": threads, "steps": final["step"],
            "val_split_loss": final["val_split_loss"], "val_split_tokens": final["val_split_tokens"],
            "params": int(sum(p.size for p in model.params.values())),
            "cache_bytes_per_token": model.inference(1).cache_bytes // config["model"]["n_ctx"],
            "elapsed_s": state["elapsed_s"], "model": config["model"], "margin": MARGIN, "commit": commit}


def run_all(todo: list[tuple], jobs: int) -> None:
    done = {(r["n_kv_head"], r["lr"], r["seed"]) for r in records.read(NAME)}
    todo = [t for t in todo if t not in done]
    threads = 1 if jobs > 1 else 0
    data = runner.builtin_data(WORK)

    def record(r: dict) -> None:
        records.append(NAME, r)
        print(f"kv {r['n_kv_head']} lr {r['lr']:g} seed {r['seed']}: {r['val_split_loss']:.4f} "
              f"({r['elapsed_s']:.0f} s)", flush=True)
    runner.side_by_side(jobs, [(kv, lr, seed, threads, data) for kv, lr, seed in todo], train_once, record)


def swept() -> dict[float, float]:
    """The full-head arm's mean loss over seeds 1 and 2 at every rate both seeds have run."""
    rows = [r for r in records.read(NAME) if r["n_kv_head"] == 4 and r["seed"] in (1, 2)]
    rates = sorted({r["lr"] for r in rows})
    return {lr: float(np.mean([r["val_split_loss"] for r in rows if r["lr"] == lr])) for lr in rates
            if sum(r["lr"] == lr for r in rows) == 2}


def sweep(jobs: int) -> None:
    """SWEEP on seeds 1 and 2, then a factor of 2 past whichever edge holds the best mean,
    until the best is inside the grid (at most EXTEND times): the full-head arm's rate must not
    be the grid's choice."""
    grid = list(SWEEP)
    run_all([(4, lr, s) for s in (1, 2) for lr in grid], jobs)
    for _ in range(EXTEND):
        means = swept()
        best = min(means, key=means.get)
        if min(means) < best < max(means):
            return
        nxt = best * 2 if best == max(means) else best / 2
        print(f"the best rate {best:g} is at the grid's edge: adding {nxt:g}", flush=True)
        run_all([(4, nxt, s) for s in (1, 2)], jobs)


def best_lr() -> float:
    means = swept()
    if not set(SWEEP) <= set(means):
        sys.exit("run the sweep first: python benchmarks/studies/gqa_quality.py sweep")
    return min(means, key=means.get)


def speed(rounds: int, tokens: int) -> None:
    """Decoding tokens/s of the three arms, paired: each round times every arm once, in turn."""
    from tbp import GPT, ModelConfig
    cases = {"default, context 128": dict(), "rotary, context 4,096": dict(positions="rope", n_ctx=4096)}
    for case, extra in cases.items():
        engines = {}
        for kv in ARMS:
            arch = {} if kv == 4 else {"attention": "gqa", "n_kv_head": kv}
            model = GPT(ModelConfig(vocab_size=103, **arch, **{"n_ctx": 128, **extra}), seed=0)
            engines[kv] = (model, model.inference(1))
        n = engines[4][0].config.n_ctx
        prompt = np.random.default_rng(0).integers(0, 103, (1, n - tokens))
        times = {kv: [] for kv in ARMS}
        for r in range(rounds):
            for kv in (ARMS if r % 2 == 0 else ARMS[::-1]):
                _, engine = engines[kv]
                engine.reset()
                engine.forward(prompt)
                t = time.perf_counter()
                tok = prompt[:, -1:]
                for _ in range(tokens):
                    logits = engine.forward(tok)
                    tok = logits[:, -1:].argmax(-1)
                times[kv].append(time.perf_counter() - t)
        rec = {"case": case, "tokens": tokens, "rounds": rounds, "cache_tokens": n,
               "tokens_per_s": {str(kv): tokens / float(np.median(ts)) for kv, ts in times.items()},
               "cache_bytes": {str(kv): engines[kv][1].cache_bytes for kv in ARMS}, "commit": records.commit()}
        records.append(SPEED, rec)
        print(case, {kv: round(v, 1) for kv, v in rec["tokens_per_s"].items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phases", nargs="+", choices=("sweep", "neighbours", "seeds", "speed"))
    ap.add_argument("--jobs", type=int, default=2, help="trainings side by side, one thread each")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    records.pin_gemm()
    for phase in a.phases:
        if phase == "sweep":
            sweep(a.jobs)
        elif phase == "neighbours":
            lr = best_lr()
            run_all([(kv, f * lr, 1) for kv in ARMS[1:] for f in (0.5, 2.0)], a.jobs)
        elif phase == "seeds":
            lr = best_lr()
            run_all([(kv, lr, s) for s in range(1, 6) for kv in ARMS], a.jobs)
        else:
            speed(a.rounds, 64)


if __name__ == "__main__":
    main()
