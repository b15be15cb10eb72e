"""tbp's Llama-family block against Hugging Face transformers' LlamaForCausalLM at SmolLM2-135M's
exact shape: logits, loss and every gradient in float64, and ten AdamW steps.

The shape is SmolLM2-135M's (30 layers x 576, 9 heads over 3 key/value heads, SwiGLU 1,536 wide,
vocabulary 49,152, rope theta 100,000, RMSNorm eps 1e-5, tied head), random weights (seed 0)
written by tbp's exporter (``llama.export_llama``) and read back by its importer, so the whole
round trip is on the path: transformers' ``LlamaForCausalLM.from_pretrained`` loads the exported
folder. A batch of B 2 x T 64 random tokens, targets the next tokens. Then, in float64 on both
sides (transformers' three float32 steps -- RMSNorm's mean square, the rotary angles, the softmax -- made float64:
``float64_throughout``; the comparison with them as shipped is recorded too): logits, loss,
every parameter's gradient (transformers' mapped to tbp's layout by the
importer's own table, llama.to_tbp): the largest |tbp - torch| / max |torch| per tensor; ten AdamW
steps (lr 1e-4, no weight decay); the ten steps again in float32. One record, with the CPU and
the versions, in results/llama_parity.jsonl. It needs torch and transformers (not tbp
dependencies), and tbp on the path:

    PYTHONPATH=. .torchenv/bin/python benchmarks/peers/llama_parity.py [--record]

About 6 GB of memory and a few minutes on 2 cores. ``--weights DIR`` (a local SmolLM2 or other
Llama folder, bfloat16 as published) uses real weights instead.

``--small --fixture DIR`` runs the comparison at a reduced shape (2 x 32, 4 heads over 2, SwiGLU
48 wide, vocabulary 300, untied head) and writes what the suite needs to repeat it without
torch: the folder as *transformers* saves it, in bfloat16 (so the suite reads transformers' own
names and widens bfloat16 as a published checkpoint needs), and transformers' float64 logits,
loss and gradients of those weights (``expected.npz``). tests/test_llama.py holds tbp to them.
"""
import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tbp.interop import llama
from tbp.nn.config import ModelConfig
from tbp.nn.gpt import GPT
from tbp.runs import disk

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402
# the comparison's parts GPT-2's parity has already: a tokenizer of a given size, the loss, the
# relative difference, the AdamW steps
from gpt2_parity import LR, STEPS, adamw_steps, gpt2_sized_tokenizer as sized_tokenizer, rel, torch_loss  # noqa: E402,E501

SMOLLM2 = dict(vocab_size=49152, n_ctx=2048, n_layer=30, n_head=9, n_kv_head=3, d_model=576, swiglu_hidden=1536,
               rope_base=100000.0, ln_eps=1e-5, tie_head=True)
SMALL = dict(vocab_size=300, n_ctx=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, swiglu_hidden=48,
             rope_base=10000.0, ln_eps=1e-5, tie_head=False)
BATCH, SMALL_BATCH = (2, 64), (2, 16)


def float64_throughout(on: bool = True) -> None:
    """transformers' Llama computes three things in float32 whatever the model's dtype: RMSNorm's
    mean square (it casts its input to float32), the rotary angles (inverse frequencies and their
    products, then cos and sin) and the attention's softmax. With ``on``, each is the same
    equations in the input's dtype, so that a float64 comparison measures the method, not float32
    rounding (about 1e-7); off, transformers as shipped."""
    m = transformers.models.llama.modeling_llama
    shipped = m.__dict__.setdefault("_tbp_shipped", (m.LlamaRMSNorm.forward, m.LlamaRotaryEmbedding.forward,
                                                     m.eager_attention_forward))
    if not on:
        m.LlamaRMSNorm.forward, m.LlamaRotaryEmbedding.forward, m.eager_attention_forward = shipped
        return

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k, v = m.repeat_kv(key, module.num_key_value_groups), m.repeat_kv(value, module.num_key_value_groups)
        scores = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = torch.nn.functional.softmax(scores, dim=-1)             # in the scores' own dtype
        return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights

    def rms_norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        d = 2 * self.inv_freq.shape[0]
        inv_freq = self.config.rope_parameters["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    m.LlamaRMSNorm.forward, m.LlamaRotaryEmbedding.forward, m.eager_attention_forward = rms_norm, rotary, attention


def config(shape: dict) -> ModelConfig:
    return ModelConfig.from_dict({**llama.FAMILY, "attention": "gqa", **shape})


def models_from(folder: Path, work: Path, dtype) -> tuple:
    """tbp's model (through tbp's importer) and transformers' (from_pretrained), both in ``dtype``."""
    run = work / f"imported-{np.dtype(dtype).name}"
    llama.import_llama(folder, run, force=True)
    ours = disk.load_model(run, dtype=np.dtype(dtype))[0]
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                           torch_dtype=torch.float32)
    return ours, theirs.to(torch.float64 if dtype == np.float64 else torch.float32).train()


def torch_grads(theirs, cfg) -> dict:
    """transformers' gradients under tbp's names and layout (the importer's table)."""
    named = {n: p.grad.detach().numpy().copy() for n, p in theirs.named_parameters()}
    if cfg.tie_head:
        named.pop("lm_head.weight", None)           # the embedding's own parameter, listed twice
    return llama.to_tbp(named, cfg, Path("gradients"))


def gradients(ours, theirs, x, y) -> dict:
    ours.zero_grad()
    loss_ours = ours.loss_and_backward(x, y)
    logits_ours = ours.forward(x)
    theirs.zero_grad()
    logits, loss = torch_loss(theirs, x, y)
    loss.backward()
    want = torch_grads(theirs, ours.config)
    grads = {name: rel(g, want[name]) for name, g in ours.grads.items()}
    return {"logits": rel(logits_ours, logits.detach().numpy()),
            "loss": abs(loss_ours - loss.item()) / abs(loss.item()), "loss_tbp": loss_ours,
            "loss_torch": loss.item(), "grads": grads, "grad_max": max(grads.values())}


def fixture(folder: Path, x, y, out: Path) -> None:
    """The folder as transformers saves it in bfloat16, and transformers' float64 logits, loss and
    gradients (tbp's names) of those bfloat16 weights widened, for the test suite."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    saved = out / "hf"
    shutil.rmtree(saved, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(saved, safe_serialization=True)
    shutil.copy(folder / "tokenizer.json", saved / "tokenizer.json")
    theirs = transformers.LlamaForCausalLM.from_pretrained(saved, attn_implementation="eager",
                                                           torch_dtype=torch.float32).to(torch.float64)
    theirs.zero_grad()
    logits, loss = torch_loss(theirs, x, y)
    loss.backward()
    arrays = {"x": x, "y": y, "logits": logits.detach().numpy(), "loss": np.array(loss.item())}
    arrays.update({f"grad/{k}": v for k, v in torch_grads(theirs, config(SMALL)).items()})
    np.savez_compressed(out / "expected.npz", **arrays)
    (out / "VERSIONS").write_text(f"torch {torch.__version__}, transformers {transformers.__version__}, "
                                  f"numpy {np.__version__}; written by benchmarks/peers/llama_parity.py --small "
                                  f"--fixture\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, help="a local Llama-family folder instead of random weights")
    p.add_argument("--record", action="store_true", help="append the result to results/llama_parity.jsonl")
    p.add_argument("--small", action="store_true", help=f"the reduced shape {SMALL}, batch {SMALL_BATCH}")
    p.add_argument("--fixture", type=Path, help="with --small: write the test suite's fixture to this folder")
    a = p.parse_args()
    shape, (B, T) = (SMALL, SMALL_BATCH) if a.small else (SMOLLM2, BATCH)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, shape["vocab_size"], (B, T + 1))
    x, y = tokens[:, :T], tokens[:, 1:]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = a.weights
        if folder is None:
            folder = work / "export"
            llama.export_llama(GPT(config(shape), seed=0), sized_tokenizer(shape["vocab_size"]), folder)
        if a.fixture is not None:
            a.fixture.mkdir(parents=True, exist_ok=True)
            float64_throughout(True)
            fixture(folder, x, y, a.fixture)
        float64_throughout(False)
        shipped = gradients(*models_from(folder, work, np.float64), x, y)
        print(f"float64, transformers as shipped (float32 in RMSNorm, the rotary angles and the softmax): logits "
              f"{shipped['logits']:.1e}, largest gradient difference {shipped['grad_max']:.1e}", flush=True)
        float64_throughout(True)
        ours, theirs = models_from(folder, work, np.float64)
        f64 = gradients(ours, theirs, x, y)
        print(f"float64: logits {f64['logits']:.1e}, loss {f64['loss']:.1e} ({f64['loss_tbp']:.6f}), "
              f"largest gradient difference {f64['grad_max']:.1e} ({max(f64['grads'], key=f64['grads'].get)})",
              flush=True)
        steps64 = adamw_steps(ours, theirs, x, y)
        print(f"float64, {STEPS} AdamW steps: largest |tbp - torch| {steps64['max_abs_diff']:.1e}", flush=True)
        del ours, theirs
        ours, theirs = models_from(folder, work, np.float32)
        steps32 = adamw_steps(ours, theirs, x, y)
        print(f"float32, {STEPS} AdamW steps: largest |tbp - torch| {steps32['max_abs_diff']:.1e}", flush=True)
    ok = f64["grad_max"] < 1e-10 and f64["logits"] < 1e-10 and steps64["max_abs_diff"] < 1e-6 \
        and steps32["max_abs_diff"] < 1e-2
    print("parity holds" if ok else "PARITY FAILS", f"({time.perf_counter() - t0:.0f} s)")
    if a.record:
        records.append("llama_parity", {
            "weights": "random, seed 0" if a.weights is None else str(a.weights), "shape": shape, "batch": [B, T],
            "steps": STEPS, "lr": LR, "float64": f64, "float64_as_shipped": shipped, "float64_steps": steps64, "float32_steps": steps32,
            "holds": ok, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "commit": records.commit()})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
