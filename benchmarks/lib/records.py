"""Results as data: every measurement is one JSON line in benchmarks/results/, with what it ran
on (the commit, the CPU, the versions, the matrix-product library) beside its configuration and
its numbers.

``TBP_RESULTS=DIR`` sends every script's records to another folder: the study scripts skip the
runs their records already hold, so a fresh folder reruns a study from scratch, e.g.

    TBP_RESULTS=/tmp/fresh python benchmarks/studies/gqa_quality.py sweep neighbours seeds

Every record names the matrix-product library it ran with (``TBP_GEMM``): it changes the last
bits of every run. The quality studies pin it to ``numpy`` unless it is set (``pin_gemm``); the
speed benchmarks leave it to choose, since choosing the fastest is what they measure."""
import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(os.environ.get("TBP_RESULTS") or Path(__file__).resolve().parents[1] / "results")


def pin_gemm() -> str:
    """Pin the matrix-product library for this process and the runs it starts (``TBP_GEMM``,
    default ``numpy``: the same products on every machine), and return it."""
    os.environ.setdefault("TBP_GEMM", "numpy")
    return os.environ["TBP_GEMM"]


def cpu() -> str:
    """The processor's model name (Linux), else what platform knows, with the core count."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


@functools.cache
def machine() -> dict:
    """What decides who wins on this CPU beyond its model name (two machines sold as "Intel(R)
    Xeon(R) Processor" can differ): NumPy's SIMD level, the bf16 units, the BLAS and NumPy's
    version, as ``tbp bench`` reports them."""
    from tbp.machine.cores import machine as measured
    m = measured()
    return {k: m[k] for k in ("simd", "bf16_units", "blas", "numpy")}


def cpus(rows: list[dict]) -> str:
    """The CPUs a set of records ran on, for a table's footnote."""
    return "; ".join(sorted({r["cpu"] for r in rows}))


def provenance(rows: list[dict]) -> str:
    """Where a table's records ran, for its footnote: "CPU: ...; TBP_GEMM ...; commit(s) ..."
    over every record shown (a record older than the TBP_GEMM field ran with its default, auto)."""
    commits = sorted({r["commit"] for r in rows})
    gemms = sorted({r.get("tbp_gemm", "auto") for r in rows})
    return (f"CPU: {cpus(rows)}; TBP_GEMM {', '.join(gemms)}; commit{'s' * (len(commits) > 1)} "
            f"{', '.join(commits)}.")


def commit(tree: Path | None = None) -> str:
    """The commit of ``tree`` (default: this checkout), with "+dirty" for uncommitted changes."""
    tree = tree or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        # the records themselves are outputs: a results file changed by this very run is not "dirty"
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":!benchmarks/results"], capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def append(name: str, record: dict) -> None:
    """Add one record to benchmarks/results/NAME.jsonl."""
    RESULTS.mkdir(exist_ok=True)
    base = {"cpu": cpu(), **machine(), "python": sys.version.split()[0], "tbp_gemm": os.environ.get("TBP_GEMM", "auto")}
    with open(RESULTS / f"{name}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({**base, **record}) + "\n")


def read(name: str) -> list[dict]:
    path = RESULTS / f"{name}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def newest(rows: list[dict], key) -> list[dict]:
    """The last record for each value of ``key(record)``, in the order the keys first appear."""
    seen = {}
    for r in rows:
        seen[key(r)] = r
    return list(seen.values())


def shape(run, keys=("n_layer", "n_head", "d_model", "n_ctx", "vocab_size")) -> dict:
    """A run's model shape, for a record: the ``keys`` of its config.json's model."""
    from tbp.runs.disk import read_config
    model = read_config(Path(run))["model"]
    return {k: model.get(k) for k in keys}
