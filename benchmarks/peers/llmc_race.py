"""The race with llm.c: full fine-tuning steps of GPT-2 124M on the CPU, tbp against llm.c's
`train_gpt2.c` (built from its public source with its Makefile's flags: -Ofast -march=native,
OpenMP), the same weights, B 4 x T 64 (llm.c's CPU demo shape), at 1 and 2 threads; with
``--context 1024``, B 4 x T 1,024 (GPT-2's whole context).

    python benchmarks/peers/llmc_race.py --llmc /path/to/llm.c --record
    python benchmarks/peers/llmc_race.py --llmc /path/to/llm.c --context 1024 --steps 3 --threads 2 --record

llm.c is copied into a scratch folder and built there (never vendored into tbp). Its
`train_gpt2.c` hard-codes 40 steps, a validation pass every 10 and generation every 20; the
scratch copy's step count is set to --steps (one sed of the loop bound) so that a run takes
about a minute at T 64, and its sequence length to --context (the line ``int T = 64;``), and the first step (warm-up) is left out of its median. The model file is
written in llm.c's format (header, then its 16 tensors in its order, linear weights as (out,
in), the vocabulary padded to 50,304) from a tbp GPT-2 124M with random weights; the token
files hold random GPT-2 token ids (no tokenizer is needed for timing; llm.c says it has none).
tbp runs the same step -- forward, backward, AdamW (lr 1e-4, no weight decay, llm.c's betas) --
on the same weights, its BLAS threads set to the same count. The two programs alternate.
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

VP = 50304                 # llm.c pads the vocabulary to a multiple of 128


def write_model(model, path: Path) -> None:
    """``model`` (a tbp GPT of GPT-2's shape) in llm.c's checkpoint format, version 3."""
    cfg, p = model.config, model.params
    L, C, V, T = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.n_ctx
    header = np.zeros(256, np.int32)
    header[:8] = [20240326, 3, T, V, L, cfg.n_head, C, VP]
    wte = np.zeros((VP, C), np.float32)
    wte[:V] = p["wte"]

    def stack(name, transpose=False):
        return np.stack([p[f"h.{i}.{name}"].T if transpose else p[f"h.{i}.{name}"] for i in range(L)])
    tensors = [wte, p["wpe"], stack("ln_1.weight"), stack("ln_1.bias"), stack("attn.c_attn.weight", True),
               stack("attn.c_attn.bias"), stack("attn.c_proj.weight", True), stack("attn.c_proj.bias"),
               stack("ln_2.weight"), stack("ln_2.bias"), stack("mlp.c_fc.weight", True), stack("mlp.c_fc.bias"),
               stack("mlp.c_proj.weight", True), stack("mlp.c_proj.bias"), p["ln_f.weight"], p["ln_f.bias"]]
    with open(path, "wb") as f:
        header.tofile(f)
        for t in tensors:
            np.ascontiguousarray(t, dtype=np.float32).tofile(f)


def write_tokens(path: Path, n: int, seed: int) -> None:
    header = np.zeros(256, np.int32)
    header[:3] = [20240520, 1, n]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        header.tofile(f)
        np.random.default_rng(seed).integers(0, 50257, n).astype(np.uint16).tofile(f)


def build(llmc: Path, scratch: Path, steps: int, context: int) -> Path:
    work = scratch / "llm.c"
    shutil.copytree(llmc, work, ignore=shutil.ignore_patterns(".git"))
    src = work / "train_gpt2.c"
    text = src.read_text()
    if "step <= 40" not in text or "int T = 64;" not in text:
        raise SystemExit("train_gpt2.c has no 'step <= 40' loop or 'int T = 64;': a different llm.c than this "
                         "script knows")
    src.write_text(text.replace("step <= 40", f"step <= {steps}").replace("int T = 64;", f"int T = {context};"))
    subprocess.run(["make", "train_gpt2"], cwd=work, check=True, capture_output=True)
    return work


def run_llmc(work: Path, threads: int) -> tuple[list[float], float]:
    """(seconds of each training step, the validation loss it printed first, before any step)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(["./train_gpt2"], cwd=work, env=env, capture_output=True, text=True, check=True).stdout
    steps = [float(ms) / 1000 for ms in re.findall(r"step \d+: train loss [-\d.e+naif]+ \(took ([\d.]+) ms\)", out)]
    return steps, float(re.search(r"val loss ([\d.]+)", out).group(1))


def tbp_val_loss(model, path: Path, context: int, batches: int = 5) -> float:
    """The loss llm.c's first validation pass reads: its first ``batches`` batches of the val
    file, B 4 x T ``context`` each, in order (its val loader does not shuffle) -- a check that
    the weights crossed over as they are."""
    tokens = np.fromfile(path, dtype=np.uint16, offset=256 * 4).astype(np.int64)
    n = 4 * context
    losses = []
    for i in range(batches):
        w = tokens[i * n:i * n + n + 1]
        losses.append(model.loss(w[:-1].reshape(4, context), w[1:].reshape(4, context)))
    return float(np.mean(losses))


TBP_CHILD = "--tbp-child"


def tbp_child(steps: int, context: int) -> None:
    from tbp.nn.gpt import GPT
    from tbp.nn.config import ModelConfig
    from tbp.train.optim import AdamW
    model = GPT(ModelConfig(vocab_size=50257, n_ctx=1024, n_layer=12, n_head=12, d_model=768), seed=0)
    opt = AdamW(model.layout, weight_decay=0.0, beta1=0.9, beta2=0.999)
    rng = np.random.default_rng(0)
    for _ in range(steps + 1):
        idx = rng.integers(0, 50257, (4, context + 1))
        t0 = time.perf_counter()
        model.loss_and_backward(idx[:, :-1], idx[:, 1:])
        opt.step(1e-4)
        print(f"took {time.perf_counter() - t0:.6f}", flush=True)


def run_tbp(threads: int, steps: int, context: int) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads), "TBP_GEMM": "numpy"}
    out = subprocess.run([sys.executable, __file__, TBP_CHILD, str(steps), str(context)], env=env, capture_output=True, text=True,
                         check=True).stdout
    return [float(x) for x in re.findall(r"took ([\d.]+)", out)]


def main() -> None:
    if TBP_CHILD in sys.argv:
        tbp_child(int(sys.argv[2]), int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc", type=Path, required=True, help="a checkout of llm.c (karpathy/llm.c)")
    ap.add_argument("--llmc-commit", default=None, help="its commit, where --llmc is not a git checkout")
    ap.add_argument("--steps", type=int, default=8, help="timed steps after the first")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--context", type=int, default=64, help="T of the B 4 x T batches (llm.c's demo: 64)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    from tbp.nn.gpt import GPT
    from tbp.nn.config import ModelConfig
    commit_llmc = args.llmc_commit or subprocess.run(["git", "-C", str(args.llmc), "rev-parse", "--short=12", "HEAD"],
                                                     capture_output=True, text=True).stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory() as d:
        work = build(args.llmc, Path(d), args.steps, args.context)
        model = GPT(ModelConfig(vocab_size=50257, n_ctx=1024, n_layer=12, n_head=12, d_model=768), seed=0)
        write_model(model, work / "gpt2_124M.bin")
        for split, n, seed in (("train", max(1 << 17, 64 * args.context * (args.steps + 2)), 1),
                               ("val", max(1 << 14, 4 * args.context * 6), 2)):
            write_tokens(work / "dev/data/tinyshakespeare" / f"tiny_shakespeare_{split}.bin", n, seed)
        val_tbp = tbp_val_loss(model, work / "dev/data/tinyshakespeare/tiny_shakespeare_val.bin", args.context)
        del model
        for threads in args.threads:
            llmc, val_llmc = run_llmc(work, threads)
            llmc = llmc[1:]                               # the first step warms up
            mine = run_tbp(threads, args.steps, args.context)[1:]
            tok = 4 * args.context
            rec = {"model": "gpt2-124m shape", "batch": 4, "context": args.context, "threads": threads,
                   "llmc_step_s": llmc, "tbp_step_s": mine, "val_loss_llmc": val_llmc, "val_loss_tbp": val_tbp,
                   "llmc_tokens_per_s": tok / statistics.median(llmc), "tbp_tokens_per_s": tok / statistics.median(mine),
                   "llmc_commit": commit_llmc, "llmc_flags": "Makefile: -Ofast -march=native -fopenmp",
                   "gcc": subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
                   "numpy": np.__version__, "commit": records.commit()}
            print(f"{threads} thread(s): tbp {rec['tbp_tokens_per_s']:.1f} tokens/s, llm.c "
                  f"{rec['llmc_tokens_per_s']:.1f} tokens/s ({rec['tbp_tokens_per_s'] / rec['llmc_tokens_per_s']:.2f}x)")
            if args.record:
                records.append("llmc_race", rec)


if __name__ == "__main__":
    main()
