"""Evaluation is bounded in memory: a forward no backward follows keeps one block at a time, the
estimate made before training counts the evaluations, and the final evaluation of the whole
split runs after the final save, so no evaluation can lose a run."""
import json
import tracemalloc

import numpy as np
import pytest
from helpers import run, tiny

from tbp import GPT, ModelConfig
from tbp.machine import memory
from tbp.nn import build
from tbp.nn.batch import Batch
from tbp.train.config import TrainConfig


def _caches(model) -> list[str]:
    return [name for name, m in model.modules() if m.cache is not None]


def _cases():
    """Every registered design's model cases that are GPTs, and the plain model."""
    out = [("plain", {})]
    for v in build.VARIANTS:
        for label, fields in v.cases("model_cases"):
            if fields.get("arch", "gpt") == "gpt" and not fields.get("dropout"):
                out.append((label, fields))
    return out


@pytest.mark.parametrize("label, fields", _cases(), ids=[c[0] for c in _cases()])
def test_a_forward_without_backward_gives_the_same_loss_and_keeps_nothing(label, fields):
    cfg = ModelConfig.from_dict({"vocab_size": 17, "n_ctx": 16, "n_layer": 2, "n_head": 2, "d_model": 16, **fields})
    model = build.build_model(cfg, seed=3, dtype=np.float64)
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 17, (3, 16)), rng.integers(0, 17, (3, 16))
    kept = model.loss(idx, targets)
    assert _caches(model)                                   # the training forward keeps what the backward needs
    light = model.batch_loss(Batch(idx, targets))
    assert light == kept and _caches(model) == [] and model.loss_fn.cache is None, label


def _peak(fn) -> int:
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_evaluation_holds_one_block_not_all_of_them():
    """Peak memory of a loss with and without a backward to come, at 8 layers: the training
    forward holds every block's activations, the evaluation's about one block's."""
    cfg = ModelConfig(vocab_size=64, n_ctx=128, n_layer=8, n_head=4, d_model=64)
    model = GPT(cfg, seed=0)
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 64, (8, 128)), rng.integers(0, 64, (8, 128))
    model.batch_loss(Batch(idx, targets))                   # warm: lazily made buffers
    train = _peak(lambda: model.loss(idx, targets))
    model.batch_loss(Batch(idx, targets))
    evaluating = _peak(lambda: model.batch_loss(Batch(idx, targets)))
    assert evaluating < train / 3, (evaluating, train)
    assert evaluating < memory.eval_activation_bytes(cfg, 8)  # within its own estimate


@pytest.mark.parametrize("fields", [dict(), dict(vocab_size=50257, n_layer=1), dict(n_ctx=2048, n_layer=12)])
def test_the_estimate_before_training_covers_its_evaluations(fields):
    cfg = ModelConfig.from_dict({"vocab_size": 8192, "n_ctx": 1024, "n_layer": 12, "n_head": 12, "d_model": 768,
                                 **fields})
    for threads in (1, 2, 4):
        tcfg = TrainConfig(batch_size=4, threads=threads)
        workers = min(threads, 4)
        assert memory.train_parts(cfg, tcfg)["activations"] >= memory.eval_activation_bytes(cfg, 4, workers)


def test_the_final_evaluation_comes_after_the_final_save(tmp_path, corpus_file, monkeypatch):
    """An evaluation of the whole split that dies (out of memory, say) leaves the run saved at
    its last step."""
    from tbp.train.loop import Trainer

    def dies(self):
        raise MemoryError("the split does not fit")
    monkeypatch.setattr(Trainer, "evaluate_split", dies)
    r = run(["train", "--data", corpus_file, "--out", tmp_path / "r", "--max-iters", 6, "--eval-interval", 3,
             *tiny()])
    assert r.exit_code != 0
    state = json.loads((tmp_path / "r" / "state.json").read_text())
    assert state["step"] == 6


def test_tbp_eval_uses_the_runs_batch_and_says_when_it_cannot_fit(tmp_path, corpus_file, monkeypatch):
    r = run(["train", "--data", corpus_file, "--out", tmp_path / "r", "--max-iters", 4, *tiny()])
    assert r.exit_code == 0, r.output
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    e = run(["eval", "--checkpoint", tmp_path / "r", "--json"])
    assert e.exit_code == 0, e.output
    assert json.loads(e.output[e.output.index("{"):])["val_loss"] == metrics[-1]["val_split_loss"]
    from tbp.runs import disk
    cfg = disk.load_model(tmp_path / "r")[0].config
    assert memory.eval_bytes(cfg, 64) > memory.eval_bytes(cfg, 4) + 1
    monkeypatch.setattr(memory, "available_bytes", lambda: memory.eval_bytes(cfg, 64) - 1)   # loads, cannot read 64
    e = run(["eval", "--checkpoint", tmp_path / "r", "--batch-size", 64])
    assert e.exit_code == 1 and "--batch-size 64" in e.output and "Traceback" not in e.output
