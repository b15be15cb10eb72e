"""tbp against Hugging Face transformers at GPT-2 124M's full size: logits, loss, every gradient,
and ten AdamW steps, as llm.c's test_gpt2.c checks its C backward.

The model is GPT-2 124M's exact shape (12 x 768, 12 heads, vocabulary 50,257, context 1,024),
random weights (seed 0) written by tbp's own exporter (``hf.export_hf``) and read back by its
importer (``hf.import_hf``), so the whole round trip is on the path: transformers'
``GPT2LMHeadModel.from_pretrained`` loads the exported folder. A batch of B 4 x T 64 random
tokens, targets the next tokens. Then, in float64 on both sides:

- logits, loss, and every parameter's gradient: the largest |tbp - torch| / max |torch| per tensor;
- ten AdamW steps on that batch (lr 1e-4, betas 0.9/0.999, eps 1e-8, no weight decay, no
  clipping: llm.c's test schedule): every step's loss, both engines;

and the ten steps again in float32 (llm.c's own tolerance there is 1e-2 on the loss). One record,
with the CPU and the versions, in results/gpt2_parity.jsonl. It needs an interpreter with torch and
transformers, and tbp on the path (neither is a tbp dependency):

    PYTHONPATH=. .torchenv/bin/python benchmarks/peers/gpt2_parity.py [--record]

About 8 GB of memory (two float64 models with gradients and moments) and a few minutes on 2 cores.
A real GPT-2 checkpoint changes nothing here but the numbers' sizes: ``--weights DIR`` (a local
Hugging Face GPT-2 folder) uses it instead of random weights.

``--small --fixture DIR`` runs the same comparison at a reduced shape (2 x 32, 4 heads, vocabulary
260, context 32, B 2 x T 16) and writes what the test suite needs to repeat it without torch:
the exported Hugging Face folder and transformers' own float64 logits, loss, gradients and
AdamW losses (``expected.npz``). tests/test_gpt2_parity.py holds tbp to those numbers.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tbp import GPT, ModelConfig
from tbp.interop import hf
from tbp.runs import disk
from tbp.train.optim import AdamW
from tbp.data.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402

B, T, STEPS, LR = 4, 64, 10, 1e-4
CFG = dict(vocab_size=50257, n_ctx=1024, n_layer=12, n_head=12, d_model=768)
SMALL = dict(vocab_size=260, n_ctx=32, n_layer=2, n_head=4, d_model=32)
SMALL_BATCH = (2, 16)


def gpt2_sized_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` entries (the 256 bytes, filler
    tokens, <|endoftext|> last, as GPT-2's id 50256), so that the export carries one; the
    comparison feeds token ids, never text."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    while len(vocab) < vocab_size - 1:
        vocab[f"<filler{len(vocab)}>"] = len(vocab)
    vocab["<|endoftext|>"] = vocab_size - 1
    t = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|endoftext|>"])
    return Tokenizer(t)


def models_from(folder: Path, work: Path, dtype) -> tuple:
    """tbp's model (imported from ``folder`` through tbp import) and transformers' (from_pretrained)."""
    run = work / f"imported-{np.dtype(dtype).name}"
    hf.import_hf(folder, run, force=True)
    ours = disk.load_model(run, dtype=np.dtype(dtype))[0]
    theirs = transformers.GPT2LMHeadModel.from_pretrained(
        folder, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, attn_implementation="eager")
    theirs = theirs.to(torch.float64 if dtype == np.float64 else torch.float32).train()
    return ours, theirs


def torch_loss(model, x, y):
    logits = model(torch.from_numpy(x)).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     torch.from_numpy(y).reshape(-1))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def gradients(ours, theirs, x, y) -> dict:
    """Logits, loss and every gradient of one forward and backward, both engines, compared."""
    ours.zero_grad()
    loss_ours = ours.loss_and_backward(x, y)
    logits_ours = ours.forward(x)
    theirs.zero_grad()
    logits, loss = torch_loss(theirs, x, y)
    loss.backward()
    params = dict(theirs.named_parameters())
    grads = {}
    for name, g in ours.grads.items():
        p = params[hf.hf_name(name)]
        grads[name] = rel(g, p.grad.detach().numpy())
    return {"logits": rel(logits_ours, logits.detach().numpy()),
            "loss": abs(loss_ours - loss.item()) / abs(loss.item()), "loss_tbp": loss_ours,
            "loss_torch": loss.item(), "grads": grads, "grad_max": max(grads.values())}


def fixture(folder: Path, theirs, x, y, out: Path) -> None:
    """transformers' float64 logits, loss, every gradient (under tbp's names) and the AdamW steps'
    losses on (x, y), beside the Hugging Face folder they came from, for the test suite."""
    import shutil
    shutil.copytree(folder, out / "hf", dirs_exist_ok=True)
    theirs.zero_grad()
    logits, loss = torch_loss(theirs, x, y)
    loss.backward()
    params = dict(theirs.named_parameters())
    arrays = {"x": x, "y": y, "logits": logits.detach().numpy(), "loss": np.array(loss.item())}
    for name, p in params.items():
        arrays[f"grad/{name}"] = p.grad.detach().numpy()
    opt = torch.optim.AdamW(theirs.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        step_loss = torch_loss(theirs, x, y)[1]
        step_loss.backward()
        opt.step()
        losses.append(step_loss.item())
    arrays["adamw_losses"] = np.array(losses)
    np.savez_compressed(out / "expected.npz", **arrays)
    (out / "VERSIONS").write_text(f"torch {torch.__version__}, transformers {transformers.__version__}, "
                                  f"numpy {np.__version__}; written by benchmarks/peers/gpt2_parity.py --small --fixture\n")


def adamw_steps(ours, theirs, x, y) -> dict:
    """STEPS AdamW steps on the same batch; each step's loss before its update, both engines."""
    opt_ours = AdamW(ours.layout, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = {"tbp": [], "torch": []}
    for _ in range(STEPS):
        ours.zero_grad()
        losses["tbp"].append(float(ours.loss_and_backward(x, y)))
        opt_ours.step(LR)
        opt_theirs.zero_grad()
        loss = torch_loss(theirs, x, y)[1]
        loss.backward()
        opt_theirs.step()
        losses["torch"].append(loss.item())
    diffs = [abs(a - b) for a, b in zip(losses["tbp"], losses["torch"])]
    return {**losses, "max_abs_diff": max(diffs)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, help="a local Hugging Face GPT-2 folder instead of random weights")
    p.add_argument("--record", action="store_true", help="append the result to results/gpt2_parity.jsonl")
    p.add_argument("--small", action="store_true", help=f"the reduced shape {SMALL}, batch {SMALL_BATCH}")
    p.add_argument("--fixture", type=Path, help="with --small: write the test suite's fixture to this folder")
    a = p.parse_args()
    cfg, (batch, T_) = (SMALL, SMALL_BATCH) if a.small else (CFG, (B, T))
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg["vocab_size"], (batch, T_ + 1))
    x, y = tokens[:, :T_], tokens[:, 1:]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = a.weights
        if folder is None:
            folder = work / "export"
            hf.export_hf(GPT(ModelConfig(**cfg), seed=0), gpt2_sized_tokenizer(cfg["vocab_size"]), folder)
        if a.fixture is not None:
            a.fixture.mkdir(parents=True, exist_ok=True)
            fixture(folder, models_from(folder, work, np.float64)[1], x, y, a.fixture)
        ours, theirs = models_from(folder, work, np.float64)
        f64 = gradients(ours, theirs, x, y)
        print(f"float64: logits {f64['logits']:.1e}, loss {f64['loss']:.1e} ({f64['loss_tbp']:.6f}), "
              f"largest gradient difference {f64['grad_max']:.1e} "
              f"({max(f64['grads'], key=f64['grads'].get)})", flush=True)
        steps64 = adamw_steps(ours, theirs, x, y)
        print(f"float64, {STEPS} AdamW steps: losses {', '.join(f'{v:.6f}' for v in steps64['tbp'])}; "
              f"largest |tbp - torch| {steps64['max_abs_diff']:.1e}", flush=True)
        del ours, theirs
        ours, theirs = models_from(folder, work, np.float32)
        steps32 = adamw_steps(ours, theirs, x, y)
        print(f"float32, {STEPS} AdamW steps: largest |tbp - torch| {steps32['max_abs_diff']:.1e}", flush=True)
    ok = f64["grad_max"] < 1e-10 and f64["logits"] < 1e-10 and steps64["max_abs_diff"] < 1e-6 \
        and steps32["max_abs_diff"] < 1e-2
    print("parity holds" if ok else "PARITY FAILS", f"({time.perf_counter() - t0:.0f} s)")
    if a.record:
        records.append("gpt2_parity", {
            "weights": "random, seed 0" if a.weights is None else str(a.weights), "config": cfg, "batch": [batch, T_],
            "steps": STEPS, "lr": LR, "float64": f64, "float64_steps": steps64, "float32_steps": steps32,
            "holds": ok, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "commit": records.commit()})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
