"""Runs by name: how a run ended (finished, early stop, max time, interrupted, aborted), which
run a command uses when given none, tbp runs and tbp runs rm, --checkpoint everywhere."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import clean_fail, run, tiny

from tbp.runs import disk, listing

SMALL = "".join(f"the cat sat on mat {i % 3}\n" for i in range(150))      # ~3 KB: overfits fast


def train(tmp_path, name, *extra, text=None):
    (tmp_path / "t.txt").write_text(text or SMALL)
    r = run(["train", "--data", tmp_path / "t.txt", "--out", tmp_path / "checkpoints" / name, *tiny(), *extra])
    assert r.exit_code == 0, r.output
    return r, tmp_path / "checkpoints" / name


def state(run_dir):
    return json.loads((run_dir / "state.json").read_text())


def test_early_stop_ends_after_n_evaluations_without_a_lower_loss_and_keeps_the_best(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r, d = train(tmp_path, "es", "--max-iters", 2000, "--eval-interval", 10, "--early-stop", 2, "--lr", "0.03",
                 "--warmup", 5, "--d-model", 32, "--n-ctx", 16)
    st = state(d)
    assert st["step"] < 2000 and st["stopped"].startswith("early stop: no lower validation loss in 2 evaluations")
    assert st["step"] - st["best_step"] == 20                      # two evaluations after the best one
    evals = [m for m in disk.read_metrics(d) if "val_loss" in m]
    assert min(e["val_loss"] for e in evals) == pytest.approx(st["best_val_loss"])
    assert all(e["val_loss"] >= st["best_val_loss"] for e in evals if e["step"] > st["best_step"])
    said = " ".join(r.output.split())
    assert "stopped: early stop" in said and "--best" in said
    assert "final val loss" in said and "over the whole validation split" in said     # as a finished run's
    assert "val_split_loss" in evals[-1] and evals[-1]["step"] == st["step"]
    assert [e["step"] for e in evals] == sorted({e["step"] for e in evals})           # one line per evaluation
    assert disk.checkpoint_files(d)["best"] is not None
    assert listing.status(d) == "stopped"


def test_max_time_stops_with_an_evaluation_and_a_checkpoint_and_resume_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r, d = train(tmp_path, "mt", "--max-iters", 10 ** 6, "--eval-interval", 10 ** 5, "--max-time", "0.5")
    st = state(d)
    assert st["stopped"] == "max time: 0.5 s" and 0 < st["step"] < 10 ** 6
    last = disk.read_metrics(d)[-1]
    assert last["step"] == st["step"] and "val_loss" in last          # evaluated at the step it stopped
    r2 = run(["train", "--out", d, "--resume", "--max-time", "0.5", "-q"])
    assert r2.exit_code == 0, r2.output
    assert state(d)["step"] > st["step"]                              # this invocation's own half second


def test_a_run_that_reads_its_data_many_times_over_says_so_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r, _ = train(tmp_path, "many", "--max-iters", 1200)             # 4 x 1,200 windows of ~190
    said = " ".join(r.output.split())
    assert re.search(r"1,200 steps read this training data about 2\d times over", said) and "--early-stop" in said
    assert "for the 1,195 steps to go at this pace" in said
    r, _ = train(tmp_path, "few", "--max-iters", 6, text=SMALL * 40)
    assert "times over" not in r.output


def test_the_default_run_passes_over_aborted_runs_and_other_kinds_and_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, good = train(tmp_path, "good", "--max-iters", 5)
    time.sleep(0.05)
    _, cut = train(tmp_path, "cut", "--max-iters", 5)
    s = state(cut)                       # as a run killed at step 5 of 50 leaves it: no reason given
    cfg = json.loads((cut / "config.json").read_text())
    cfg["train"]["max_iters"] = 50
    (cut / "config.json").write_text(json.dumps(cfg))
    assert listing.status(cut) == "aborted" and s["step"] == 5
    g = run(["generate", "--max-new-tokens", 3])
    assert g.exit_code == 0, g.output
    assert "run: checkpoints/good (the newest text/pairs run under checkpoints/; passed over checkpoints/cut " \
           "(aborted)" in " ".join(g.output.split())
    clean_fail(run(["chat"]), 1, "no usable chat run under checkpoints/")
    monkeypatch.setenv("TBP_CHECKPOINT", str(cut))
    g = run(["generate", "--max-new-tokens", 3])
    assert g.exit_code == 0 and f"run: {cut} (from TBP_CHECKPOINT" in " ".join(g.output.split()), g.output
    monkeypatch.setenv("TBP_CHECKPOINT", str(tmp_path / "nowhere"))
    clean_fail(run(["generate"]), 1, "TBP_CHECKPOINT=")


def test_tbp_runs_lists_status_losses_and_the_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, a = train(tmp_path, "a", "--max-iters", 5)
    _, b = train(tmp_path, "b", "--max-iters", 40, "--eval-interval", 5, "--early-stop", 1, "--lr", "0.05")
    r = run(["runs", "--json"])
    assert r.exit_code == 0, r.output
    rows = {x["run"]: x for x in json.loads(r.stdout)}
    a, b = rows["checkpoints/a"], rows["checkpoints/b"]
    assert a["status"] == "finished" and a["step"] == 5 and a["bytes"] > 0 and a["kind"] == "text"
    assert b["status"] in ("stopped", "finished")
    assert sum(x["default"] for x in rows.values()) == 1
    table = run(["runs"])
    assert table.exit_code == 0 and "finished" in table.output and "*" in table.output


def test_runs_rm_removes_only_what_tbp_wrote_and_asks_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, a = train(tmp_path, "a", "--max-iters", 5)
    _, b = train(tmp_path, "b", "--max-iters", 5)
    clean_fail(run(["runs", "rm", "a"]), 2, "--yes")                 # no terminal to ask in
    (b / "notes.txt").write_text("mine")
    clean_fail(run(["runs", "rm", "b", "--yes"]), 1, "holds files tbp did not write")
    assert (b / "notes.txt").read_text() == "mine"
    clean_fail(run(["runs", "rm", "nothing-here", "--yes"]), 1, "no such run")
    (tmp_path / "plain").mkdir()
    clean_fail(run(["runs", "rm", tmp_path / "plain", "--yes"]), 1, "not a run")
    r = run(["runs", "rm", "a", "--yes"])
    assert r.exit_code == 0 and not a.exists() and "removed" in r.output


def test_runs_rm_refuses_a_run_being_trained(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text(SMALL * 20)
    env = {**os.environ, "TBP_GEMM": "numpy"}
    p = subprocess.Popen([sys.executable, "-m", "tbp", "train", "--data", "t.txt", "--out", "checkpoints/live",
                          *tiny(max_iters=10 ** 6, eval_interval=2)], cwd=tmp_path, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        live = tmp_path / "checkpoints" / "live"
        deadline = time.monotonic() + 120
        while not (live / "state.json").is_file():                 # its first checkpoint, whenever it comes
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        assert listing.status(live) == "training"
        clean_fail(run(["runs", "rm", "live", "--yes"]), 1, "a training is writing it")
        assert (live / "state.json").is_file()
    finally:
        p.terminate()
        p.wait(60)
    assert listing.status(tmp_path / "checkpoints" / "live") == "stopped"     # SIGTERM: saved, said
    assert state(tmp_path / "checkpoints" / "live")["stopped"] == "interrupted"


def test_every_command_takes_the_run_as_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, a = train(tmp_path, "a", "--max-iters", 5)
    r = run(["export", "--checkpoint", a, "--out", tmp_path / "hf"])
    assert r.exit_code == 0, r.output
    clean_fail(run(["export", a, "--checkpoint", tmp_path / "hf", "--out", tmp_path / "hf2"]), 2, "give the run once")
    clean_fail(run(["merge", "--checkpoint", a, "--out", tmp_path / "m"]), 1, "has no LoRA adapters")
    assert run(["info", "--checkpoint", a]).exit_code == 0
    for command in ("generate", "eval", "attention", "info"):
        assert "--checkpoint" in run([command, "--help"]).output, command
    pytest.importorskip("matplotlib", reason="the plot extra is not installed: pip install -e '.[plot]'")
    r = run(["plot", "--checkpoint", a, "--out", tmp_path / "c.png"])
    assert r.exit_code == 0 and (tmp_path / "c.png").is_file(), r.output


def test_runs_rm_of_several_checks_them_all_before_removing_any(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, a = train(tmp_path, "a", "--max-iters", 5)
    _, b = train(tmp_path, "b", "--max-iters", 5)
    (b / "notes.txt").write_text("mine")
    clean_fail(run(["runs", "rm", "a", "b", "--yes"]), 1, "nothing removed")
    assert a.is_dir() and (b / "notes.txt").is_file()


def test_early_stop_counts_evaluations_even_when_the_interval_changes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, d = train(tmp_path, "es2", "--max-iters", 40, "--eval-interval", 10, "--lr", "0.03", "--d-model", 32)
    st = state(d)
    r = run(["train", "--out", d, "--resume", "--max-iters", 4000, "--eval-interval", 7, "--early-stop", 2,
             "--lr", "0.03", "-q"])
    assert r.exit_code == 0, r.output
    evals = [m for m in disk.read_metrics(d) if "val_loss" in m and m["step"] > st["step"]]
    after = state(d)                           # 3 KB read thousands of times over: it overfits, and stops
    assert after["stopped"].startswith("early stop: no lower validation loss in 2 evaluations")
    assert after["evals_since_best"] == 2 and after["step"] < 4000
    assert all(e["val_loss"] >= after["best_val_loss"] for e in evals[-2:])
    assert evals[-1]["step"] - evals[-2]["step"] == 7      # counted in evaluations, at the new interval


@pytest.mark.parametrize("width", [40, 60, 80, 200])
def test_run_names_show_whole_at_any_width(tmp_path, monkeypatch, width):
    """The name is what a user copies into --checkpoint: other columns go first, and the table
    says which."""
    monkeypatch.chdir(tmp_path)
    name = "a-run-with-a-name-long-enough-to-need-the-room"
    train(tmp_path, name, "--max-iters", 2)
    monkeypatch.setenv("COLUMNS", str(width))
    r = run(["runs"])
    assert r.exit_code == 0, r.output
    assert any(f"checkpoints/{name}" in line for line in r.output.splitlines()), r.output
    assert ("too narrow for" in r.output) == (70 < width < 100) and "…" not in r.output


def test_best_names_the_step_its_weights_are_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, out = train(tmp_path, "b", "--max-iters", 6, "--eval-interval", 2)
    best = state(tmp_path / "checkpoints" / "b")["best_step"]
    for cmd in (["generate", "--max-new-tokens", "3"], ["eval"]):
        r = run([*cmd, "--checkpoint", "checkpoints/b", "--best"])
        assert r.exit_code == 0, r.output
        assert f"best-validation weights: step {best}," in r.output
