"""The training loop: learning, exact resume, guards, checkpoints."""
import json

import os
from pathlib import Path

import numpy as np
import pytest

from tbp import GPT, ModelConfig
from tbp.runs import commit, disk
from tbp.train import launch
from tbp.train.config import TrainConfig
from tbp.errors import ConfigError, TbpError
from tbp.nn.layout import Layout
from tbp.nn.module import Module
from tbp.train.optim import AdamW, clip_grads, lr_at, wsd_at
from tbp.train.loop import Callbacks
from helpers import TINY, run, tiny

SMALL = dict(n_layer=2, n_head=2, d_model=16, n_ctx=16)


def tcfg(**kw):
    base = dict(batch_size=4, max_iters=20, lr=3e-3, warmup=3, eval_interval=10, eval_batches=2,
                log_interval=5, seed=7)
    return TrainConfig(**{**base, **kw})


def new_trainer(tmp_path, dataset, name="run", callbacks=None, **kw):
    mcfg = ModelConfig(vocab_size=dataset.tokenizer.vocab_size, **SMALL)
    return launch.new_run(tmp_path / name, mcfg, tcfg(**kw), dataset, False, callbacks)


def test_overfitting_one_batch_drives_the_loss_near_zero():
    model = GPT(ModelConfig(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=32), seed=0)
    opt = AdamW(model.layout, weight_decay=0.0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 11, (4, 8))
    y = rng.integers(0, 11, (4, 8))
    first = model.loss_and_backward(x, y)
    for _ in range(300):
        loss = model.loss_and_backward(x, y)
        opt.step(1e-2)
    assert first > 2.0 and loss < 0.05


def test_training_lowers_validation_loss(tmp_path, dataset):
    tr = new_trainer(tmp_path, dataset, max_iters=60, eval_interval=60)
    before = tr.evaluate()["val_loss"]
    tr.run_loop()
    assert tr.evaluate()["val_loss"] < before - 0.5


class StopAt(Callbacks):
    def __init__(self, n):
        self.n = n

    def step(self, trainer, metrics):
        if metrics["step"] == self.n:
            trainer.stop_requested = True       # what the Ctrl-C handler does


def _snapshot(tr):
    return ({k: v.copy() for k, v in tr.model.params.items()},
            {k: v.copy() for k, v in tr.opt.state_arrays().items()}, tr.data_rng.bit_generator.state)


@pytest.mark.parametrize("threads", [1, 2])
def test_ten_steps_resume_ten_steps_equals_twenty_steps_exactly(tmp_path, dataset, threads):
    straight = new_trainer(tmp_path, dataset, "straight", threads=threads)
    straight.run_loop()
    p20, o20, r20 = _snapshot(straight)

    first = new_trainer(tmp_path, dataset, "split", callbacks=StopAt(7), threads=threads)   # stops between evals
    first.run_loop()
    assert first.interrupted and first.state.step == 7
    second = launch.resume(tmp_path / "split", {}, {}, None)
    second.run_loop()
    p, o, r = _snapshot(second)
    assert second.state.step == 20
    for k in p20:
        np.testing.assert_array_equal(p[k], p20[k], err_msg=k)
    for k in o20:
        np.testing.assert_array_equal(o[k], o20[k], err_msg=k)
    assert r == r20
    steps = [json.loads(l)["step"] for l in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))        # no step logged twice


def test_resume_with_a_larger_max_iters_continues(tmp_path, dataset):
    tr = new_trainer(tmp_path, dataset, max_iters=10, lr_decay_iters=20)
    tr.run_loop()
    more = launch.resume(tmp_path / "run", {"max_iters": 20}, {}, None)
    assert more.state.step == 10 and more.cfg.max_iters == 20
    more.run_loop()
    assert more.state.step == 20
    ref = new_trainer(tmp_path, dataset, "ref", max_iters=20, lr_decay_iters=20)
    ref.run_loop()
    for k in ref.model.params:
        np.testing.assert_array_equal(more.model.params[k], ref.model.params[k])


def test_resume_refuses_files_from_different_steps(tmp_path, dataset):
    tr = new_trainer(tmp_path, dataset, max_iters=10)
    tr.run_loop()
    commit.write_arrays(disk.checkpoint_files(tmp_path / "run")["optimizer"], tr.opt.state_arrays(), 3,
                            "optimizer")
    with pytest.raises(TbpError, match="different steps"):
        launch.resume(tmp_path / "run", {}, {}, None)


def test_checkpoint_loads_to_identical_logits(tmp_path, dataset):
    tr = new_trainer(tmp_path, dataset, max_iters=10)
    tr.run_loop()
    loaded = GPT.load(tmp_path / "run")
    idx = np.random.default_rng(0).integers(0, dataset.tokenizer.vocab_size, (2, 16))
    np.testing.assert_array_equal(loaded.forward(idx), tr.model.forward(idx))
    assert loaded.dtype == np.float32
    assert GPT.load(tmp_path / "run", dtype=np.float64).dtype == np.float64


def test_nan_guard_stops_without_poisoning_the_checkpoint(tmp_path, dataset, monkeypatch):
    tr = new_trainer(tmp_path, dataset, max_iters=30)
    orig = tr.model.loss

    def poisoned(*args, **kwargs):           # the 13th step's loss is NaN
        loss = orig(*args, **kwargs)
        return float("nan") if tr.state.step >= 12 else loss
    monkeypatch.setattr(tr.model, "loss", poisoned)
    with pytest.raises(TbpError, match=r"step 13: loss is nan.*last good checkpoint \(step 10\)"):
        tr.run_loop()
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["step"] == 10
    model = GPT.load(tmp_path / "run")
    assert all(np.isfinite(p).all() for p in model.params.values())


def test_clipping_bounds_the_global_norm(rng):
    grads = rng.standard_normal(107).astype(np.float32) * 5
    before = float(np.sqrt(np.sum(grads.astype(np.float64) ** 2)))
    assert clip_grads(grads, 1.0) == pytest.approx(before)
    assert float(np.linalg.norm(grads)) == pytest.approx(1.0, rel=1e-5)
    small = np.full(4, 0.1, dtype=np.float32)
    clip_grads(small, 1.0)
    np.testing.assert_array_equal(small, 0.1 * np.ones(4, dtype=np.float32))


class Leaves(Module):
    """A bare module with the given leaf parameters."""

    def __init__(self, **arrays):
        super().__init__()
        for k, v in arrays.items():
            self.param(k, v)


def test_schedule_warms_up_then_decays_to_min_lr():
    lrs = [lr_at(s, 1e-3, 1e-4, 10, 100) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[10] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:11]))
    assert all(a >= b for a, b in zip(lrs[10:100], lrs[11:101]))
    assert lrs[100] == lrs[119] == pytest.approx(1e-4)


def test_wsd_warms_up_holds_the_peak_then_decays_linearly_over_the_last_fraction():
    lrs = [wsd_at(s, s / 100, 1e-3, 1e-4, 10, 0.2) for s in range(101)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[10] == lrs[79] == 1e-3 and lrs[80] == pytest.approx(1e-3)
    assert lrs[90] == pytest.approx(1e-4 + 0.9e-3 * 0.5) and lrs[100] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(lrs[80:100], lrs[81:101]))
    assert wsd_at(50, 1.3, 1e-3, 1e-4, 10, 0.2) == 1e-4                 # past the budget: the floor


def test_a_time_budget_ends_a_wsd_run_decayed(tmp_path, corpus_file, monkeypatch):
    """--max-time with --schedule wsd: the rate is the peak while most of the time is left and
    has decayed to near --min-lr when the clock stops the run, however many steps that took."""
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", "t", "--max-iters", 10 ** 6, "--schedule", "wsd",
             "--max-time", "2", "--warmup", 0, "--lr", "1e-3", "--min-lr", "1e-5", "--log-interval", 1,
             "--eval-interval", 10 ** 5, *TINY])
    assert r.exit_code == 0, r.output
    rates = [(m["step"], m["lr"]) for m in disk.read_metrics(tmp_path / "t") if "lr" in m]
    assert rates[0][1] == 1e-3 and len(rates) > 20
    assert rates[-1][1] < 1e-5 + 0.35 * (1e-3 - 1e-5), rates[-5:]          # the last steps decayed
    assert max(lr for _, lr in rates) == 1e-3 and sorted(lr for _, lr in rates)[::-1] == [lr for _, lr in rates]


def test_adamw_matches_the_closed_form_on_one_step():
    m = Leaves(w=np.array([[1.0, -2.0]]), b=np.array([0.5]))
    opt = AdamW(Layout(m), weight_decay=0.1, beta1=0.9, beta2=0.99, eps=1e-8)
    p, g = m.params, m.grads
    g["w"][...] = [[0.1, 0.2]]
    g["b"][...] = [-0.3]
    opt.step(0.01)
    # first step: m_hat = g, v_hat = g^2 -> update = lr * sign(g) (up to eps); decay on matrices only
    np.testing.assert_allclose(p["w"], np.array([[1.0, -2.0]]) * (1 - 0.001) - 0.01 * np.sign([[0.1, 0.2]]),
                               rtol=1e-6)
    np.testing.assert_allclose(p["b"], [0.5 + 0.01], rtol=1e-6)


def test_data_shorter_than_one_block_is_refused(tmp_path):
    from tbp.data import datasets
    datasets.prepare("tiny text\n" * 3, "t", "test", tmp_path / "short")
    ds = datasets.Dataset.load(tmp_path / "short")
    with pytest.raises(TbpError, match="fewer than one block"):
        new_trainer(tmp_path, ds)


def adamw_per_tensor(params, grads, state, lr, t, wd=0.1, b1=0.9, b2=0.99, eps=1e-8):
    """Textbook AdamW, one tensor at a time, decay on matrices only (the packed one's reference)."""
    for k, p in params.items():
        g = grads[k]
        m, v = state.setdefault(k, (np.zeros_like(p), np.zeros_like(p)))
        if p.ndim >= 2:
            p *= 1 - lr * wd
        m[...] = b1 * m + (1 - b1) * g
        v[...] = b2 * v + (1 - b2) * g * g
        p -= lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_adamw_equals_textbook_adamw_per_tensor(rng, lora):
    from tbp.nn.lora import add_lora
    a = GPT(ModelConfig(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=16), seed=0, dtype=np.float64)
    b = GPT(ModelConfig(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=16), seed=0, dtype=np.float64)
    if lora:
        add_lora(a, 2, 4.0)
        add_lora(b, 2, 4.0)
    opt = AdamW(a.layout)
    opt.CHUNK = 100                              # several chunks, and a decay boundary inside one
    state = {}
    x = rng.integers(0, 11, (3, 8))
    for t in range(1, 6):
        a.loss_and_backward(x, x)
        b.loss_and_backward(x, x)
        opt.step(1e-2)
        trained = {k: b.params[k] for k in b.grads}
        adamw_per_tensor(trained, b.grads, state, 1e-2, t)
    assert set(a.grads) == set(b.grads) and (not lora or all("lora_" in k for k in a.grads))
    # atol: the key bias's gradient is zero up to rounding (~1e-17), which Adam's normalisation
    # turns into updates of ~1e-14 that depend on the order of operations
    for k in a.params:
        np.testing.assert_allclose(a.params[k], b.params[k], rtol=1e-12, atol=1e-12, err_msg=k)
    for k, (m, v) in state.items():
        np.testing.assert_allclose(opt.state_arrays()[f"m.{k}"], m, rtol=1e-12, atol=1e-15, err_msg=k)


def test_start_decides_new_resume_and_fine_tune_without_the_cli(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train = dict(batch_size=4, max_iters=6, eval_interval=3, eval_batches=1, seed=2)
    first = launch.start(launch.RunRequest(out=tmp_path / "a", data=str(corpus_file), model=SMALL, train=train))
    first.run_loop()
    assert disk.read_state(tmp_path / "a")["step"] == 6
    more = launch.start(launch.RunRequest(out=tmp_path / "a", resume=True, train={"max_iters": 9}))
    assert more.state.step == 6 and more.cfg.max_iters == 9 and more.cfg.batch_size == 4
    more.run_loop()
    lora = launch.start(launch.RunRequest(out=tmp_path / "b", data=str(corpus_file), init_from=tmp_path / "a",
                                      lora=launch.LoraSpec(2, 2.0, ("attn.c_attn",)), train=train))
    assert set(lora.model.grads) == {f"h.{i}.attn.c_attn.{k}" for i in range(2) for k in ("lora_down", "lora_up")}
    with pytest.raises(ConfigError, match="pick one"):
        launch.start(launch.RunRequest(out=tmp_path / "a", resume=True, init_from=tmp_path / "a"))


def test_a_resume_reads_each_of_the_runs_files_once(tmp_path, corpus_file, monkeypatch):
    """config.json, state.json, the tokenizer, the weights and the optimizer state: one read each
    (runfiles.RunRecord), however many checks look at them."""
    from collections import Counter
    from tbp.files import jsonio
    from tbp.data.tokenizer import Tokenizer
    monkeypatch.chdir(tmp_path)
    train = dict(batch_size=4, max_iters=4, eval_interval=4, eval_batches=1, seed=2)
    launch.start(launch.RunRequest(out=tmp_path / "a", data=str(corpus_file), model=SMALL, train=train)).run_loop()
    reads = Counter()

    def counted(module, name, key):
        original = getattr(module, name)

        def wrapper(path, *a, **kw):
            reads[key(path)] += 1
            return original(path, *a, **kw)
        monkeypatch.setattr(module, name, wrapper)
    counted(disk, "read_arrays", lambda p: "weights" if "optimizer" not in str(p) else "optimizer")
    counted(disk, "read_json", lambda p: os.path.basename(str(p)))
    counted(jsonio, "read_json", lambda p: os.path.basename(str(p)))
    original_load = Tokenizer.load
    run_dir = tmp_path / "a"                  # the dataset's own tokenizer is another file, read once too
    monkeypatch.setattr(Tokenizer, "load", staticmethod(
        lambda p: (reads.update(["tokenizer" if Path(p).parent == run_dir else "data tokenizer"]), original_load(p))[1]))
    launch.start(launch.RunRequest(out=tmp_path / "a", resume=True, train={"max_iters": 6}))
    for key in ("weights", "optimizer", "config.json", "state.json", "tokenizer", "data tokenizer"):
        assert reads[key] == 1, dict(reads)


def test_the_final_evaluation_is_announced_and_inside_the_run_time(tmp_path, dataset):
    """A front end hears each evaluation begin (the bar says so); the run's elapsed time, and
    so the summary's, includes the evaluations, the last one too, and tokens/s leaves them out."""
    import time

    class SlowEval(Callbacks):
        calls = 0

        def evaluating(self, trainer):
            SlowEval.calls += 1
            time.sleep(0.3)

    tr = new_trainer(tmp_path, dataset, callbacks=SlowEval(), max_iters=4, eval_interval=2)
    state = tr.run_loop()
    assert SlowEval.calls == 2 and state.elapsed_s >= 0.6
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert disk.read_state(tmp_path / "run")["elapsed_s"] == pytest.approx(state.elapsed_s)
    # steps 3-4 trained 2 x 4 x 16 tokens in milliseconds; counted with the 0.3 s evaluation before
    # them, tokens/s could not pass 128 / 0.3
    assert logged[-1]["tokens_per_s"] > 2 * 128 / 0.3


def test_a_target_loss_records_the_first_evaluation_that_reaches_it(tmp_path, corpus_file, monkeypatch):
    """--target-loss: the first evaluation at or below it is marked in its metrics line (the run's clock
    once it is done, evaluations included), its step and that time are kept in state.json (so a resume keeps them), and the summary says so;
    a target no evaluation reaches is said to be unreached."""
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", "t", "--max-iters", 6, "--target-loss", "50",
             *tiny(eval_interval=2)])
    assert r.exit_code == 0, r.output
    evals = [m for m in disk.read_metrics(tmp_path / "t") if "val_loss" in m]
    marked = [m for m in evals if "target_s" in m]
    assert [m["step"] for m in marked] == [2]                              # the first one only
    state = disk.read_state(tmp_path / "t")
    assert state["target_step"] == 2 and state["target_s"] == marked[0]["target_s"] >= marked[0]["elapsed_s"]
    assert "reached at step 2" in r.output and "target 50 reached after" in r.output
    r = run(["train", "--out", "t", "--resume", "--max-iters", 8, "-q"])
    assert r.exit_code == 0 and disk.read_state(tmp_path / "t")["target_step"] == 2
    r = run(["train", "--data", corpus_file, "--out", "u", "--max-iters", 4, "--target-loss", "0.01",
             *tiny(eval_interval=2)])
    assert r.exit_code == 0 and "not reached by an evaluation" in r.output, r.output
    assert not any("target_s" in m for m in disk.read_metrics(tmp_path / "u"))
    assert disk.read_state(tmp_path / "u")["target_step"] is None
    r = run(["train", "--data", corpus_file, "--out", "v", "--target-loss", "-1"])
    assert r.exit_code == 2 and "-1" in r.output
