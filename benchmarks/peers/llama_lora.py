"""A LoRA training step at SmolLM2-135M's shape: tbp against PyTorch + peft on the same cores,
with peak memory, each configuration in a fresh process, the arms interleaved.

The model is SmolLM2-135M's shape (30 layers x 576, 9 heads over 3 key/value heads, SwiGLU 1,536
wide, vocabulary 49,152, tied head; random float32 weights: a step's cost is the shape's), rank-8
adapters (alpha 16) on every projection of every block, AdamW over the adapters, B 4 x T 256
random tokens. Arms:

- ``tbp``: ``add_lora`` on c_attn, c_proj, c_fc, c_proj (tbp's fused q|k|v and gate|up matrices
  carry one adapter each);
- ``tbp-recompute``: the same with activation recomputation (one block's activations kept);
- ``torch``: transformers' LlamaForCausalLM with peft's LoRA on q, k, v, o, gate, up and down
  (its separate matrices carry one each: 7 adapters a block to tbp's 4, about 1.3x the adapter
  parameters -- a small share of a step either way), eager attention, torch.set_num_threads;
- ``torch-checkpointing``: the same with transformers' gradient checkpointing.

Each child runs ``--steps`` steps (the first is a warmup, not counted), reports the median step
time and its peak resident memory (ru_maxrss); rounds alternate the arms, ``--rounds`` of them;
the record holds every child's figures and the medians. torch and peft are not tbp dependencies:

    PYTHONPATH=. .torchenv/bin/python benchmarks/peers/llama_lora.py --record
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402

SHAPE = dict(vocab_size=49152, n_ctx=256, n_layer=30, n_head=9, n_kv_head=3, d_model=576, swiglu_hidden=1536,
             rope_base=100000.0, ln_eps=1e-5, tie_head=True)
RANK, ALPHA, LR = 8, 16.0, 1e-4
ARMS = ("tbp", "tbp-recompute", "torch", "torch-checkpointing")


def tbp_child(recompute: bool, B: int, T: int, steps: int) -> list[float]:
    import numpy as np
    from tbp.interop import llama
    from tbp.nn.config import ModelConfig
    from tbp.nn.gpt import GPT
    from tbp.nn.lora import add_lora
    from tbp.train.optim import AdamW
    cfg = ModelConfig.from_dict({**llama.FAMILY, "attention": "gqa", **SHAPE, "n_ctx": T, "recompute": recompute})
    model = GPT(cfg, seed=0)
    add_lora(model, RANK, ALPHA)
    opt = AdamW(model.layout, weight_decay=0.0)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        tokens = rng.integers(0, cfg.vocab_size, (B, T + 1))
        t0 = time.perf_counter()
        model.zero_grad()
        model.loss_and_backward(tokens[:, :-1], tokens[:, 1:])
        opt.step(LR)
        times.append(time.perf_counter() - t0)
    return times


def torch_child(checkpointing: bool, B: int, T: int, steps: int, threads: int) -> list[float]:
    import numpy as np
    import peft
    import torch
    import transformers
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["d_model"], intermediate_size=SHAPE["swiglu_hidden"],
        num_hidden_layers=SHAPE["n_layer"], num_attention_heads=SHAPE["n_head"],
        num_key_value_heads=SHAPE["n_kv_head"], max_position_embeddings=T, rms_norm_eps=SHAPE["ln_eps"],
        rope_theta=SHAPE["rope_base"], tie_word_embeddings=True, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        tokens = torch.from_numpy(rng.integers(0, SHAPE["vocab_size"], (B, T + 1)))
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def child(arm: str, B: int, T: int, steps: int, threads: int) -> None:
    if arm.startswith("tbp"):
        times = tbp_child(arm == "tbp-recompute", B, T, steps)
    else:
        times = torch_child(arm == "torch-checkpointing", B, T, steps, threads)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"arm": arm, "step_s": statistics.median(times[1:]), "times": times, "peak_bytes": peak}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, nargs=2, default=(4, 256), metavar=("B", "T"))
    p.add_argument("--steps", type=int, default=4, help="steps per child; the first is not counted")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--record", action="store_true", help="append to results/llama_lora.jsonl")
    a = p.parse_args()
    B, T = a.batch
    if a.child:
        child(a.child, B, T, a.steps, a.threads)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "OPENBLAS_NUM_THREADS": str(a.threads),
           "MKL_NUM_THREADS": str(a.threads)}
    runs = {arm: [] for arm in a.arms}
    for r in range(a.rounds):
        for arm in (a.arms if r % 2 == 0 else a.arms[::-1]):
            out = subprocess.run([sys.executable, __file__, "--child", arm, "--batch", str(B), str(T), "--steps",
                                  str(a.steps), "--threads", str(a.threads)], env=env, capture_output=True,
                                 text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            runs[arm].append(got)
            print(f"round {r + 1} {arm:20s} {got['step_s']:.2f} s/step, peak {got['peak_bytes'] / 2**30:.2f} GiB",
                  flush=True)
    medians = {arm: {"step_s": statistics.median(g["step_s"] for g in got),
                     "peak_bytes": statistics.median(g["peak_bytes"] for g in got)} for arm, got in runs.items()}
    for arm, m in medians.items():
        print(f"{arm:20s} median {m['step_s']:.2f} s/step, peak {m['peak_bytes'] / 2**30:.2f} GiB")
    if a.record:
        import torch
        import transformers
        import peft
        records.append("llama_lora", {"shape": SHAPE, "batch": [B, T], "rank": RANK, "alpha": ALPHA,
                                      "threads": a.threads, "steps": a.steps, "rounds": a.rounds, "runs": runs,
                                      "medians": medians, "torch": torch.__version__,
                                      "transformers": transformers.__version__, "peft": peft.__version__,
                                      "commit": records.commit()})


if __name__ == "__main__":
    main()
