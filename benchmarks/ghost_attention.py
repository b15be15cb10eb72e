"""Ghost Attention, measured: does a model keep to a system instruction turns after it was given?

A synthetic dialogue language whose constraints a program checks. The user names a thing
("sky?"), the plain reply says its colour ("sky is blue"); a system instruction asks
for replies in upper case, ending with "!", or starting with a name ("Ann: ..."); a quarter of
the dialogues have no instruction. Dialogues have 1..7 turns. Three training sets from the
same dialogues (Touvron et al. 2023, Llama 2, §3.3):

  (a) plain    the instruction in the first turn only, as ordinary multi-turn data has it: the
               first reply obeys it, the later ones are plain; loss on every reply;
  (b) gatt     the replies made with the instruction attached to every user message (all obey),
               then tbp prepare --ghost-attention: the instruction kept only at the start, the
               loss on the last reply;
  (c) nomask   the same data as (b), the loss on every reply.

Each is trained with the same recipe and seed, then talks with 200 held-out dialogues of 7
turns (greedy, tbp.conversation, the KV cache kept across turns); the table gives the share of
replies at each turn that keep the instruction, and that name the right colour.

    python benchmarks/ghost_attention.py --seeds 1
"""
import argparse
import json
import random
import time
from pathlib import Path

from runner import tbp

import numpy as np

THINGS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow", "blood": "red",
          "sea": "blue", "leaf": "green", "milk": "white", "night": "black", "lemon": "yellow", "rose": "red",
          "plum": "purple", "rust": "brown", "ash": "grey", "gold": "yellow"}
NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Fay")
TURNS = 7


def instruction(rng):
    """(system text, rule applied to a plain reply, checker) or None for no instruction."""
    kind = rng.choice(["upper", "bang", "name", "none"])
    if kind == "upper":
        return "Reply in upper case.", str.upper, lambda r: any(c.isalpha() for c in r) and r == r.upper()
    if kind == "bang":
        return "End each reply with !", lambda r: r + "!", lambda r: r.endswith("!")
    if kind == "name":
        name = rng.choice(NAMES)
        return f"Start each reply with {name}:", lambda r, n=name: f"{n}: {r}", \
            lambda r, n=name: r.startswith(f"{n}: ")
    return None


def dialogue(rng, turns):
    inst = instruction(rng)
    things = [rng.choice(list(THINGS)) for _ in range(turns)]
    return inst, [(f"{t}?", f"{t} is {THINGS[t]}") for t in things]


def variant(inst, qa, which):
    """The messages of one training dialogue in variant (a) plain or (b/c) Ghost Attention."""
    if inst is None:
        return [m for q, a in qa for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    text, rule, _ = inst
    msgs = [{"role": "system", "content": text}]
    for k, (q, a) in enumerate(qa):
        if which == "plain":          # the instruction was seen for the first reply only
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": rule(a) if k == 0 else a}]
        else:                         # replies made with the instruction attached to every message
            msgs += [{"role": "user", "content": f"{q} {text}"}, {"role": "assistant", "content": rule(a)}]
    return msgs



def evaluate(run, held_out):
    from tbp import checkpoint
    from tbp.conversation import Conversation
    from tbp.generate import Sampling
    model, tok, _ = checkpoint.load_model(run)
    keep = np.zeros(TURNS)
    right = np.zeros(TURNS)
    for inst, qa in held_out:
        talk = Conversation(model, tok, inst[0], Sampling(temperature=0), np.random.default_rng(0), 64)
        for k, (q, a) in enumerate(qa):
            reply = "".join(talk.reply(q))
            keep[k] += inst[2](reply)
            right[k] += a.split()[-1] in reply.lower()
    return keep / len(held_out), right / len(held_out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--dialogues", type=int, default=6000)
    ap.add_argument("--held-out", type=int, default=200)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--work", default="bench-gatt")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train = [dialogue(rng, rng.randint(1, TURNS)) for _ in range(args.dialogues)]
    held_out = []
    while len(held_out) < args.held_out:
        inst, qa = dialogue(rng, TURNS)
        if inst is not None:
            held_out.append((inst, qa))
    files = {}
    for which in ("plain", "gatt"):
        files[which] = work / f"{which}.jsonl"
        with open(files[which], "w") as f:
            for inst, qa in train:
                f.write(json.dumps({"messages": variant(inst, qa, which)}) + "\n")
    sets = {"(a) plain": (files["plain"], []), "(b) gatt": (files["gatt"], ["--ghost-attention"]),
            "(c) nomask": (files["gatt"], ["--ghost-attention", "--loss", "assistant"])}
    results = {}
    for seed in args.seeds:
        for name, (path, flags) in sets.items():
            data = work / f"data-{name[1]}"
            tbp("prepare", "--format", "chat", "--data", path, "--out", data, "--force", "--val-fraction", "0.05",
                *flags)
            meta = json.loads((data / "meta.json").read_text())
            run = work / f"run-{name[1]}-{seed}"
            t0 = time.perf_counter()
            tbp("train", "--data", data, "--out", run, "--force", "--seed", seed, "--max-iters", args.iters,
                "--n-ctx", meta["max_example_tokens"] - 1, "--n-layer", 4, "--n-head", 4, "--d-model", 64,
                "--batch-size", 16, "--lr", "2e-3", "--min-lr", "2e-4", "--eval-interval", 500, "-q")
            keep, right = evaluate(run, held_out)
            results[(name, seed)] = keep, right
            print(json.dumps({"variant": name, "seed": seed, "train_s": round(time.perf_counter() - t0, 1),
                              "keeps_instruction": keep.round(3).tolist(), "right_colour": right.round(3).tolist()}),
                  flush=True)
    print(f"\nshare of replies that keep the instruction, by turn ({args.held_out} held-out dialogues, greedy)")
    print(f"{'variant':<12}{'seed':>5}" + "".join(f"{k:>7}" for k in range(1, TURNS + 1)) + "   right colour")
    for (name, seed), (keep, right) in results.items():
        print(f"{name:<12}{seed:>5}" + "".join(f"{100 * x:>6.0f}%" for x in keep) + f"   {100 * right.mean():.0f}%")


if __name__ == "__main__":
    main()
