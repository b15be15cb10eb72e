"""The results tables of the README and the docs are the records': benchmarks/report.py --check fails on any
table that differs from what benchmarks/results/ gives (a hand edit, a stale table)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_results_table_is_made_from_the_records():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], capture_output=True,
                       text=True, cwd=ROOT / "benchmarks", timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_hand_edited_table_fails_the_check(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report
    text = (ROOT / "docs" / "how-to" / "own-text.md").read_text(encoding="utf-8")
    assert "<!-- report:prepare_scale -->" in text
    edited = text.replace("| after | 0.29 GiB | char |", "| after | 0.29 GiB | char (edited) |", 1)
    assert edited != text and report.render(edited) == text


def test_the_crossover_keeps_each_points_newest_record_per_cpu():
    sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))
    import tables_sparse
    point = lambda cpu, n, kind, commit, x: {"cpu": cpu, "n_layer": 4, "n_ctx": n, "sparse": {"kind": kind},
                                              "commit": commit, "x": x}
    rows = [point("B", 1024, "window", "c1", 0), point("A", 1024, "window", "c1", 1),
            point("A", 2048, "window", "c2", 2), point("A", 1024, "window", "c3", 3)]
    got = tables_sparse.latest_points(rows)
    assert list(got) == ["B", "A"]                                  # the CPU measured last comes last
    assert sorted(r["x"] for r in got["A"]) == [2, 3]               # 1024 re-measured; 2048 kept across commits
    assert [r["x"] for r in got["B"]] == [0]


def test_the_crossover_tells_blas_thread_counts_apart():
    sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))
    import tables_sparse
    point = lambda threads, x: {"cpu": "A", "n_layer": 4, "n_ctx": 1024, "sparse": {"kind": "window"},
                                "commit": "c", "x": x, **({"blas_threads": threads} if threads else {})}
    got = tables_sparse.latest_points([point(None, 0), point(2, 1), point(1, 2), point(1, 3)])
    assert list(got) == ["A, BLAS 2 threads", "A, BLAS 1 thread"]   # the CPU's records without a count: superseded
    assert [r["x"] for r in got["A, BLAS 1 thread"]] == [3]
    assert list(tables_sparse.latest_points([point(None, 0)])) == ["A"]   # kept while nothing supersedes them
    deeper = {**point(None, 4), "n_layer": 8}                        # a point only the older records measured
    got = tables_sparse.latest_points([point(None, 0), deeper, point(1, 5)])
    assert [r["x"] for r in got["A"]] == [4] and [r["x"] for r in got["A, BLAS 1 thread"]] == [5]


def test_repeated_sweeps_show_every_sweep_of_each_cpus_newest_series():
    sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))
    import tables_sparse
    point = lambda series, sweep, x: {"cpu": "A", "commit": "c", "n_layer": 8, "n_ctx": 8192, "series": series,
                                      "sweep": sweep, "decode_sparse_speedup": x, "decode_dense_tokens_per_s": 280.0,
                                      "decode_rounds": 9, "decode_steps": 32, "blas_threads": 1,
                                      "sparse": {"kind": "lessismore", "budget": 512, "layers": [1]}}
    rows = [point("s1", 1, 9.0), point("s1", 2, 9.5), point("s2", 1, 1.52), point("s2", 2, 1.27), point("s2", 3, 1.57)]
    table = tables_sparse.sparse_repeats(rows)
    assert "| 8,192 | 512 | 280–280 | 1.52 / 1.27 / 1.57 (range 0.30) |" in table   # in order, the older series left out
    assert "9.00" not in table and "3 sweeps" in table
    assert "No repeated sweep" in tables_sparse.sparse_repeats([{**rows[0], "series": None}])
    other = [{**point("s3", s, x), "cpu": "B"} for s, x in ((1, 2.4), (2, 2.2))]
    both = tables_sparse.sparse_repeats(rows + other)    # each CPU's newest series, each under its name
    assert "**A, 8 layers**" in both and "**B, 8 layers**" in both
    assert "1.52 / 1.27 / 1.57" in both and "2.40 / 2.20 (range 0.20)" in both and "9.00" not in both
    shallow = [{**point("s4", s, x), "cpu": "B", "n_layer": 4} for s, x in ((1, 1.1), (2, 1.2))]
    deeper = tables_sparse.sparse_repeats(rows + other + shallow)   # a newer series of another depth
    assert "**B, 4 layers**" in deeper and "2.40 / 2.20" in deeper and "1.10 / 1.20" in deeper


def test_a_retrieval_rule_is_compared_with_dense_on_the_same_lines():
    sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))
    import tables_sparse
    dense = {"hit_lines": "1100" * 25}
    same = tables_sparse._against({"hit_lines": "1100" * 25}, dense)
    assert same == "; Δ +0.0 ± 0.0"                      # the same lines right: no difference, no spread
    worse = tables_sparse._against({"hit_lines": "1000" * 25}, dense)
    assert worse.startswith("; Δ -25.0 ± ") and float(worse.split("± ")[1]) > 0
    assert tables_sparse._against({"hits": 3}, dense) == ""   # an older record, not line by line


def test_a_record_names_the_cpu_and_its_vector_units(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))
    import records
    from tbp.machine.cores import machine
    monkeypatch.setattr(records, "RESULTS", tmp_path)
    records.append("x", {"commit": "c", "metric": 1.0})
    (got,) = records.read("x")
    assert got["cpu"] == records.cpu() and got["metric"] == 1.0
    m, keys = machine(), ("simd", "bf16_units", "blas", "numpy")
    assert [got[k] for k in keys] == [m[k] for k in keys] and m["simd"]


def test_retrieval_rules_measured_at_another_layer_than_the_lowest_keep_their_cells():
    # a 4-layer model: LessIsMore at layers 0, 1 and 2; the other rules at layer 1 only
    sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))
    import tables_sparse
    rows = [{"kind": k, "layers": [1], "budget": 32} for k in ("window", "topk", "layer-topk")]
    rows += [{"kind": "lessismore", "layers": [ls], "budget": 32} for ls in (0, 1, 2)]
    cols = tables_sparse._columns(rows)
    got = {(r["kind"], tuple(r["layers"])) for r in rows}
    assert all((kind, layers) in got for kind, layers, _ in cols)     # no column is left empty
    assert [name for *_, name in cols][:3] == ["window + sinks, layers 1", "per-head top-k, layers 1",
                                               "per-layer top-k, layers 1"]
    two_layer = [{"kind": k, "layers": [0], "budget": 32} for k in ("window", "topk", "layer-topk", "lessismore")]
    assert [name for *_, name in tables_sparse._columns(two_layer)][0] == "window + sinks"   # one set: unnamed


def test_the_cross_seed_retrieval_table_names_each_deep_models_lookup_layer():
    sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))
    import tables_sparse

    def model(run, n_layer, medians, kept):
        dense = {"run": run, "commit": "c", "cpu": "x", "kind": "dense", "seed": 1, "exact_match": 1.0, "sequences": 512,
                 "n_cache": 2048, "config": {"n_layer": n_layer},
                 "fact_ranks": {"median": medians, "lines": 64, "within": {"32": [0] * n_layer}}}
        rules = [{"run": run, "commit": "c", "cpu": "x", "kind": "lessismore", "layers": [layer], "budget": K, "exact_match": x}
                 for layer, (a, b) in kept.items() for K, x in ((32, a), (512, b))]
        return [dense] + rules

    rows = (model("runs/deep-a", 4, [163, 696, 0, 188], {1: (0.05, 0.08), 2: (1.0, 1.0)})
            + model("runs/deep-b", 4, [90, 0, 300, 12], {1: (0.97, 1.0), 2: (0.1, 0.3)})
            + model("runs/shallow", 2, [174, 0], {0: (0.1, 0.35)}))
    lines = tables_sparse.retrieval_depth(rows).splitlines()
    a = next(line for line in lines if "`deep-a`" in line).split(" | ")
    b = next(line for line in lines if "`deep-b`" in line).split(" | ")
    assert a[4] == "2" and b[4] == "1"                    # the layer that ranks the fact first
    assert a[5:7] == ["5.0 → 8.0 %", "100.0 → 100.0 %"] and b[5:7] == ["97.0 → 100.0 %", "10.0 → 30.0 %"]
    assert not any("shallow" in line for line in lines)   # two layers: no layer after a selection layer to compare
    assert "7.7 → 29.7 %" in lines[-1]                   # a random set of n/64 and n/4: K/n + (1 - K/n)/16


def test_the_uptraining_table_pairs_each_arm_with_its_own_seeds_source_at_seed_ones_best_rate():
    sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))
    import tables_gqa
    base = {"margin": 0.02, "source_lr": 0.004, "cpu": "X", "commit": "c", "steps": 1500}
    row = lambda arm, kv, seed, loss, n=None, lr=None: {**base, "arm": arm, "n_kv_head": kv, "seed": seed,
                                                         "val_split_loss": loss, "uptrain_steps": n, "uptrain_lr": lr}
    rows = [row("source", 4, 1, 1.0), row("source", 4, 2, 2.0)]
    for kv in (2, 1):
        rows += [row("pooled", kv, 1, 1.5, 0), row("pooled", kv, 2, 2.5, 0), row("scratch", kv, 1, 1.1),
                 row("scratch", kv, 2, 2.1)]
        rows += [row("uptrained", kv, 1, 1.3, 75, 0.004), row("uptrained", kv, 1, 1.2, 75, 0.001),
                 row("uptrained", kv, 2, 9.0, 75, 0.004), row("uptrained", kv, 2, 2.2, 75, 0.001)]
    table = tables_gqa.uptrain(rows)
    # seed 1 chose 0.001; seed 2's run at 0.004 (a loss of 9.0) is not the arm's
    assert "| 2 | +0.5000 ± 0.0000 (2) | +0.2000 ± 0.0000 (2) | +0.1000 ± 0.0000 (2) |" in table
    assert "after 75 steps (5 %)" in table and "0.001 → 1.2000, 0.004 → 1.3000" in table
