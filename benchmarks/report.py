"""Every results table in the README and the documentation, made from the records in
benchmarks/results/.

    python benchmarks/report.py           # rewrite the tables between their markers
    python benchmarks/report.py --check   # exit 1 if a committed table differs from the records

A table lives in README.md or a page under docs/ between ``<!-- report:NAME -->`` and
``<!-- /report:NAME -->``;
TABLES maps NAME to the function that makes it from its records. Nobody types a result
number into a table.
"""
import argparse
import re
import sys
from pathlib import Path

import records

ROOT = Path(__file__).resolve().parents[1]


def pages() -> list[Path]:
    """README.md and every documentation page: wherever a results table may live."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _gb(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB"


def prepare_scale(rows: list[dict]) -> str:
    """tbp prepare at each corpus size: the newest record per (label, size, kind)."""
    newest = {}
    for r in rows:
        newest[(r["label"], r["size"], r["kind"])] = r
    order = {"before": 0, "after": 1}
    keys = sorted(newest, key=lambda k: (order.get(k[0], 2), records_size(k[1]), k[2]))
    out = ["| code | corpus | tokenizer | time | throughput | peak memory | commit |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for k in keys:
        r = newest[k]
        m = r["metrics"]
        if m["exit"] != 0:
            out.append(f"| {r['label']} | {_gb(r['corpus_bytes'])} | {r['kind']} | failed: {m['error']} | | | "
                       f"{r['commit']} |")
            continue
        out.append(f"| {r['label']} | {_gb(r['corpus_bytes'])} | {r['kind']}"
                   f"{' 4,096' if r['kind'] == 'bpe' else ''} | {m['seconds']:.0f} s | {m['mb_per_s']:.1f} MB/s | "
                   f"{_gb(m['peak_rss_bytes'])} | {r['commit']} |")
    cpus = sorted({r["cpu"] for r in rows})
    out.append("")
    out.append(f"CPU: {'; '.join(cpus)}. BPE time includes training the tokenizer on its sample.")
    return "\n".join(out)


def records_size(text: str) -> float:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def bpe_encode(rows: list[dict]) -> str:
    """BPE encoding on all cores, the newest run of each way."""
    newest = {r["way"]: r for r in rows}
    out = ["| way | throughput | median of | corpus | commit |", "| --- | --- | --- | --- | --- |"]
    for way, r in newest.items():
        out.append(f"| {way} | {r['metrics']['mb_per_s']:.2f} MB/s | {r['rounds']} rounds, interleaved | "
                   f"{r['corpus_mb']} MB, BPE {r['vocab_size']:,} | {r['commit']} |")
    out += ["", f"CPU: {'; '.join(sorted({r['cpu'] for r in rows}))}; each time includes starting the processes."]
    return "\n".join(out)


def prepare_paired(rows: list[dict]) -> str:
    """Before and after in turn: medians of each, and the median of the per-round ratios."""
    import statistics
    groups = {}
    for r in rows:
        groups.setdefault((r["size"], r["kind"]), {}).setdefault(r["round"], {})[r["label"]] = r
    out = ["| corpus | tokenizer | before: median time, peak | after: median time, peak | speed-up (median of "
           "rounds, min-max) | rounds |", "| --- | --- | --- | --- | --- | --- |"]
    for (size, kind), rounds in sorted(groups.items()):
        whole = [v for v in rounds.values() if "before" in v and "after" in v]
        if not whole:
            continue
        ratios = [v["before"]["metrics"]["seconds"] / v["after"]["metrics"]["seconds"] for v in whole]
        cell = {}
        for label in ("before", "after"):
            ms = [v[label]["metrics"] for v in whole]
            cell[label] = (f"{statistics.median(m['seconds'] for m in ms):.1f} s, "
                           f"{_gb(statistics.median(m['peak_rss_bytes'] for m in ms))}")
        out.append(f"| {_gb(whole[0]['after']['corpus_bytes'])} | {kind} | {cell['before']} | {cell['after']} | "
                   f"{statistics.median(ratios):.1f}× ({min(ratios):.1f}-{max(ratios):.1f}) | {len(whole)} |")
    out += ["", f"CPU: {'; '.join(sorted({r['cpu'] for r in rows}))}; before {rows[0]['commit'] if rows else ''} "
            f"and after in turn, the order reversed each round."]
    return "\n".join(out)


TABLES = {"prepare_paired": (prepare_paired, "prepare_paired"), "prepare_scale": (prepare_scale, "prepare_scale"), "bpe_encode": (bpe_encode, "bpe_encode")}


def render(text: str) -> str:
    for name, (make, source) in TABLES.items():
        rows = records.read(source)
        if not rows:
            continue
        pattern = re.compile(rf"(<!-- report:{name} -->\n)(.*?)(<!-- /report:{name} -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + make(rows) + "\n" + m.group(3), text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a table differs from the records")
    args = ap.parse_args()
    stale = []
    for page in pages():
        old = page.read_text(encoding="utf-8")
        new = render(old)
        if new == old:
            continue
        name = page.relative_to(ROOT).as_posix()
        if args.check:
            stale.append(name)
        else:
            page.write_text(new, encoding="utf-8")
            print(f"{name}: tables rewritten from benchmarks/results/")
    if stale:
        sys.exit(f"{', '.join(stale)}: a results table differs from benchmarks/results/; "
                 f"run python benchmarks/report.py")


if __name__ == "__main__":
    main()
