"""A trained run in llama.cpp: how close each GGUF type comes to tbp, and how fast each decodes.

    python benchmarks/peers/gguf_check.py agree --checkpoint checkpoints/pydoc --record
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
        python benchmarks/peers/gguf_check.py speed --checkpoint checkpoints/pydoc --threads 1 --record  # quiet machine

agree: for f32, f16 and q8_0 files of the run, over the validation split read as tbp eval reads
it (non-overlapping windows of the context): the largest logit difference relative to the
largest logit, against tbp's exact forward and against tbp with llama.cpp's float16 GELU table;
the mean loss of both programs; and greedy continuations of 64 tokens from 16 prompts (the first
16 tokens of 16 windows), identical or where they first differ. llama.cpp runs through
llama-cpp-python with a float32 KV cache.

lookup: prompt-lookup decoding in both programs (tbp's --lookup, llama-cpp-python's
LlamaPromptLookupDecoding) against each one's plain greedy decoding, on the fixed prompts of
benchmarks/prompts/speculative.jsonl, the f32 file, --new tokens each, interleaved rounds.

speed: batch-1 decoding, tokens per second after a 16-token prompt, --new greedy tokens (at most up to the context), tbp's KV-cached
generator against llama.cpp on each file, interleaved, median of 5, at --threads (with the BLAS
threads set to the same number in the environment).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

TYPES = ("f32", "f16", "q8_0")


def export(run: Path, kind: str, folder: Path) -> Path:
    from tbp.interop import gguf
    from tbp.runs import disk
    model, tok, _ = disk.load_model(run)
    out = folder / f"{kind}.gguf"
    gguf.export_gguf(model, tok, out, kind, name=run.name)
    return out


def llama(path: Path, n_ctx: int, threads: int, **kw):
    """The file in llama.cpp as the tests load it (its weights as stored, a float32 KV cache)."""
    from test_gguf import load
    return load(path, n_ctx, threads, **kw)


def windows(run: Path, model):
    from tbp.runs import disk
    from tbp.data.batches import batches_for
    from tbp.data.datasets import Dataset
    ds = Dataset.load(Path(disk.read_config(run)["data"]))          # as tbp eval finds it
    return [(i, t) for b in batches_for(ds, model.config, model.collation).ordered("val", 32)
            for i, t in zip(b.idx, b.targets)]


def nll(z: np.ndarray, targets: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return np.log(np.exp(z).sum(-1)) - z[np.arange(len(targets)), targets]


def agree(args) -> None:
    from test_gguf import LlamaGelu
    from tbp.runs import disk
    run = Path(args.checkpoint)
    model, tok, _ = disk.load_model(run)
    model64 = disk.load_model(run, dtype=np.float64)[0]
    rows = windows(run, model)
    n_ctx = model.config.n_ctx
    with tempfile.TemporaryDirectory() as d:
        for kind in TYPES:
            path = export(run, kind, Path(d))
            llm = llama(path, n_ctx, os.cpu_count())
            worst_exact = worst_table = 0.0
            tbp_sum = ll_sum = 0.0
            count = 0
            for idx, tgt in rows:
                exact = model64.forward(idx[None])[0]
                with LlamaGelu():
                    tabled = model.forward(idx[None])[0].astype(np.float64)
                llm.reset()
                llm.eval(idx.tolist())
                got = np.array(llm.scores[:len(idx)], dtype=np.float64)
                scale = np.abs(exact).max()
                worst_exact = max(worst_exact, np.abs(got - exact).max() / scale)
                worst_table = max(worst_table, np.abs(got - tabled).max() / scale)
                tbp_sum += nll(exact, tgt).sum()
                ll_sum += nll(got, tgt).sum()
                count += len(tgt)
            same, first = 0, []
            for idx, _ in rows[:16]:
                prompt = idx[:16].tolist()
                from tbp.generate.sampling import Sampling, generate_ids
                mine = [int(t[0]) for t in generate_ids(model, prompt, 64, Sampling(0), np.random.default_rng(0))]
                llm.reset()
                theirs, last = [], prompt
                for _ in range(64):
                    llm.eval(last)
                    t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                    theirs.append(t)
                    last = [t]
                if mine == theirs:
                    same += 1
                else:
                    first.append(next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b))
            rec = {"type": kind, "checkpoint": run.name, "model": model.config.flat(), "tokenizer": tok.kind,
                   "bytes": path.stat().st_size, "windows": len(rows), "tokens": count,
                   "logits_vs_exact": worst_exact, "logits_vs_gelu_table": worst_table,
                   "loss_tbp_float64": tbp_sum / count, "loss_llama_cpp": ll_sum / count,
                   "greedy_prompts": 16, "greedy_tokens": 64, "greedy_identical": same, "greedy_first_difference": first,
                   "llama_cpp_python": _version("llama_cpp_python"), "gguf": _version("gguf"),
                   "numpy": np.__version__, "commit": records.commit()}
            print({k: v for k, v in rec.items() if k != "model"})
            if args.record:
                records.append("gguf_agree", rec)


def speed(args) -> None:
    from tbp.runs import disk
    from tbp.generate.sampling import Sampling, generate_ids
    from tbp.nn.decode import Inference
    run = Path(args.checkpoint)
    model, tok, _ = disk.load_model(run)
    prompt = windows(run, model)[0][0][:16].tolist()
    new = min(args.new, model.config.n_ctx - len(prompt))     # llama.cpp aborts past the learned positions
    threads = args.threads
    with tempfile.TemporaryDirectory() as d:
        paths = {k: export(run, k, Path(d)) for k in TYPES}
        llms = {k: llama(p, model.config.n_ctx, threads) for k, p in paths.items()}
        # tbp's decoder folds the layer norms into the weights once (the model's preparation, as
        # llama.cpp's load, which is made above and not timed either): folded here, read by every round
        t0 = time.perf_counter()
        folds = Inference(model, 1).prepare()
        fold_s = time.perf_counter() - t0
        for _t in generate_ids(model, prompt, 1, Sampling(0), np.random.default_rng(0), share=folds):
            pass
        times = {"tbp": [], **{k: [] for k in TYPES}}
        for _ in range(args.rounds):                     # interleaved: each round times every program once
            t0 = time.perf_counter()
            for _t in generate_ids(model, prompt, new, Sampling(0), np.random.default_rng(0), share=folds):
                pass
            times["tbp"].append(time.perf_counter() - t0)
            for k, llm in llms.items():
                llm.reset()
                t0 = time.perf_counter()
                last = prompt
                for _ in range(new):
                    llm.eval(last)
                    last = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
                times[k].append(time.perf_counter() - t0)
        tps = {k: new / statistics.median(v) for k, v in times.items()}
        rec = {"checkpoint": run.name, "model": model.config.flat(), "threads": threads, "prompt": len(prompt),
               "new_tokens": new, "rounds": args.rounds, "tokens_per_s": tps, "seconds": times,
               "tbp_products": "numpy",              # generation's products: NumPy's own BLAS
               "tbp_fold": "before timing",          # as llama.cpp's load (older records: in each round)
               "tbp_fold_s": fold_s,
               "llama_cpp_python": _version("llama_cpp_python"), "numpy": np.__version__, "commit": records.commit()}
        print(threads, {k: round(v, 1) for k, v in tps.items()})
        if args.record:
            records.append("gguf_speed", rec)


PROMPTS = Path(__file__).resolve().parents[1] / "prompts" / "speculative.jsonl"


def lookup(args) -> None:
    """Prompt lookup in both programs on the fixed prompts: tbp's (--lookup: n-gram 3, up to 8
    drafts, its draft length following the measured costs) and llama-cpp-python's
    (LlamaPromptLookupDecoding, n-gram 3, 8 drafts: the speculative decoding it offers), each
    against its own plain greedy decoding, on the f32 file, interleaved rounds."""
    import json

    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from tbp.check.bench import timed_decode
    from tbp.generate.sampling import Sampling
    from tbp.generate.speculative import Lookup
    from tbp.nn.decode import Inference
    from tbp.runs import disk
    run = Path(args.checkpoint)
    model, tok, _ = disk.load_model(run)
    n_ctx, threads = model.config.n_ctx, args.threads
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    folds = Inference(model, 1).prepare()            # made before timing, as llama.cpp's load
    with tempfile.TemporaryDirectory() as d:
        path = export(run, "f32", Path(d))
        plain = llama(path, n_ctx, threads)
        looking = llama(path, n_ctx, threads, draft_model=LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=8))

        def theirs(llm, ids, new):
            t0 = time.perf_counter()
            out = []
            for t in llm.generate(ids, temp=0.0, reset=True):
                out.append(int(t))
                if len(out) == new:
                    break
            return out, time.perf_counter() - t0
        for p in prompts:
            ids = tok.encode(p["prompt"], "prompt")[-(n_ctx // 2):]
            new = min(args.new, n_ctx - len(ids) - 8)       # llama.cpp aborts past the learned positions
            arms = {"tbp": lambda: timed_decode(model, ids, new, Sampling(0), 0, None, folds)[:2],
                    "tbp lookup": lambda: timed_decode(model, ids, new, Sampling(0), 0, Lookup(3, 8), folds)[:2],
                    "llama.cpp": lambda: theirs(plain, ids, new), "llama.cpp lookup": lambda: theirs(looking, ids, new)}
            for a in arms.values():                     # warm: caches, the first forward over several tokens
                a()
            times = {a: [] for a in arms}
            texts = {}
            for r in range(args.rounds):
                for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    texts[a], dt = arms[a]()
                    times[a].append(dt)
            tps = {a: new / statistics.median(v) for a, v in times.items()}
            pairs = list(zip(texts["tbp"], texts["tbp"][1:]))
            rec = {"checkpoint": run.name, "model": model.config.flat(), "threads": threads, "prompt": p["name"],
                   "kind": p["kind"], "prompt_tokens": len(ids), "new_tokens": new, "rounds": args.rounds,
                   "tokens_per_s": tps, "seconds": times,
                   "tbp_lookup_speedup": statistics.median(a / b for a, b in zip(times["tbp"], times["tbp lookup"])),
                   "llama_lookup_speedup": statistics.median(a / b for a, b in zip(times["llama.cpp"],
                                                                                     times["llama.cpp lookup"])),
                   "same_text": {a: texts[a] == texts["tbp"] for a in arms},
                   "distinct2": len(set(pairs)) / max(1, len(pairs)), "text": tok.decode(texts["tbp"])[:300],
                   "llama_cpp_python": _version("llama_cpp_python"), "numpy": np.__version__,
                   "commit": records.commit()}
            print(p["name"], {a: round(v) for a, v in tps.items()}, f"distinct-2 {rec['distinct2']:.2f}", flush=True)
            if args.record:
                records.append("gguf_lookup", rec)


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["agree", "speed", "lookup"])
    ap.add_argument("--checkpoint", default="checkpoints/pydoc")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=128, help="speed: tokens to generate (at most the context's room)")
    ap.add_argument("--threads", type=int, default=1, help="speed: llama.cpp's threads; run the script with "
                    "OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS at the same number for tbp's")
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/results/")
    args = ap.parse_args()
    {"agree": agree, "speed": speed, "lookup": lookup}[args.what](args)


if __name__ == "__main__":
    main()
