"""The recipes in recipes/ read as the options they name, and run on the text shipped for them."""
import json
from pathlib import Path

from helpers import run

ROOT = Path(__file__).resolve().parents[1]


def test_nanogpts_shakespeare_recipe_is_its_config_and_trains_on_the_shipped_text(tmp_path, monkeypatch):
    """The recipe's options reach the run's config.json (the shape and schedule as nanoGPT's), and
    a step runs on data/tinyshakespeare.txt (the model made small on the command line, which wins)."""
    text = ROOT / "data" / "tinyshakespeare.txt"
    assert text.stat().st_size == 1_115_394 and text.read_text(encoding="utf-8").startswith("First Citizen:")
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--config", ROOT / "recipes" / "nanogpt-shakespeare-char.json", "--data", text, "--out", "r",
             "--n-layer", 1, "--d-model", 24, "--n-head", 2, "--n-ctx", 32, "--batch-size", 2, "--max-iters", 2,
             "--eval-batches", 1, "--eval-interval", 2, "-q"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (cfg["model"]["dropout"], cfg["model"]["bias"], cfg["model"]["n_layer"]) == (0.2, False, 1)
    t = cfg["train"]
    assert (t["lr"], t["min_lr"], t["lr_decay_iters"], t["warmup"], t["beta2"], t["max_iters"]) == \
        (1e-3, 1e-4, 5000, 100, 0.99, 2)
    assert cfg["model"]["vocab_size"] == 65                    # nanoGPT's 65 characters


def test_the_speedrun_recipe_trains_against_the_clock_to_a_target(tmp_path, monkeypatch):
    """tbp's speedrun recipe reaches the run's config (Muon, wsd, no dropout), runs on the shipped text
    with a time budget and a target (the model made small on the command line), and every option it
    names is one tbp train takes (a recipe with a stray key would be refused)."""
    recipe = json.loads((ROOT / "recipes" / "shakespeare-speedrun.json").read_text())
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--config", ROOT / "recipes" / "shakespeare-speedrun.json", "--data",
             ROOT / "data" / "tinyshakespeare.txt", "--out", "s", "--n-layer", 1, "--d-model", 24, "--n-head", 2,
             "--n-ctx", 32, "--batch-size", 2, "--max-time", 2, "--eval-batches", 1, "--eval-interval", 5,
             "--target-loss", 9, "-q"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert (cfg["train"]["optimizer"], cfg["train"]["schedule"], cfg["model"]["dropout"]) == ("muon", "wsd", 0.0)
    assert {k: cfg["train"][k] for k in recipe["train"] if k not in ("max_iters", "eval_interval", "eval_batches",
                                                                    "batch_size")} == \
        {k: v for k, v in recipe["train"].items() if k not in ("max_iters", "eval_interval", "eval_batches",
                                                               "batch_size")}
    assert "target" in r.output and "stopped: max time" in r.output
