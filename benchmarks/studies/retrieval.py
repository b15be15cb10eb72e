"""Long-range retrieval under sparse decoding: free-running exact match, dense against each rule.

The task. A line is a *haystack* -- filler characters with ``facts`` facts scattered through
it -- then ``|``, then questions. No key is told twice in a line. A question is a told key
followed by its value. Questions are drawn with replacement, so none can be answered by
elimination, and the last question's key is one never asked before in the line: only its fact,
in the haystack, says the answer. Two ways to write a fact (``--form``):

- ``record``: a key is two letters from ``a``-``f`` (36 keys) and a fact one *record*
  character standing for a key and its value (one of 16 capitals; 576 record characters). The
  second letter alone narrows a key to six, so the whole lookup needs both letters and a layer
  after the first; but the first layer can already match one letter (``readers``).
- ``pair``: a key is one character (36) and a fact that character followed by its value, as in
  associative recall: a key's position holds nothing of its value, so no first layer can
  retrieve anything -- the lookup is an induction (a later layer matches the key that
  *precedes* a value).

The filler is uniform (``--uniform-filler``) or a second-order Markov chain with a small share
of the loss, so that a previous-character head pays from the start.

Training (``train``): a rotary GPT learns the task from freshly generated lines (none is seen
twice; the held-out lines come from another seed), in stages of growing context, up to the
measured length; the loss is on the questions' values (and the Markov filler). The checkpoint
is an ordinary tbp run (``tbp generate`` reads it), and a record of the training (config,
seed, form, stages, wall time, teacher-forced accuracy on held-out lines and the training
loss every 100 steps, per stage) goes to
benchmarks/results/retrieval_train.jsonl.

The measurement (``eval``): for each held-out line of ``--length`` characters, the prompt is
everything up to and including the last question's key; its fact lies at least the question
section's length back (768 tokens at n = 2,048 for records, 512 for pairs), beyond every
budget's window. The prompt
without its last character is prefilled densely once; then, for dense decoding and for each
rule x budget, that character and the answer are decoded one token at a time under the rule
(greedy), and the generated answer is compared with the fact's value. One record per rule x
budget in benchmarks/results/retrieval.jsonl, with the number of held-out ``sequences``, the
hits, Wilson's 95 % interval, which lines it got right (``hit_lines``, so that a rule is
compared with dense on the same lines) and what readers of part of the key would get
(``readers``); the dense record of a pair-form model also says where each layer's scores put
the fact (``fact_ranks``): a score-chosen set can keep it only where its layer ranks it high.

    # the recipe that learned the pair-form lookup (2 seeds of 5), about 35 minutes on one core:
    python benchmarks/studies/retrieval.py train --out runs/retrieval --form pair --steps 12000 2000 600 400 --lr-scale 2 --seed 2
    python benchmarks/studies/retrieval.py eval --run runs/retrieval --layers 0

    # the same recipe at 4 layers, where selection can sit after the first lookup-capable layer;
    # a seed whose first stage ends under 50 % held-out accuracy stops there (its record says so)
    python benchmarks/studies/retrieval.py train --out runs/retrieval-4L-1 --n-layer 4 --form pair --steps 12000 2000 600 400 --lr-scale 2 --seed 1 --give-up-below 0.5
    python benchmarks/studies/retrieval.py eval --run runs/retrieval-4L-1 --layers 1 2 1,3

The run is saved after every stage; one stopped during stage k goes on from the end of stage
k - 1 with ``--init-from RUN --first k --force`` (the same other options; a fresh optimizer).
A stage can be repeated the same way (``--first`` at or before the stages already trained):
the record lists every start of a stage, each on lines never drawn before.

    # the 4-layer seeds left on the plateau after 12,000 steps, given 12,000 more of stage 1
    python benchmarks/studies/retrieval.py train --out runs/retrieval-4L-2 --init-from runs/retrieval-4L-2 --first 1 --force --n-layer 4 --form pair --steps 12000 2000 600 400 --lr-scale 2 --seed 2 --give-up-below 0.5
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from stats import binomial_ci
from tbp import GPT, ModelConfig
from tbp.runs import commit, disk
from tbp.nn.designs.sparse.sparse import SELECTIONS, SparseRule
from tbp.train.optim import AdamW, clip_grads
from tbp.data.tokenizer import train_char
from tbp.nn.decode import Inference

LETTERS = "abcdef"                                     # a key is two of these
VALUES = "ABCDEFGHIJKLMNOP"
FILLER = "".join(chr(0x3B1 + i) for i in range(24))   # Greek small letters
RECORDS = "".join(chr(0x4E00 + i) for i in range(len(LETTERS) ** 2 * len(VALUES)))
SEP = "|"
KEYCHARS = "".join(chr(0x410 + i) for i in range(len(LETTERS) ** 2))   # form "pair": a key is one character
ALPHABET = SEP + LETTERS + VALUES + FILLER + RECORDS + KEYCHARS
FORMS = ("record", "pair")
KEYS = len(LETTERS) ** 2
ANSWER = 1                                             # characters in an answer
# The filler is text of a second-order Markov chain: after two filler letters, one of two
# letters fixed for that pair follows. A model that predicts it needs the previous letter at
# the current position -- the same move a question's second letter needs from its first
FOLLOW = np.random.default_rng(7).integers(0, len(FILLER), (len(FILLER), len(FILLER), 2))
FILLER_WEIGHT = 0.2                                    # the filler's share of the loss, per character
HELDOUT_SEED = 1_000_003
# (context, records in the haystack, questions per line (None: a line's length / 8), steps,
# lines per step, peak learning rate): first short lines of little but records and questions,
# where the lookup is found quickly (many answers per line, every record's embedding trained
# often), then the measured format, growing up to the measured length so that every distance
# has been seen
STAGES = ((96, 8, 18, 2000, 24, 3e-3), (128, 16, None, 5000, 16, 3e-3), (512, 24, None, 600, 8, 2e-3),
          (2048, 32, None, 400, 2, 1e-3))
ROPE_BASE = 1e6     # rotary frequencies slow enough that a key's match survives 2,048 positions


def questions(length: int, asks: int | None = None) -> int:
    """Questions in a line of ``length`` characters: ``asks``, by default one per 8 characters."""
    return asks or max(2, length // 8)


def filler(rng: np.random.Generator, count: int, markov: bool = True) -> list[str]:
    """``count`` filler letters: the Markov chain of FOLLOW (markov) or uniform."""
    if not markov:
        return list(rng.choice(list(FILLER), count))
    ids = list(rng.integers(0, len(FILLER), 2))
    coins = rng.integers(0, 2, count)
    for i in range(2, count):
        ids.append(FOLLOW[ids[-2], ids[-1], coins[i]])
    return [FILLER[i] for i in ids[:count]]


def _asked(rng: np.random.Generator, facts: int, asks: int) -> list[int]:
    """The facts a line's questions ask: ``asks - 1`` drawn with replacement from all but one,
    then that one (a fresh last key)."""
    last = rng.integers(facts)
    return [*rng.choice(np.delete(np.arange(facts), last), asks - 1), last]


def line(rng: np.random.Generator, length: int, facts: int, asks: int | None = None, markov: bool = True,
         form: str = "record") -> str:
    """One line of ``length`` characters: haystack, ``|``, ``questions(length, asks)``
    questions, the last one's key fresh. ``markov``: the filler follows FOLLOW (else uniform).
    ``form``: "record", a fact is one record character and a key two letters; "pair", a fact is
    a key character followed by its value, and a question the same two characters."""
    asks = questions(length, asks)
    if form == "pair":
        return _pair_line(rng, length, facts, asks, markov)
    hay = length - 1 - 3 * asks
    if not 2 <= facts <= min(KEYS, hay):       # 2: the last key must be one never asked before
        raise ValueError(f"{facts} facts do not fit a haystack of {hay} among {KEYS} keys")
    keys = rng.choice(KEYS, facts, replace=False)
    values = rng.integers(0, len(VALUES), facts)
    text = np.array(filler(rng, hay, markov))
    text[np.sort(rng.choice(hay, facts, replace=False))] = [RECORDS[k * len(VALUES) + v] for k, v in zip(keys, values)]
    asked = _asked(rng, facts, asks)
    q = "".join(LETTERS[keys[i] // len(LETTERS)] + LETTERS[keys[i] % len(LETTERS)] + VALUES[values[i]]
                for i in asked)
    return "".join(text) + SEP + q


def _pair_line(rng: np.random.Generator, length: int, facts: int, asks: int, markov: bool) -> str:
    hay = length - 1 - 2 * asks
    if not 2 <= facts <= min(KEYS, hay // 2):
        raise ValueError(f"{facts} facts do not fit a haystack of {hay} among {KEYS} keys")
    keys = rng.choice(KEYS, facts, replace=False)
    values = rng.integers(0, len(VALUES), facts)
    text = np.array(filler(rng, hay, markov))
    at = 2 * np.sort(rng.choice(hay // 2, facts, replace=False))           # non-overlapping pairs
    text[at], text[at + 1] = [KEYCHARS[k] for k in keys], [VALUES[v] for v in values]
    asked = _asked(rng, facts, asks)
    return "".join(text) + SEP + "".join(KEYCHARS[keys[i]] + VALUES[values[i]] for i in asked)


def answer_weights(rows: np.ndarray, tok, filler_weight: float = 0.0) -> np.ndarray:
    """(B, T) 1 where the next character is a question's value,
    ``filler_weight`` where it is a filler letter after two filler letters (predictable, one of
    two), 0 elsewhere; for rows (B, T + 1) of ids."""
    asked = np.cumsum(rows[:, :-1] == tok.encode(SEP)[0], axis=1) > 0      # the questions (a pair's value
    w = (np.isin(rows[:, 1:], tok.encode(VALUES)) & asked).astype(np.float32)   # also stands in the haystack)
    if filler_weight:
        f = np.isin(rows, tok.encode(FILLER))
        w[:, 1:][f[:, :-2] & f[:, 1:-1] & f[:, 2:]] = filler_weight
    return w


def tokenizer():
    return train_char(ALPHABET)


def heldout(tok, count: int, length: int, facts: int, asks: int | None = None, markov: bool = True,
            form: str = "record") -> np.ndarray:
    rng = np.random.default_rng(HELDOUT_SEED)
    return np.array([tok.encode(line(rng, length, facts, asks, markov, form)) for _ in range(count)])


def teacher_forced(model, rows: np.ndarray, tok, batch: int = 8) -> float:
    """Share of held-out question values whose top prediction is right (inputs rows[:, :-1])."""
    right = total = 0
    for b0 in range(0, len(rows), batch):
        r = rows[b0:b0 + batch]
        w = answer_weights(r, tok)
        pred = model.forward(r[:, :-1]).argmax(-1)
        right += int(((pred == r[:, 1:]) * w).sum())
        total += int(w.sum())
    return right / total


def train(args) -> None:
    tok = tokenizer()
    steps_of = args.steps or [st[3] for st in STAGES]
    if len(steps_of) != len(STAGES):
        raise SystemExit(f"--steps takes one count per stage ({len(STAGES)})")
    stages = [(T, facts, asks, n, lines, lr * args.lr_scale)
              for (T, facts, asks, _, lines, lr), n in zip(STAGES, steps_of)][args.first - 1:args.stages]
    if Path(args.out).exists() and not args.force:           # say so now, not after the first stage
        raise SystemExit(f"{args.out} already exists (use --force to replace it)")
    if not stages:
        raise SystemExit(f"no stage to train: --first {args.first} is past --stages {args.stages}")
    log, step, wall = [], 0, 0.0
    if args.init_from:                       # go on from a run of this study: its stages come first
        model, _, prior = disk.load_model(args.init_from, dtype=np.float32)
        cfg, log = model.config, prior["study"]["stages"]
        step, wall = sum(s["steps"] for s in log), log[-1]["wall_s"]
    else:
        cfg = ModelConfig.from_dict(dict(vocab_size=tok.vocab_size, n_ctx=STAGES[-1][0], n_layer=args.n_layer,
                          n_head=args.n_head, d_model=args.d_model, positions="rope", rope_base=ROPE_BASE))
        model = GPT(cfg, seed=args.seed)
    opt = AdamW(model.layout, weight_decay=0.1)
    # fresh lines per start: a run that goes on from its own stages (the next one, or one again)
    # draws from a stream keyed by where it starts and how many stages it goes on from
    rng = np.random.default_rng(args.seed if not log else (args.seed, args.first, len(log)))
    t0 = time.time() - wall
    markov = not args.uniform_filler
    filler_weight = FILLER_WEIGHT if markov else 0.0
    for s, (T, facts, asks, steps, lines, lr) in enumerate(stages):
        check = heldout(tok, 64, T + 1, facts, asks, markov, args.form)
        trace = []                           # the loss every 100 steps: where a lookup is learned
        last = s == len(stages) - 1 and args.stages == len(STAGES)
        for i in range(steps):
            rows = np.array([tok.encode(line(rng, T + 1, facts, asks, markov, args.form)) for _ in range(lines)])
            warm = min(1.0, (i + 1) / 100)
            rate = lr * warm * (1 - 0.9 * i / steps if last else 1.0)  # the last stage anneals to a tenth
            model.zero_grad()
            loss = model.accumulate(rows[:, :-1], rows[:, 1:], weights=answer_weights(rows, tok, filler_weight))
            clip_grads(model.layout.grads, 1.0)
            opt.step(rate)
            step += 1
            if i % 100 == 0:
                trace.append(round(float(loss), 4))
                print(f"context {T} step {step}: loss {loss:.3f} ({time.time() - t0:.0f} s)", flush=True)
        acc = teacher_forced(model, check, tok)
        log.append({"n_ctx": T, "facts": facts, "questions": questions(T + 1, asks), "steps": steps, "lines": lines,
                    "lr": lr, "loss": float(loss), "heldout_accuracy": acc, "wall_s": round(time.time() - t0, 1),
                    "loss_every_100": trace})
        print(f"context {T}: held-out accuracy {acc:.3f} on 64 lines", flush=True)
        gave_up = None
        if args.give_up_below is not None and acc < args.give_up_below and s < len(stages) - 1:
            # the lookup not learned: the 2-layer seeds that had not learned it after stage 1 never did
            gave_up = {"below": args.give_up_below, "after_stage": args.first + s}
            print(f"gave up: held-out accuracy under {args.give_up_below:g}", flush=True)
        # an ordinary run's header; how it was trained is this study's, not tbp train's, so it is
        # kept beside "train" (which stays empty: the run cannot be resumed by tbp train)
        study = {"script": "benchmarks/studies/retrieval.py", "seed": args.seed, "stages": log, "form": args.form,
                 "filler": "markov" if markov else "uniform", "filler_weight": filler_weight,
                 **({"init_from": args.init_from} if args.init_from else {}),
                 **({"gave_up": gave_up} if gave_up else {})}
        record = {"model": cfg.to_dict(), "train": None, "data": None, "lora": None, "base": None,
                  "study": study, "step": step}
        # saved after every stage, so that a run stopped between stages goes on from the last
        # one (--init-from RUN --first NEXT); later saves replace this run's own earlier one
        commit.save_plain(Path(args.out), model, tok, record, force=args.force or s > 0)
        if gave_up:
            break
    records.append("retrieval_train", {"commit": records.commit(), "run": args.out, "n_layer": cfg.n_layer,
                                       "config": cfg.flat(), "steps": step,
                                       "wall_s": round(time.time() - t0, 1), **study})
    print(f"saved {args.out} after {step} steps, {time.time() - t0:.0f} s")


def greedy(dec, first: np.ndarray, steps: int) -> np.ndarray:
    """Decode ``first`` (B,) then ``steps - 1`` greedy tokens; returns the ``steps`` argmaxes (B, steps)."""
    got = np.empty((len(first), steps), dtype=np.int64)
    tok = first
    for s in range(steps):
        tok = dec.forward(tok[:, None], check=False)[:, -1].argmax(-1)
        got[:, s] = tok
    return got


def answers(model, ids: np.ndarray, rules: list, batch: int, log=print) -> list[np.ndarray]:
    """Per rule (None: dense), the ANSWER tokens (S, ANSWER) generated greedily for each line of
    ids (S, L) from its last question's last key letter on. Each batch of lines is prefilled
    densely once, up to that letter; each rule then decodes from there."""
    S, L = ids.shape
    prompt = L - ANSWER                                                   # up to and including the key
    out = [np.empty((S, ANSWER), dtype=np.int64) for _ in rules]
    t = time.time()
    for b0 in range(0, S, batch):
        rows = ids[b0:b0 + batch]
        dec = Inference(model, len(rows))
        dec.forward(rows[:, :prompt - 1])                                 # dense, once
        for i, rule in enumerate(rules):
            dec.rewind(prompt - 1)                                        # back to the prefill
            dec.strategy = rule
            out[i][b0:b0 + len(rows)] = greedy(dec, rows[:, prompt - 1], ANSWER)
        done = b0 + len(rows)
        log(f"{done}/{S} lines, dense {int((out[0][:done] == ids[:done, prompt:]).all(1).sum())} right, "
            f"{time.time() - t:.0f} s")
    return out


def facts_of(text: str) -> dict[int, int]:
    """The facts a line's haystack tells: key -> value (either form)."""
    hay = text.split(SEP)[0]
    told = {}
    for i, c in enumerate(hay):
        if c in RECORDS:
            k, v = divmod(RECORDS.index(c), len(VALUES))
            told[k] = v
        elif c in KEYCHARS:
            told[KEYCHARS.index(c)] = VALUES.index(hay[i + 1])
    return told


def readers(text: str, form: str) -> dict[str, float]:
    """What a reader that does not match the whole key gets right on the line's last question,
    in expectation: "in_context" picks a told fact at random; "second_letter" (form "record")
    picks among the told facts whose key has the asked key's second letter -- what one look
    from the question's last letter alone can narrow the records to."""
    told, answer = facts_of(text), VALUES.index(text[-1])
    out = {"in_context": sum(v == answer for v in told.values()) / len(told)}
    if form == "record":
        second = LETTERS.index(text[-2])
        near = [v for k, v in told.items() if k % len(LETTERS) == second]
        out["second_letter"] = sum(v == answer for v in near) / len(near)
    return out


def fact_ranks(model, ids: np.ndarray, tok, budgets: list[int], lines: int = 64) -> dict:
    """Where each layer's scores put the last question's fact (form "pair"), for the first
    ``lines`` lines of ids (S, L): the rank (0 = best) of the fact's value position -- the
    position an induction reads -- in the last key's attention row, the best over heads. Per
    layer: the median rank and the share of lines where it is within each budget's best. A
    score-chosen set can keep the fact only where some layer ranks it high."""
    ranks = [[] for _ in range(model.config.n_layer)]
    for row in ids[:lines]:
        hay = tok.decode(row).split(SEP)[0]
        value_at = hay.index(tok.decode(row[-2:-1])) + 1                      # the fact's value
        for layer, w in enumerate(model.attention_weights(row[None, :-1])):
            last = w[0, :, -1, :]                                             # (H, T), the last key's row
            ranks[layer].append(int((last > last[:, value_at:value_at + 1]).sum(-1).min()))
    return {"lines": len(ranks[0]), "median": [float(np.median(r)) for r in ranks],
            "within": {str(K): [float(np.mean(np.array(r) < K)) for r in ranks] for K in budgets}}


def evaluate(args) -> None:
    model, tok, cfg = disk.load_model(args.run)
    study = cfg.get("study") or {}
    form = study.get("form", "record")
    ids = heldout(tok, args.sequences, args.length, args.facts, markov=study.get("filler", "uniform") == "markov",
                  form=form)
    S, L = ids.shape
    n = L - 1                                                             # cache length at the answer's step
    budgets = args.budgets or [n // d for d in (64, 32, 16, 8, 4)]
    layer_sets = [tuple(int(x) for x in s.split(",")) for s in args.layers]
    rules = [None] + [SparseRule(kind, K, layers) for layers in layer_sets for K in budgets for kind in SELECTIONS
                      if kind == "lessismore" or layers == layer_sets[0]]
    got = answers(model, ids, rules, args.batch, log=lambda m: print(m, flush=True))
    right = [(g == ids[:, L - ANSWER:]).all(1) for g in got]          # per rule, per line
    hits = [int(r.sum()) for r in right]
    seed = study.get("seed")
    lines = [tok.decode(r) for r in ids]
    per_line = [readers(t, form) for t in lines]
    reference = {k: float(np.mean([r[k] for r in per_line])) for k in per_line[0]}
    print("readers that do not match the whole key: " + ", ".join(f"{k} {v:.3f}" for k, v in reference.items()))
    ranked = fact_ranks(model, ids, tok, budgets) if form == "pair" else None
    if ranked:
        print(f"the fact's rank in each layer's scores (median over {ranked['lines']} lines): {ranked['median']}")
    for rule, hit, line_hits in zip(rules, hits, right):
        lo, hi = binomial_ci(hit, S)
        rec = {"commit": records.commit(), "seed": seed, "run": str(args.run), "n_layer": model.config.n_layer,
               "config": model.config.flat(), "n_cache": n, "facts": args.facts,
               "filler": study.get("filler", "uniform"), "form": form, "kind": rule.kind if rule else "dense",
               "sequences": S, "hits": hit, "exact_match": hit / S, "ci95": [lo, hi], "readers": reference,
               "hit_lines": "".join("01"[int(h)] for h in line_hits)}   # line by line: paired against dense
        if rule is not None:
            rec["budget"], rec["layers"] = rule.budget, list(rule.layers)
        elif ranked:
            rec["fact_ranks"] = ranked
        records.append("retrieval", rec)
        print(f"{rec['kind']:10s} K {rec.get('budget', n):5d} layers {rec.get('layers', '-')}: "
              f"{hit}/{S} = {hit / S:.3f} [{lo:.3f}, {hi:.3f}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--n-layer", type=int, default=2)
    t.add_argument("--n-head", type=int, default=4)
    t.add_argument("--d-model", type=int, default=128)
    t.add_argument("--stages", type=int, default=len(STAGES), help="train up to this stage (1-based)")
    t.add_argument("--first", type=int, default=1, help="the first stage to train (with --init-from)")
    t.add_argument("--init-from", help="a run of this study to go on from (its weights; a fresh optimizer)")
    t.add_argument("--force", action="store_true")
    t.add_argument("--steps", type=int, nargs="+", help="steps of each stage (default: STAGES')")
    t.add_argument("--lr-scale", type=float, default=1.0, help="multiplies every stage's peak learning rate")
    t.add_argument("--uniform-filler", action="store_true", help="uniform filler letters, no loss on them")
    t.add_argument("--form", choices=FORMS, default="record", help="how a fact is written (see line())")
    t.add_argument("--give-up-below", type=float, help="stop after a stage whose held-out accuracy is under this "
                                                          "(the run and its record say so)")
    e = sub.add_parser("eval")
    e.add_argument("--run", required=True)
    e.add_argument("--sequences", type=int, default=512)
    e.add_argument("--length", type=int, default=2049, help="characters per held-out line (the cache: one less)")
    e.add_argument("--facts", type=int, default=STAGES[-1][1], help="records per held-out line")
    e.add_argument("--batch", type=int, default=16)
    e.add_argument("--layers", nargs="+", default=["1"], help="selection-layer sets, each comma-separated")
    e.add_argument("--budgets", type=int, nargs="+", help="default: n/64, n/32, n/16, n/8, n/4")
    a = p.parse_args()
    records.pin_gemm()
    train(a) if a.cmd == "train" else evaluate(a)


if __name__ == "__main__":
    main()
