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
