"""ALiBi against learned and rotary positions on the default run, and what each reads past its
trained context.

Each scheme trains the default run (4 x 128, 4 heads, context 128, 1,500 steps on the built-in
corpus, the default learning rate 1e-3 for all three: not swept per scheme) on seeds 1-3. Then
the trained weights read the whole validation split in windows of L = 128, 256 and 512 tokens
(learned positions: 128 only, they have no vector past it), in two ways:

- ``window``: the model as trained, a query reading at most the last 128 positions (a sliding
  window past the context, what generation computes);
- ``full``: the same weights built with a context of L, every query reading all the positions
  before it, up to L - 1 back: distances never seen in training. This is ALiBi's claim (Press
  et al. 2022: train short, test long).

Per window length: the mean loss over every predicted token, and over the positions past the
trained context only (128 .. L - 1). One record per (scheme, seed) in results/alibi_positions.jsonl,
table ``alibi_positions``. Each run is skipped if its record exists; ``TBP_RESULTS=DIR`` reruns it
from scratch; ``TBP_GEMM`` is pinned to numpy unless set.

    python benchmarks/studies/alibi_positions.py --jobs 2
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402
import runner                                             # noqa: E402

NAME = "alibi_positions"
SCHEMES = ("learned", "rope", "alibi")
LENGTHS = (128, 256, 512)


def read_windows(model, tokens: np.ndarray, L: int, batch: int = 8) -> tuple[float, float, int]:
    """(mean loss over all predicted tokens, mean over positions >= 128, windows) of the
    non-overlapping windows of L + 1 tokens of ``tokens``."""
    n = (tokens.size - 1) // L
    total = beyond = 0.0
    count = count_beyond = 0
    for b0 in range(0, n, batch):
        rows = range(b0, min(n, b0 + batch))
        idx = np.stack([tokens[r * L:r * L + L] for r in rows]).astype(np.int64)
        targets = np.stack([tokens[r * L + 1:r * L + L + 1] for r in rows]).astype(np.int64)
        logits = model.forward(idx).astype(np.float64)                       # (b, L, V)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]     # (b, L)
        total += nll.sum()
        count += nll.size
        beyond += nll[:, 128:].sum()
        count_beyond += nll[:, 128:].size
    return total / count, (beyond / count_beyond if count_beyond else float("nan")), n


def evaluate(run: Path) -> dict:
    from tbp import GPT
    from tbp.runs import disk
    from tbp.data.datasets import Dataset
    model, _, cfg = disk.load_model(run)
    tokens = np.asarray(Dataset.load(cfg["data"]).val)
    out = {}
    for L in LENGTHS:
        if L > model.config.n_ctx and "wpe" in model.embed.params:
            continue
        modes = {"window": model}
        if L > model.config.n_ctx:                 # the same weights with a context of L: no window
            wide = GPT(model.config.replace(n_ctx=L), dtype=model.dtype)
            for k, p in wide.params.items():
                p[...] = model.params[k]
            modes["full"] = wide
        for mode, m in modes.items():
            loss, past, n = read_windows(m, tokens, L)
            out[f"{mode} {L}"] = {"loss": loss, "past_context_loss": past, "windows": n}
    return out


def train_once(positions: str, seed: int, work: Path, threads: int, data: str) -> dict:
    commit = records.commit()
    out = work / f"{positions}-s{seed}"
    cmd = [sys.executable, "-m", "tbp", "train", "--data", data, "--out", str(out), "--positions", positions,
           "--seed", str(seed),
           "--threads", str(threads), "--quiet", "--force"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    final = [m for m in metrics if "val_split_loss" in m][-1]
    config = json.loads((out / "config.json").read_text())
    state = json.loads((out / "state.json").read_text())
    return {"positions": positions, "seed": seed, "threads": threads, "steps": final["step"],
            "val_split_loss": final["val_split_loss"], "reads": evaluate(out), "elapsed_s": state["elapsed_s"],
            "model": config["model"], "train": config["train"], "commit": commit}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--jobs", type=int, default=2, help="trainings side by side, one thread each")
    ap.add_argument("--work", default="bench-alibi", help="folder for the runs")
    a = ap.parse_args()
    records.pin_gemm()
    done = {(r["positions"], r["seed"]) for r in records.read(NAME)}
    todo = [(p, s) for s in a.seeds for p in SCHEMES if (p, s) not in done]
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = runner.builtin_data(work)

    def record(r: dict) -> None:
        records.append(NAME, r)
        reads = "  ".join(f"{k}: {v['loss']:.4f}" for k, v in r["reads"].items())
        print(f"{r['positions']} seed {r['seed']}: val {r['val_split_loss']:.4f}  {reads}", flush=True)
    runner.side_by_side(a.jobs, [(p, s, work, 1 if a.jobs > 1 else 0, data) for p, s in todo], train_once, record)


if __name__ == "__main__":
    main()
