"""`tbp info` on runs and datasets, `tbp merge` refusals, and the top-level help."""
import json

from helpers import run, tiny

from tbp.cli.info import sparkline

TINY = tiny(n_layer=2)



def test_info_on_a_run_and_on_its_dataset(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["train", "--data", corpus_file, "--out", "checkpoints/r", "--max-iters", 10, *TINY]).exit_code == 0
    r = run(["info", "checkpoints/r"])
    assert r.exit_code == 0, r.output
    for text in ("2 layers", "parameters per layer", "h.1.mlp", "best (estimate)", "evaluations",
                 "final val loss", "over the whole validation split"):
        assert text in r.output
    d = json.loads(run(["info", "checkpoints/r", "--json"]).stdout)
    assert d["state"]["step"] == 10 and d["kind"] == "model"
    assert sum(d["layers"].values()) == d["parameters"]
    assert list(d["layers"])[:4] == ["wte", "wpe", "h.0.ln_1", "h.0.attn"]     # in the order the forward runs
    ds = json.loads(run(["info", "data/corpus", "--json"]).stdout)
    assert ds["tokenizer"] == "char" and ds["train_tokens"] > 0
    assert run(["info"]).exit_code == 0                       # newest run by default
    listing = json.loads(run(["info", "checkpoints", "--json"]).stdout)
    assert [r["run"] for r in listing] == ["checkpoints/r"] and listing[0]["step"] == 10


def test_info_on_a_folder_that_is_neither(tmp_path):
    r = run(["info", tmp_path])
    assert r.exit_code == 1 and "neither a run" in r.output


def test_merge_refuses_a_plain_run(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 2, *TINY]).exit_code == 0
    r = run(["merge", "r", "--out", "m"])
    assert r.exit_code == 1 and "no LoRA adapters" in r.output


def test_sparkline_spans_the_range():
    s = sparkline([4.0, 3.0, 2.0, 1.0])
    assert s[0] == "█" and s[-1] == "▁" and len(s) == 4
    assert len(sparkline(list(range(500)), width=40)) == 40


def test_every_command_has_help_with_an_example():
    for cmd in ("prepare", "train", "generate", "gradcheck", "merge", "info"):
        r = run([cmd, "--help"])
        assert r.exit_code == 0 and "Example" in r.output, cmd
    assert "tbp train" in run(["--help"]).output


def test_bench_json_reports_the_documented_keys():
    r = run(["bench", "--n-layer", 1, "--n-head", 2, "--d-model", 16, "--n-ctx", 16, "--batch-size", 2,
             "--iters", 2, "--gen-tokens", 5, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for key in ("train_tokens_per_s", "train_ms_per_iter", "generate_tokens_per_s", "gflops", "peak_gflops"):
        assert d[key] > 0, key
    assert d["generate_tokens"] == 5 and d["config"]["n_ctx"] == 16
    # every figure names the machine it was measured on
    m = d["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["simd"] and m["blas"] and m["numpy"]
    assert m["blas_threads"] is None or m["blas_threads"] >= 1


def test_flop_count_matches_a_hand_count():
    from tbp.check.bench import train_flops_per_token
    from tbp.nn.config import ModelConfig
    cfg = ModelConfig(vocab_size=10, n_ctx=8, n_layer=1, n_head=2, d_model=4)
    # per layer: c_attn 4*12 + c_proj 4*4 + mlp 2*4*16 = 192 weights; head 4*10; attention 2*8*2*(2+2)
    assert train_flops_per_token(cfg) == 3 * (2 * (192 + 40) + 2 * 8 * 2 * 4)


def test_losses_keep_their_digits_when_small():
    from tbp.cli.common import fmt_loss
    assert fmt_loss(1.37281) == "1.3728" and fmt_loss(0.0123) == "0.0123"
    assert fmt_loss(0.00412) == "0.00412" and fmt_loss(8.31e-05) == "8.31e-05" and fmt_loss(0.0) == "0.0000"


def test_info_takes_the_run_as_every_command_does(tmp_path, corpus_file, monkeypatch):
    from helpers import clean_fail, train_tiny
    run_dir = train_tiny(tmp_path, corpus_file, monkeypatch, "checkpoints/a", 5)
    by_path, by_option = run(["info", run_dir, "--json"]), run(["info", "--checkpoint", run_dir, "--json"])
    assert by_path.exit_code == by_option.exit_code == 0 and json.loads(by_path.stdout) == json.loads(by_option.stdout)
    clean_fail(run(["info", run_dir, "--checkpoint", tmp_path]), 2, "give the run once")


def test_the_lock_file_a_finished_training_leaves_is_not_shown_and_a_held_one_is_said(tmp_path, corpus_file,
                                                                                       monkeypatch):
    from tbp.files.locks import RunLock
    monkeypatch.chdir(tmp_path)
    assert run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 2, *TINY]).exit_code == 0
    assert (tmp_path / "r" / ".lock").exists()                  # kept between trainings
    r = run(["info", "r"])
    assert r.exit_code == 0 and ".lock" not in r.output and "is writing" not in r.output, r.output
    held = RunLock(tmp_path / "r").acquire()
    try:
        r = run(["info", "r"])
        assert "a training is writing this run" in " ".join(r.output.split())
        assert json.loads(run(["info", "r", "--json"]).stdout)["writing"] is True
    finally:
        held.release()
