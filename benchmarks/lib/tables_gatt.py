"""The Ghost Attention tables of the documentation, from their records (report.py runs them):
the share of replies that keep the instruction by stretch of turns, the paired differences
between the arms, and the attention mass on the system message by turn."""
import records
import stats

NAMES = {"consistent": "consistent data, loss on every reply", "gatt": "Ghost Attention, original replies as context",
         "nomask": "the same data, no mask", "sampled": "Ghost Attention, every reply sampled"}
TESTS = {"seen": "instructions of trained kinds", "unseen": "upper case + a name (never trained)",
         "none": "no instruction (replies stay plain)"}
STRETCHES = {"turn 1": (1, 1), "turns 2–7": (2, 7), "turns 8–14": (8, 14), "turns 15–20": (15, 20)}


def _rate(r: dict, first: int, last: int, key: str = "kept") -> float:
    """The share of replies in turns first..last (1-based) counted under key: "kept" (the
    instruction kept) or "right" (the right colour named)."""
    return sum(r[key][first - 1:last]) / (r["dialogues"] * (last - first + 1))


def _budget(r: dict) -> str:
    """The training an arm had: its steps, after the pretraining its fine-tuning started from."""
    if "pretrain_iters" in r:
        return (f"Each arm fine-tuned {r['iters']:,} steps from the same model, pretrained {r['pretrain_iters']:,} "
                f"steps on the dialogues with every instruction taken out (one per seed).")
    return f"{r['iters']:,} training steps per arm."


def _one_budget(rows: list[dict]) -> list[dict]:
    """The records at the newest record's budget (its steps, and its pretraining's where it had
    one): runs at other budgets are other experiments, not more seeds."""
    if not rows:
        return rows
    budget = lambda r: (r["iters"], r.get("pretrain_iters"))
    return [r for r in rows if budget(r) == budget(rows[-1])]


def _cell(values: list[float]) -> str:
    m, h = stats.mean_ci(values)
    return f"{100 * m:.1f} %" + ("" if h != h else f" ± {100 * h:.1f}")


def keeps(rows: list[dict]) -> str:
    """Per test and arm: the mean over seeds of the share of replies that keep the instruction
    in each stretch of turns (t intervals over the seeds), and the share naming the right colour."""
    talk = _one_budget([r for r in rows if r["test"] in TESTS])
    out = ["| test | arm | seeds | " + " | ".join(STRETCHES) + " | right colour |",
           "| --- | --- | ---: |" + " ---: |" * len(STRETCHES) + " ---: |"]
    for test, what in TESTS.items():
        for arm, name in NAMES.items():
            got = [r for r in talk if r["test"] == test and r["arm"] == arm]
            if not got:
                continue
            turns = got[0]["test_turns"]
            cells = [_cell([_rate(r, a, b) for r in got]) for a, b in STRETCHES.values()]
            right = _cell([_rate(r, 1, turns, "right") for r in got])
            out.append(f"| {what} | {name} | {len(got)} | " + " | ".join(cells) + f" | {right} |")
    r0 = talk[0]
    out += ["", f"Share of replies that keep every constraint of the instruction (for no instruction: that keep "
                f"none), greedy, {r0['dialogues']} held-out dialogues of {r0['test_turns']} turns per test and seed "
                f"(half as many with no instruction); training dialogues had 1–{r0['train_turns']} turns. ± is a 95 % "
                f"t interval over the seeds. {_budget(r0)} {records.provenance(talk)}"]
    return "\n".join(out)


def parts(rows: list[dict]) -> str:
    """The unseen combination constraint by constraint: what each arm keeps of its parts."""
    talk = [r for r in rows if r["test"] == "unseen" and "each" in r]
    out = ["| arm | seeds | upper case kept | name in front kept | both |", "| --- | ---: | ---: | ---: | ---: |"]
    for arm, name in NAMES.items():
        got = [r for r in talk if r["arm"] == arm]
        if not got:
            continue
        share = lambda r, c: sum(r["each"][c]) / (r["each_dialogues"][c] * r["test_turns"])
        cells = [_cell([share(r, c) for r in got]) for c in ("upper", "name")]
        both = _cell([_rate(r, 1, r["test_turns"]) for r in got])
        out.append(f"| {name} | {len(got)} | " + " | ".join(cells) + f" | {both} |")
    out += ["", "The held-out combination (\"Reply in upper case. Start each reply with NAME:\"), each "
                "constraint checked on its own, over all the turns; ± is a 95 % t interval over the seeds."]
    return "\n".join(out)


def paired(rows: list[dict]) -> str:
    """Ghost Attention against each other arm, seed by seed, within and beyond the trained lengths."""
    talk = _one_budget([r for r in rows if r["test"] in ("seen", "unseen")])
    spans = {"turns 1–7 (trained lengths)": (1, 7), "turns 8–20 (beyond)": (8, 20)}
    out = ["| test | Ghost Attention − | " + " | ".join(spans) + " |", "| --- | --- |" + " ---: |" * len(spans)]
    for test in ("seen", "unseen"):
        by_arm = {arm: {r["seed"]: r for r in talk if r["test"] == test and r["arm"] == arm} for arm in NAMES}
        if not by_arm["gatt"]:
            continue
        for other in ("consistent", "nomask", "sampled"):
            if not by_arm[other]:
                continue
            cells = []
            for a, b in spans.values():
                d, h, n = stats.paired({s: _rate(r, a, b) for s, r in by_arm["gatt"].items()},
                                       {s: _rate(r, a, b) for s, r in by_arm[other].items()})
                cells.append("" if n == 0 else f"{100 * d:+.1f}" + (f" ± {100 * h:.1f}" if n > 1 else "") +
                             f" points ({n} seed{'s' if n > 1 else ''})")
            out.append(f"| {TESTS[test]} | {NAMES[other]} | " + " | ".join(cells) + " |")
    out += ["", "Differences in the share of replies that keep the instruction, paired by seed (each arm "
                "trained with the same seed), with 95 % t intervals."]
    return "\n".join(out)


def attention(rows: list[dict]) -> str:
    """The mean attention mass the reply tokens put on the system message, by turn."""
    att = [r for r in rows if r["test"] == "attention"]
    if not att:
        return "(no attention records yet)"
    turns = len(att[0]["system_mass"])
    out = ["| arm | seeds | " + " | ".join(f"turn {k}" for k in range(1, turns + 1)) + " |",
           "| --- | ---: |" + " ---: |" * turns]
    for arm, name in NAMES.items():
        got = [r["system_mass"] for r in att if r["arm"] == arm]
        if got:
            out.append(f"| {name} | {len(got)} | " + " | ".join(f"{sum(c[k] for c in got) / len(got):.3f}"
                                                              for k in range(turns)) + " |")
    out += ["", f"Attention weight summed over the system message's tokens, averaged over a reply's tokens, every "
                f"layer and head, and {att[0]['dialogues']} held-out transcripts (the same obeying text for every "
                f"model, cut to its context), then over the seeds."]
    return "\n".join(out)
