"""The sparse-decoding tables of the documentation, from their records (report.py runs them):
speed against the cache length, retrieval exact match, and loss on text at a fixed cache."""
import statistics
from pathlib import Path

import records
from stats import mean_ci

RULES = [("window", "window + sinks"), ("topk", "per-head top-k"), ("layer-topk", "per-layer top-k"),
         ("lessismore", "LessIsMore")]
VALUES = 16          # the retrieval study's values (retrieval.VALUES): a guess is right one time in 16


def _newest(rows: list[dict]) -> list[dict]:
    commit = rows[-1]["commit"]
    return [r for r in rows if r["commit"] == commit]


def _columns(rows: list[dict]) -> list[tuple[str, tuple, str]]:
    """(kind, selection layers, heading) of every rule measured: LessIsMore once per layer set,
    the other rules at the set they were measured at (named where it is not the lowest)."""
    sets = sorted({tuple(r["layers"]) for r in rows if r.get("layers")}, key=lambda s: (len(s), s))
    others = sorted({tuple(r["layers"]) for r in rows if r.get("layers") and r["kind"] != "lessismore"},
                    key=lambda s: (len(s), s)) or sets
    named = lambda name: name if others[0] == sets[0] else f"{name}, layers {','.join(map(str, others[0]))}"
    cols = [(kind, others[0], named(name)) for kind, name in RULES if kind != "lessismore"]
    for layers in sets:
        cols.append(("lessismore", layers, f"LessIsMore, layers {','.join(map(str, layers))}"))
    return cols


def latest_points(rows: list[dict]) -> dict[str, list[dict]]:
    """Per machine -- the CPU, and NumPy's BLAS threads where the record names them -- in the
    order each was last measured, the newest record of every point (depth, cache length, rule):
    a sweep that ran across a commit of unrelated files stays whole. A point a CPU has measured
    with its BLAS threads named supersedes that CPU's records of the point that do not name
    them (what they ran beside is not known)."""
    point = lambda r: (r["n_layer"], r["n_ctx"], r["sparse"]["kind"])
    named = {(r["cpu"], point(r)) for r in rows if r.get("blas_threads")}
    by_machine: dict[str, dict] = {}
    for r in rows:
        if not r.get("blas_threads") and (r["cpu"], point(r)) in named:
            continue
        where = machine_of(r)
        points = by_machine.pop(where, {})           # re-inserted: the newest machine last
        points[point(r)] = r
        by_machine[where] = points
    return {where: list(points.values()) for where, points in by_machine.items()}


def machine_of(r: dict) -> str:
    """The CPU a record ran on, with its BLAS threads if it names them."""
    threads = r.get("blas_threads")
    return r["cpu"] + (f", BLAS {threads} thread{'s' * (threads != 1)}" if threads else "")


def sparse_crossover(rows: list[dict]) -> str:
    """Sparse over dense tokens/s (paired in one process) against the cache, per depth and rule,
    on each CPU measured (the newest record of each point)."""
    points = latest_points(rows)
    out = []
    for where, at in points.items():
        out += [f"**{where}**:", "", _crossover_table(at), ""]
    r0 = rows[-1]
    out += [f"One-token steps at the end of a cache of n tokens, K = n/16, selection at layer(s) "
            f"{', '.join(map(str, r0['sparse']['layers']))}; width 128, 4 heads, rotary positions, random weights, "
            f"batch 1; each ratio is sparse over dense tokens/s, the median over {r0['decode_rounds']} rounds of "
            f"{r0['decode_steps']} steps each way, interleaved in one process; dense: the median of its "
            f"three pairings. Commits: "
            f"{', '.join(sorted({r['commit'] for pts in points.values() for r in pts}))}."]
    return "\n".join(out)


def _crossover_table(rows: list[dict]) -> str:
    depths = sorted({r["n_layer"] for r in rows})
    kinds = [("window", "window"), ("lessismore", "LessIsMore"), ("topk", "top-k")]
    at = {(r["n_layer"], r["n_ctx"], r["sparse"]["kind"]): r for r in rows}
    head = "| cache n | K |" + "".join(f" {d} layers: dense | " + " | ".join(k for _, k in kinds) + " |" for d in depths)
    out = [head, "| ---: | ---: |" + " ---: |" * (len(depths) * (len(kinds) + 1))]
    for n in sorted({r["n_ctx"] for r in rows}):
        cells = []
        for d in depths:
            got = [at.get((d, n, k)) for k, _ in kinds]
            dense = [g["decode_dense_tokens_per_s"] for g in got if g]
            cells.append(f"{statistics.median(dense):,.0f} tok/s" if dense else "")
            cells += [f"{g['decode_sparse_speedup']:.2f}×" if g else "" for g in got]
        K = next(r["sparse"]["budget"] for r in rows if r["n_ctx"] == n)
        out.append(f"| {n:,} | {K} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def sparse_repeats(rows: list[dict]) -> str:
    """The newest series of repeated sweeps (``sparse_crossover.py --repeat``) of each depth on
    each CPU: per cache length and rule, the ratio of every sweep and their range -- the drift a
    single sweep hides."""
    serial = [r for r in rows if r.get("series")]
    if not serial:
        return "No repeated sweep recorded yet (`sparse_crossover.py --repeat 3`)."
    out = []
    for cpu, depth in dict.fromkeys((r["cpu"], r["n_layer"]) for r in serial):
        at = [r for r in serial if (r["cpu"], r["n_layer"]) == (cpu, depth)]
        out += _series([r for r in at if r["series"] == at[-1]["series"]])
    return "\n".join(out).rstrip()


def _series(at: list[dict]) -> list[str]:
    """One series' tables (one per depth) and the line that says what was measured, and where."""
    series = at[-1]["series"]
    sweeps = sorted({r["sweep"] for r in at})
    got = {(r["n_layer"], r["n_ctx"], r["sparse"]["kind"], r["sweep"]): r for r in at}
    kinds = [(k, name) for k, name in RULES if any(r["sparse"]["kind"] == k for r in at)]
    out = []
    for depth in sorted({r["n_layer"] for r in at}):
        out += [f"**{at[-1]['cpu']}, {depth} layers**:", "",
                "| cache n | K | dense tok/s | " + " | ".join(n for _, n in kinds) + " |",
                "| ---: | ---: | ---: |" + " ---: |" * len(kinds)]
        for n in sorted({r["n_ctx"] for r in at if r["n_layer"] == depth}):
            dense = [g["decode_dense_tokens_per_s"] for (d, m, _, _), g in got.items() if (d, m) == (depth, n)]
            cells = []
            for kind, _ in kinds:
                ratios = [got[(depth, n, kind, s)]["decode_sparse_speedup"] for s in sweeps
                          if (depth, n, kind, s) in got]
                cells.append(" / ".join(f"{x:.2f}" for x in ratios)
                             + (f" (range {max(ratios) - min(ratios):.2f})" if len(ratios) > 1 else ""))
            K = next(r["sparse"]["budget"] for r in at if r["n_ctx"] == n)
            out.append(f"| {n:,} | {K} | {min(dense):,.0f}–{max(dense):,.0f} | " + " | ".join(cells) + " |")
        out.append("")
    r0 = at[-1]
    out += [f"Sparse over dense tokens/s in each of {len(sweeps)} sweeps run one after another (series "
            f"{series}, sweeps {', '.join(map(str, sweeps))} in order), each ratio the median of "
            f"{r0['decode_rounds']} interleaved rounds of {r0['decode_steps']} steps; K = n/16, selection at "
            f"layer(s) {', '.join(map(str, r0['sparse']['layers']))}; width 128, 4 heads, rotary positions, "
            f"random weights, batch 1; BLAS {r0.get('blas_threads')} thread(s). {records.provenance(at)}", ""]
    return out


def _describe(r: dict) -> str:
    """How a retrieval model's facts were written, and its filler."""
    form = {"record": "a fact is one record character, a key two letters",
            "pair": "a fact is a key character followed by its value"}[r.get("form", "record")]
    filler = {"uniform": "uniform filler, no loss on it",
              "markov": f"Markov filler, {r.get('filler_weight', 0.2):g} of the loss per filler character"}
    return f"{form}; {filler[r.get('filler', 'uniform')]}"


def _evaluations(rows: list[dict]) -> list[tuple[str, list[dict], dict]]:
    """(run, its records at its newest commit, its dense record) of every retrieval model measured."""
    out = []
    for run in dict.fromkeys(r["run"] for r in rows):
        at = _newest([r for r in rows if r["run"] == run])
        out.append((run, at, next(r for r in at if r["kind"] == "dense")))
    return out


def retrieval(rows: list[dict]) -> str:
    """Free-running exact match on held-out retrieval lines, per rule and budget, with Wilson's
    95 % interval, for each model measured (each at its newest commit)."""
    out = []
    for run, at, dense in _evaluations(rows):
        cols = _columns(at)
        cell = lambda r: (f"{100 * r['exact_match']:.1f} % ({100 * r['ci95'][0]:.1f}–{100 * r['ci95'][1]:.1f})"
                          + _against(r, dense))
        c = dense["config"]
        readers = dense.get("readers", {})
        named = {"in_context": "a told fact at random", "second_letter": "a record sharing the second letter"}
        ref = "; ".join(f"{named[k]} {100 * v:.1f} %" for k, v in readers.items())
        ref = f"; readers that match less than the whole key: {ref}" if ref else ""
        ref += _ranks(dense.get("fact_ranks"))
        out += [f"**`{Path(run).name}`** ({_describe(dense)}): {c['n_layer']} × {c['d_model']}, {c['n_head']} "
                f"heads, context {c['n_ctx']}, seed {dense['seed']}; dense decoding: **{cell(dense)}**, "
                f"{dense['sequences']} held-out lines, cache {dense['n_cache']:,} tokens at the last step{ref}; "
                f"commit {dense['commit']}.", "",
                "| budget K | " + " | ".join(name for *_, name in cols) + " |", "| ---: |" + " ---: |" * len(cols)]
        for K in sorted({r["budget"] for r in at if r["kind"] != "dense"}):
            got = {(r["kind"], tuple(r["layers"])): r for r in at if r.get("budget") == K}
            cells = [cell(got[(k, ls)]) if (k, ls) in got else "" for k, ls, _ in cols]
            out.append(f"| {K} (n/{round(dense['n_cache'] / K)}) | " + " | ".join(cells) + " |")
        out.append("")
    out.append(f"Exact match of the generated answer (greedy, free-running from the last question's key on, "
               f"under the rule), in % with Wilson's 95 % interval; where the lines were recorded one by one, "
               f"then Δ, the rule's exact match less dense decoding's on the same lines, in points with a 95 % "
               f"interval over the lines. The readers are expectations over the same lines. "
               f"{records.provenance(rows)}")
    return "\n".join(out)


def retrieval_depth(rows: list[dict]) -> str:
    """Across the retrieval models deeper than two layers (each at its newest evaluation): which
    layer makes the lookup -- the one whose scores rank the fact's value highest in the last key's
    row -- and what LessIsMore keeps when it chooses at each layer set, at the smallest and the
    largest budget, beside dense decoding and the per-layer top-k."""
    deep = [(run, at, dense) for run, at, dense in _evaluations(rows)
            if dense["config"]["n_layer"] > 2 and dense.get("fact_ranks")]
    if not deep:
        return "No retrieval model deeper than two layers measured yet."
    sets = sorted({tuple(r["layers"]) for _, at, _ in deep for r in at if r["kind"] == "lessismore"},
                  key=lambda s: (len(s), s))
    pct = lambda r: f"{100 * r['exact_match']:.1f}"
    out = ["| model | seed | dense | fact's median rank, layer 0, 1, … | lookup layer | "
           + " | ".join(f"LessIsMore, layers {','.join(map(str, s))}" for s in sets) + " | per-layer top-k |",
           "| --- | ---: | ---: | ---: | ---: |" + " ---: |" * (len(sets) + 1)]
    for run, at, dense in deep:
        budgets = sorted({r["budget"] for r in at if r["kind"] != "dense"})
        ends = (budgets[0], budgets[-1])
        got = {(r["kind"], tuple(r["layers"]), r["budget"]): r for r in at if r["kind"] != "dense"}
        span = lambda kind, layers: (" → ".join(pct(got[(kind, layers, K)]) for K in ends) + " %"
                                     if all((kind, layers, K) in got for K in ends) else "")
        medians = dense["fact_ranks"]["median"]
        per_layer = next((layers for kind, layers, _ in got if kind == "layer-topk"), None)
        out.append(f"| `{Path(run).name}` | {dense['seed']} | {pct(dense)} % | "
                   f"{', '.join(f'{m:,.0f}' for m in medians)} | {medians.index(min(medians))} | "
                   + " | ".join(span("lessismore", s) for s in sets) + " | "
                   + (span("layer-topk", per_layer) if per_layer else "") + " |")
    budgets = sorted({r["budget"] for r in deep[0][1] if r["kind"] != "dense"})
    n, (small, large) = deep[0][2]["n_cache"], (budgets[0], budgets[-1])
    chance = lambda K: 100 * (K / n + (1 - K / n) / VALUES)
    out += ["", f"Free-running exact match on {deep[0][2]['sequences']} held-out lines at a cache of {n:,}, at "
                f"K = {small} (n/{n // small}) → {large} (n/{n // large}); the per-table intervals are in the tables "
                f"above. The fact's median rank: where each layer's scores put the fact's value among the {n:,} "
                f"positions (best over heads, {deep[0][2]['fact_ranks']['lines']} lines); the lookup layer ranks it "
                f"highest. A set drawn at random would keep the fact on K/n of the lines and a 1-in-{VALUES} "
                f"guess on the rest: {chance(small):.1f} → {chance(large):.1f} %. {records.provenance([r for _, at, _ in deep for r in at])}"]
    return "\n".join(out)


def _ranks(ranked: dict | None) -> str:
    """"; the fact's value position ...": where each layer's scores put it (retrieval.fact_ranks)."""
    if not ranked:
        return ""
    small, large = min(ranked["within"], key=int), max(ranked["within"], key=int)
    per_layer = [f"layer {i}: median rank {m:,.0f}, within the best {small} on {100 * ranked['within'][small][i]:.0f} % "
                 f"of lines and the best {large} on {100 * ranked['within'][large][i]:.0f} %"
                 for i, m in enumerate(ranked["median"])]
    return (f"; the fact's value among the last key's scores (best over heads, {ranked['lines']} lines): "
            + "; ".join(per_layer))


def _against(r: dict, dense: dict) -> str:
    """"; Δ d ± h": a rule's exact match less dense decoding's, paired line by line, in points."""
    if "hit_lines" not in r or "hit_lines" not in dense or r is dense:
        return ""
    d, h = mean_ci([int(a) - int(b) for a, b in zip(r["hit_lines"], dense["hit_lines"])])
    return f"; Δ {100 * d:+.1f} ± {100 * h:.1f}"


def retrieval_train(rows: list[dict]) -> str:
    """How each retrieval model was trained: its stages, the held-out accuracy after each, the
    wall time. A run that went on from its own checkpoint has a newer record holding every
    stage so far; only that one is shown, and a stage trained again is marked so."""
    out = []
    newest = {r["run"]: r for r in rows}
    for r in newest.values():
        c = r["config"]
        out += [f"**`{Path(r['run']).name}`** ({_describe(r)}): seed {r['seed']}, {c['n_layer']} × {c['d_model']}, "
                f"{c['n_head']} heads, rotary positions (base {c['rope_base']:,.0f}); {r['steps']:,} steps in "
                f"{r['wall_s'] / 60:.0f} minutes; commit {r['commit']}.", "",
                "| stage | context | records | questions | steps | lines per step | peak lr | held-out accuracy "
                "| minutes so far |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        contexts = list(dict.fromkeys(s["n_ctx"] for s in r["stages"]))     # a stage is known by its context
        for i, s in enumerate(r["stages"]):
            again = " (again)" if s["n_ctx"] in (t["n_ctx"] for t in r["stages"][:i]) else ""
            out.append(f"| {contexts.index(s['n_ctx']) + 1}{again} | {s['n_ctx']:,} | {s['facts']} | {s['questions']} | {s['steps']:,} | {s['lines']} | {s['lr']:g} | "
                       f"{100 * s['heldout_accuracy']:.1f} % | {s['wall_s'] / 60:.0f} |")
        if r.get("gave_up"):
            out += ["", f"Stopped after stage {r['gave_up']['after_stage']}: held-out accuracy under "
                       f"{100 * r['gave_up']['below']:.0f} % (`--give-up-below`), the lookup not learned."]
        out.append("")
    out.append(f"Held-out accuracy: the share of every question's value predicted right (teacher-forced, top "
               f"token) on 64 held-out lines of the stage's context. {records.provenance(rows)}")
    return "\n".join(out)


def sparse_text(rows: list[dict]) -> str:
    """Δ loss against dense on held-out text at a fixed cache length, per rule and budget."""
    rows = _newest(rows)
    r0 = rows[0]
    cols = _columns(rows)
    out = ["| budget K | " + " | ".join(name for *_, name in cols) + " |", "| ---: |" + " ---: |" * len(cols)]
    for K in sorted({r["budget"] for r in rows}):
        got = {(r["kind"], tuple(r["layers"])): r for r in rows if r["budget"] == K}
        cells = []
        for k, ls, _ in cols:
            r = got.get((k, ls))
            cells.append(f"{r['delta_loss']:+.3f} ± {(r['ci95'][1] - r['ci95'][0]) / 2:.3f} ({r['top1_agree']:.2f})"
                         if r else "")
        out.append(f"| {K} (n/{round(r0['n_cache'] / K)}) | " + " | ".join(cells) + " |")
    c = r0["config"]
    out += ["", f"Change in loss against dense decoding of the same model (nats per character; dense: "
                f"{r0['dense_loss']:.3f}), over the last {r0['last']} tokens of {r0['windows']} held-out windows of "
                f"{r0['n_cache']:,} tokens, so every prediction reads a cache of {r0['n_cache'] - r0['last'] + 1:,}–"
                f"{r0['n_cache']:,}; ± a 95 % interval over the windows; in brackets, the share of those predictions whose "
                f"top token is dense decoding's. Model: {c['n_layer']} × {c['d_model']}, "
                f"{c['n_head']} heads, rotary positions, context {c['n_ctx']}, trained {r0['step']:,} steps. "
                f"{records.provenance(rows)}"]
    return "\n".join(out)
