"""Cross-check an export against Hugging Face transformers (run with an interpreter that has
transformers and torch; neither is a tbp dependency).

    tbp export checkpoints/pydoc --out export/pydoc-gpt2
    python benchmarks/peers/check_transformers.py --run checkpoints/pydoc --export export/pydoc-gpt2 \
        --hf-python .torchenv/bin/python

Computes tbp's logits for random token ids, loads the export with
transformers.GPT2LMHeadModel.from_pretrained in the other interpreter, and prints the
largest difference (one record in results/check_transformers.jsonl).
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp import GPT

HF_SIDE = """
import sys, numpy as np, torch
from transformers import GPT2LMHeadModel
m = GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()
idx = torch.from_numpy(np.load(sys.argv[2]))
with torch.no_grad():
    np.save(sys.argv[3], m(idx).logits.numpy())
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--export", required=True)
    p.add_argument("--hf-python", required=True)
    a = p.parse_args()
    model = GPT.load(a.run)
    idx = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, min(64, model.config.n_ctx)))
    ours = model.forward(idx)
    with tempfile.TemporaryDirectory() as d:
        np.save(Path(d) / "idx.npy", idx)
        subprocess.run([a.hf_python, "-c", HF_SIDE, a.export, str(Path(d) / "idx.npy"), str(Path(d) / "hf.npy")],
                       check=True)
        theirs = np.load(Path(d) / "hf.npy")
    diff, largest = float(np.abs(ours - theirs).max()), float(np.abs(ours).max())
    print(f"max |logits tbp - logits transformers| = {diff:.2e} (largest logit {largest:.2f})")
    records.append("check_transformers", {"commit": records.commit(), "run": a.run, "config": model.config.flat(),
                                          "max_abs_diff": diff, "largest_logit": largest})


if __name__ == "__main__":
    main()
