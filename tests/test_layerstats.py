"""Per-layer training statistics: each figure against its definition, and the run's record."""
import json
import math

import numpy as np
import pytest

from tbp import GPT, ModelConfig
from tbp.runs import disk
from tbp.train.layerstats import LayerStats, groups
from tbp.nn.batch import Batch
from tbp.train.optim import AdamW

from test_train import new_trainer

CFG = dict(vocab_size=20, n_ctx=8, n_layer=3, n_head=2, d_model=8)


def _batch(seed=0):
    ids = np.random.default_rng(seed).integers(0, 20, (2, 9))
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("residual", ["sum", pytest.param("attention", marks=pytest.mark.design("attnres"))])
def test_forward_keeps_what_each_sublayer_reads_and_changes_nothing(residual):
    model = GPT(ModelConfig(**CFG, residual=residual), seed=0, dtype=np.float64)
    idx, _ = _batch()
    inputs, outputs = [], []
    plain = model.forward(idx)
    seen = model.forward(idx, outputs=outputs, inputs=inputs)
    assert np.array_equal(plain, seen) and len(inputs) == 2 * 3 + 1 and len(outputs) == 2 * 3
    if residual == "sum":                       # the residual stream: x0 + the outputs so far
        x0 = model.embed.forward(idx).reshape(-1, 8)
        for j, h in enumerate(inputs):
            np.testing.assert_allclose(h, x0 + sum(outputs[:j]), rtol=0, atol=1e-14)
    else:                                       # the first attention reads the embedding alone
        np.testing.assert_array_equal(inputs[0], model.embed.forward(idx).reshape(-1, 8))


def test_gradient_norms_and_update_ratios_are_their_definitions():
    model = GPT(ModelConfig(**CFG), seed=0, dtype=np.float64)
    opt = AdamW(model.layout)
    idx, targets = _batch()
    stats = LayerStats(model)
    model.loss_and_backward(idx, targets)
    stats.gradients()
    before = {k: v.copy() for k, v in model.params.items()}
    stats.before_update()
    opt.step(1e-2)
    stats.updates()
    stats.stream(Batch(idx, targets))
    rec = stats.record()
    assert list(rec["grad_norm"])[:4] == ["wte", "wpe", "h.0.ln_1", "h.0.attn"]
    total = math.sqrt(sum(v ** 2 for v in rec["grad_norm"].values()))
    assert total == pytest.approx(math.sqrt(sum(float((g ** 2).sum()) for g in model.grads.values())), rel=1e-12)
    for group, names in groups(model.params).items():
        want = math.sqrt(sum(float(((model.params[n] - before[n]) ** 2).sum()) for n in names)) / \
            math.sqrt(sum(float((before[n] ** 2).sum()) for n in names))
        assert rec["update_ratio"][group] == pytest.approx(want, rel=1e-10)
        assert rec["grad_norm"][group] == pytest.approx(
            math.sqrt(sum(float((model.grads[n] ** 2).sum()) for n in names)), rel=1e-12)
    assert len(rec["stream_rms"]) == 7 and all(r > 0 for r in rec["stream_rms"])
    assert rec["stats_ms"] > 0 and stats.record() == {"stats_ms": 0.0}      # handed over once


def test_every_evaluation_records_the_layers_and_only_evaluations(tmp_path, dataset):
    tr = new_trainer(tmp_path, dataset, max_iters=20, eval_interval=10)
    tr.run_loop()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    with_layers = [m["step"] for m in lines if "layers" in m]
    assert with_layers == [m["step"] for m in lines if "val_loss" in m] == [10, 20]
    last = lines[-1]["layers"]
    assert set(last) == {"grad_norm", "update_ratio", "stream_rms", "stats_ms"}
    assert len(last["stream_rms"]) == 2 * 2 + 1
    # the total gradient norm of the line is the groups' (before clipping)
    assert math.sqrt(sum(v ** 2 for v in last["grad_norm"].values())) == pytest.approx(lines[-1]["grad_norm"],
                                                                                     rel=1e-4)
    assert disk.read_metrics(tmp_path / "run")[-1]["layers"] == last      # the schema keeps it


def test_info_and_plot_read_the_layers(tmp_path, corpus_file, monkeypatch):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed: pip install -e '.[plot]'")
    from helpers import run, train_tiny
    r = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 10)
    shown = run(["info", r])
    assert shown.exit_code == 0 and "grad norm" in shown.output and "update / weight" in shown.output
    assert "what each sublayer reads" in shown.output
    done = run(["plot", r, "--layers", "--out", tmp_path / "layers.png"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "layers.png").read_bytes()[:4] == b"\x89PNG"
