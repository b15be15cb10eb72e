"""Ghost Attention, a fair test: does the method keep a system instruction alive past the
dialogue lengths it was trained on, against a baseline whose data already obeys it?

A synthetic dialogue language whose constraints a program checks. The user names a thing
("sky?"); the plain reply gives its colour ("sky is blue"). A system instruction asks for one
or two of: upper case, a final "!", a name in front ("Ann: ..."); a quarter of the dialogues
have none. Training dialogues have 1..7 turns.

Three arms, the same dialogues, recipe and seed (Touvron et al. 2023, Llama 2, §3.3):

  consistent  the instruction once, in the system message, and every reply obeys it; the loss
              on every reply. Data as good as a perfect annotator's: what differs from (gatt)
              is the method, not the labels.
  gatt        Llama 2's construction: the context dialogue is the original one, its replies
              written without the instruction (plain); the last reply is the teacher's sample
              with the instruction attached to every user message (so it obeys). tbp prepare
              --ghost-attention keeps the instruction at the start only and puts the loss on
              the last reply: the intermediate replies, which do not obey, are context.
  nomask      the same data as (gatt), the loss on every reply (--loss assistant): the
              paper's "mismatch" that the mask is there to avoid.
  sampled     the other reading of the paper: every reply of the context is the teacher's too,
              sampled with the instruction attached (so all obey), then --ghost-attention. Its
              data is (consistent)'s with the loss on the last reply only: what the mask costs.

Each model then holds held-out dialogues of up to 20 turns (about 3x the longest trained),
greedy, with tbp.generate.conversation (the cache kept across turns, refilled from the system message
and the latest turns when the context fills):

  seen     instructions of the kinds trained on;
  unseen   the combination upper case + a name, never in any training dialogue;
  none     no instruction: the replies should stay plain.

``attention`` measures, on the same held-out transcripts for every model, the attention mass
the reply tokens put on the system message, by turn (the analogue of the paper's Figure 10);
``picture`` draws it. One record per (arm, seed, test) and per (arm, seed) attention profile
in benchmarks/results/ghost_attention.jsonl; report.py makes the tables.

``finetune`` is Ghost Attention where Llama 2 uses it, a fine-tuning stage: a model pretrained
(``--iters`` steps) on the same dialogues with every instruction taken out -- plain replies
only -- is fine-tuned (``--ft-iters`` steps, from its weights) on each arm's data, the same
dialogues and recipe for every arm: Ghost Attention against the same data without its mask
(``nomask``, Llama 2's baseline: the instruction once, the loss on every reply) and against
the consistent data. Every dataset of this stage shares the consistent data's tokenizer (it has
every character any arm writes), which fine-tuning requires. Records:
results/ghost_attention_ft.jsonl, the same fields plus ``pretrain_iters``.

    python benchmarks/studies/ghost_attention.py train --seeds 1 2 3
    python benchmarks/studies/ghost_attention.py finetune --seeds 1 2 3
    python benchmarks/studies/ghost_attention.py picture
"""
import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from runner import tbp

THINGS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow", "blood": "red",
          "sea": "blue", "leaf": "green", "milk": "white", "night": "black", "lemon": "yellow", "rose": "red",
          "plum": "purple", "rust": "brown", "ash": "grey", "gold": "yellow"}
NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Fay")
TRAIN_TURNS = 7
TEST_TURNS = 20
ARMS = {"consistent": ("consistent", []), "gatt": ("gatt", ["--ghost-attention"]),
        "nomask": ("gatt", ["--ghost-attention", "--loss", "assistant"]), "sampled": ("sampled", ["--ghost-attention"])}
TESTS = ("seen", "unseen", "none")
SHAPE = ("--n-layer", 4, "--n-head", 4, "--d-model", 64)


# --- the language -----------------------------------------------------------------------------
def text_of(inst: tuple) -> str:
    """The system message of an instruction: a tuple of constraints, "upper", "bang", "name:X"."""
    parts = {"upper": "Reply in upper case.", "bang": "End each reply with !"}
    return " ".join(parts.get(c) or f"Start each reply with {c[5:]}:" for c in inst)


def obey(inst: tuple, reply: str) -> str:
    """The plain reply made to keep every constraint of inst."""
    for c in inst:
        if c == "upper":
            reply = reply.upper()
    if "bang" in inst:
        reply += "!"
    for c in inst:
        if c.startswith("name:"):
            reply = f"{c[5:]}: {reply}"
    return reply


def holds(c: str, inst: tuple, reply: str) -> bool:
    """Whether reply keeps constraint c of inst (upper case is checked after any name in front)."""
    if c.startswith("name:"):
        return reply.startswith(f"{c[5:]}: ")
    if c == "bang":
        return reply.endswith("!")
    body = reply
    for n in inst:
        if n.startswith("name:") and reply.startswith(f"{n[5:]}: "):
            body = reply[len(f"{n[5:]}: "):]
    return any(ch.isalpha() for ch in body) and body == body.upper()


def keeps(inst: tuple, reply: str) -> bool:
    """Whether reply keeps every constraint of inst; with no instruction, whether it keeps none."""
    if not inst:
        return not (holds("bang", (), reply) or holds("upper", (), reply) or ":" in reply)
    return all(holds(c, inst, reply) for c in inst)


def instruction(rng: random.Random, test: str = "train") -> tuple:
    """A training instruction (a quarter none), or a held-out one of test kind."""
    name = f"name:{rng.choice(NAMES)}"
    if test == "unseen":
        return ("upper", name)
    if test == "none":
        return ()
    kinds = [("upper",), ("bang",), (name,), ("upper", "bang"), ("bang", name)]
    if test == "train" and rng.random() < 0.25:
        return ()
    return rng.choice(kinds)


def dialogue(rng: random.Random, turns: int, test: str = "train") -> tuple[tuple, list]:
    inst = instruction(rng, test)
    things = [rng.choice(list(THINGS)) for _ in range(turns)]
    return inst, [(f"{t}?", f"{t} is {THINGS[t]}") for t in things]


def messages(inst: tuple, qa: list, arm: str) -> list[dict]:
    """One training dialogue as the arm's data has it (before tbp prepare)."""
    if not inst:
        return [m for q, a in qa for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    text = text_of(inst)
    out = [{"role": "system", "content": text}]
    for k, (q, a) in enumerate(qa):
        if arm == "consistent":
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": obey(inst, a)}]
        elif arm == "sampled":    # every reply the teacher's, made with the instruction attached
            out += [{"role": "user", "content": f"{q} {text}"}, {"role": "assistant", "content": obey(inst, a)}]
        else:   # the original dialogue, then the teacher's last reply with the instruction attached
            last = k == len(qa) - 1
            out += [{"role": "user", "content": f"{q} {text}"},
                    {"role": "assistant", "content": obey(inst, a) if last else a}]
    return out


def held_out(n: int) -> dict[str, list]:
    rng = random.Random(12345)                    # another stream than the training draw (seed 0)
    return {test: [dialogue(rng, TEST_TURNS, test) for _ in range(n if test != "none" else n // 2)]
            for test in TESTS}


# --- the phases -------------------------------------------------------------------------------
def prepare(args) -> dict[str, Path]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train = [dialogue(rng, rng.randint(1, TRAIN_TURNS)) for _ in range(args.dialogues)]
    out = {}
    for arm, (source, flags) in ARMS.items():
        path = work / f"{source}.jsonl"
        if not path.exists():
            with open(path, "w", encoding="utf-8") as f:
                for inst, qa in train:
                    f.write(json.dumps({"messages": messages(inst, qa, source)}) + "\n")
        out[arm] = work / f"data-{arm}"
        if not (out[arm] / "meta.json").exists():
            tbp("prepare", "--format", "chat", "--data", path, "--out", out[arm], "--force",
                "--val-fraction", "0.05", *flags)
    return out


def converse(run: Path, dialogues: list) -> dict:
    """Held-out dialogues, greedy, TEST_TURNS turns each: per turn, how many replies keep the
    instruction and how many name the right colour."""
    from tbp.runs import disk
    from tbp.generate.conversation import Conversation
    from tbp.generate.sampling import Sampling
    model, tok, _ = disk.load_model(run)
    kept, right, refills = np.zeros(TEST_TURNS, int), np.zeros(TEST_TURNS, int), 0
    each, having = {}, {}                  # per kind of constraint: replies that keep it, dialogues that ask it
    for inst, qa in dialogues:
        talk = Conversation(model, tok, text_of(inst) or None, Sampling(temperature=0), np.random.default_rng(0), 32)
        for c in inst:
            having[c.split(":")[0]] = having.get(c.split(":")[0], 0) + 1
        for k, (q, a) in enumerate(qa):
            reply = "".join(talk.reply(q))
            kept[k] += keeps(inst, reply)
            right[k] += a.split()[-1] in reply.lower()
            for c in inst:
                each.setdefault(c.split(":")[0], np.zeros(TEST_TURNS, int))[k] += holds(c, inst, reply)
        refills += talk.refills
    return {"kept": kept.tolist(), "right": right.tolist(), "dialogues": len(dialogues), "refills": refills,
            "each": {c: v.tolist() for c, v in each.items()}, "each_dialogues": having}


def system_mass(run: Path, dialogues: list) -> list[float]:
    """Mean attention mass the reply tokens put on the system message's tokens, by turn, over
    layers and heads, on the consistent transcripts of dialogues cut to the model's context."""
    from tbp.look import inside
    from tbp.runs import disk
    from tbp.data.chat import render
    model, tok, _ = disk.load_model(run)
    n_ctx = model.config.n_ctx
    total, count = np.zeros(TRAIN_TURNS), np.zeros(TRAIN_TURNS)
    for inst, qa in dialogues:
        msgs = messages(inst, qa, "consistent")
        ends = [len(render(tok, msgs[:i + 1], "all")[0]) for i in range(len(msgs))]
        msgs = msgs[:max(i + 1 for i, e in enumerate(ends) if e <= n_ctx)]
        ids = render(tok, msgs, "all")[0].tolist()
        weights = inside.self_attention(model, ids)          # each (H, T, T)
        w = np.mean([lw.mean(axis=0) for lw in weights], axis=0)  # (T, T): mean over layers, heads
        system = ends[0]
        for turn in range(min(TRAIN_TURNS, (len(msgs) - 1) // 2)):
            start, end = ends[2 * turn + 1], ends[2 * turn + 2]    # the reply's tokens
            total[turn] += w[start:end, :system].sum(axis=1).mean()
            count[turn] += 1
    return (total / np.maximum(count, 1)).tolist()


def train(args) -> None:
    data = prepare(args)
    n_ctx = max(json.loads((d / "meta.json").read_text())["max_example_tokens"] for d in data.values()) - 1
    tests = held_out(args.held_out)
    done = {(r["arm"], r["seed"], r["test"]) for r in records.read("ghost_attention")}
    for seed in args.seeds:
        for arm in args.arms:
            if all((arm, seed, t) in done for t in (*TESTS, "attention")):
                continue
            run = Path(args.work) / f"run-{arm}-{seed}"
            if not _trained(run, args.iters):
                tbp("train", "--data", data[arm], "--out", run, "--force", "--seed", seed, "--threads", 1,
                    "--max-iters", args.iters, "--n-ctx", n_ctx, *SHAPE, "--batch-size", 16, "--lr", "2e-3",
                    "--min-lr", "2e-4", "--eval-interval", 500, "-q")
            cfg = json.loads((run / "config.json").read_text())
            state = json.loads((run / "state.json").read_text())
            base = {"arm": arm, "seed": seed, "commit": records.commit(), "n_layer": cfg["model"]["n_layer"],
                    "config": cfg, "iters": args.iters, "train_dialogues": args.dialogues, "train_turns": TRAIN_TURNS,
                    "test_turns": TEST_TURNS, "train_s": round(state["elapsed_s"], 1), "threads": 1}
            _evaluate("ghost_attention", run, base, tests, done, arm, seed)
            print(f"{arm} seed {seed} done", flush=True)


def _prepared(source: Path, out: Path, tokenizer_from: Path, flags: list) -> Path:
    """``source`` (chat JSON lines) prepared into ``out`` with ``tokenizer_from``'s tokenizer."""
    if not (out / "meta.json").exists():
        tbp("prepare", "--format", "chat", "--data", source, "--out", out, "--force", "--val-fraction", "0.05",
            "--tokenizer-from", tokenizer_from, *flags)
    return out


def _evaluate(name: str, run: Path, base: dict, tests: dict, done: set, arm: str, seed: int) -> None:
    """The held-out tests and the attention profile of one trained model, as records ``name``."""
    for test in TESTS:
        if (arm, seed, test) not in done:
            records.append(name, {**base, "test": test, **converse(run, tests[test])})
    if (arm, seed, "attention") not in done:
        records.append(name, {**base, "test": "attention", "dialogues": len(tests["seen"]),
                              "system_mass": system_mass(run, tests["seen"])})


def _trained(run: Path, steps: int) -> bool:
    return (run / "state.json").exists() and json.loads((run / "state.json").read_text())["step"] >= steps


def finetune(args) -> None:
    """Pretrain on plain dialogues, then fine-tune a copy per arm; the tests as in ``train``."""
    data = prepare(args)
    work = Path(args.work)
    shared = data["consistent"]                   # its tokenizer writes every arm's characters
    rng = random.Random(0)                        # the training dialogues of ``prepare``, drawn again
    dialogues = [dialogue(rng, rng.randint(1, TRAIN_TURNS)) for _ in range(args.dialogues)]
    plain = work / "plain.jsonl"
    if not plain.exists():
        with open(plain, "w", encoding="utf-8") as f:
            for _, qa in dialogues:
                f.write(json.dumps({"messages": messages((), qa, "consistent")}) + "\n")
    base_data = _prepared(plain, work / "ft-data-plain", shared, [])
    # every arm's data, whichever --arms this call runs: the pretrained model's context must fit them all
    ft_data = {arm: _prepared(work / f"{source}.jsonl", work / f"ft-data-{arm}", shared, flags)
               for arm, (source, flags) in ARMS.items()}
    n_ctx = max(json.loads((d / "meta.json").read_text())["max_example_tokens"]
                for d in (base_data, *ft_data.values())) - 1
    tests = held_out(args.held_out)
    # a run is its arm, seed and budgets: a stage at other budgets (or another context) is another run
    done = {(r["arm"], r["seed"], r["test"]) for r in records.read("ghost_attention_ft")
            if (r["iters"], r["pretrain_iters"], r["config"]["model"]["n_ctx"]) == (args.ft_iters, args.iters, n_ctx)}
    for seed in args.seeds:
        pre = work / f"pretrained-{seed}-n{args.iters}-ctx{n_ctx}"       # the budgets in the names: no stale reuse
        for arm in args.arms:
            if all((arm, seed, t) in done for t in (*TESTS, "attention")):
                continue
            if not _trained(pre, args.iters):
                tbp("train", "--data", base_data, "--out", pre, "--force", "--seed", seed, "--threads", 1,
                    "--max-iters", args.iters, "--n-ctx", n_ctx, *SHAPE, "--batch-size", 16, "--lr", "2e-3",
                    "--min-lr", "2e-4", "--eval-interval", 500, "-q")
            run = work / f"ft-{arm}-{seed}-n{args.ft_iters}-from{args.iters}-ctx{n_ctx}"
            if not _trained(run, args.ft_iters):
                tbp("train", "--init-from", pre, "--data", ft_data[arm], "--out", run, "--force", "--seed", seed,
                    "--threads", 1, "--max-iters", args.ft_iters, "--batch-size", 16, "--lr", "1e-3",
                    "--min-lr", "1e-4", "--eval-interval", 250, "-q")
            cfg = json.loads((run / "config.json").read_text())
            state = json.loads((run / "state.json").read_text())
            base = {"arm": arm, "seed": seed, "commit": records.commit(), "n_layer": cfg["model"]["n_layer"],
                    "config": cfg, "iters": args.ft_iters,
                    "pretrain_iters": json.loads((pre / "state.json").read_text())["step"],
                    "train_dialogues": args.dialogues, "train_turns": TRAIN_TURNS, "test_turns": TEST_TURNS,
                    "train_s": round(state["elapsed_s"], 1), "threads": 1}
            _evaluate("ghost_attention_ft", run, base, tests, done, arm, seed)
            print(f"fine-tuned {arm} seed {seed} done", flush=True)


def picture(args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in records.read("ghost_attention") if r["test"] == "attention"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm, colour in zip(ARMS, ("black", "tab:blue", "tab:orange", "tab:green")):
        curves = np.array([r["system_mass"] for r in rows if r["arm"] == arm])
        if len(curves):
            turns = np.arange(1, curves.shape[1] + 1)
            ax.plot(turns, curves.mean(axis=0), "-o", color=colour, markersize=4,
                    label=f"{arm} ({len(curves)} seeds)")
            if len(curves) > 1:
                ax.fill_between(turns, curves.min(axis=0), curves.max(axis=0), color=colour, alpha=0.15)
    ax.set_xlabel("turn (the reply's tokens as queries)")
    ax.set_ylabel("attention mass on the system message")
    ax.set_title("Where the replies look: mean over layers, heads and held-out dialogues", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(args.picture)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phases", nargs="+", choices=["train", "finetune", "picture"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--dialogues", type=int, default=6000)
    ap.add_argument("--held-out", type=int, default=100, help="dialogues per test (none: half)")
    ap.add_argument("--iters", type=int, default=2000, help="training steps (finetune: of the pretraining)")
    ap.add_argument("--ft-iters", type=int, default=500, help="finetune: steps of each arm's fine-tuning")
    ap.add_argument("--work", default="bench-gatt")
    ap.add_argument("--picture", default=str(Path(__file__).resolve().parents[2] / "docs/images/ghost_attention.png"))
    args = ap.parse_args()
    records.pin_gemm()
    for phase in args.phases:
        {"train": train, "finetune": finetune, "picture": picture}[phase](args)


if __name__ == "__main__":
    main()
