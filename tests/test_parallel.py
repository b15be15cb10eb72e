"""Data parallelism: the batch's rows shared over threads give the one-thread gradients."""
import numpy as np
import pytest

from tbp import GPT, ModelConfig
from tbp.train import launch
from tbp.train.config import TrainConfig
from tbp.nn.lora import LORA_TARGETS, add_lora
from tbp.nn.build import build_model
from tbp.nn.batch import Batch
from tbp.train.optim import AdamW
from tbp.train.parallel import DataParallel, data_parallel
from tbp.machine.cores import blas_threads, openblas

CFG = dict(vocab_size=13, n_ctx=8, n_layer=2, n_head=2, d_model=8)


def batch(B, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 13, (B, 8)), rng.integers(0, 13, (B, 8))


def one_thread_grads(model, x, y):
    model.zero_grad()
    loss = model.loss_and_backward(x, y)
    return loss, {k: g.copy() for k, g in model.grads.items()}


@pytest.mark.parametrize("B,workers", [(2, 2), (3, 2), (5, 3), (2, 3)])
@pytest.mark.parametrize("lora", [False, True], ids=["packed", "lora"])
def test_split_batch_gives_the_one_thread_loss_and_gradients(B, workers, lora):
    model = GPT(ModelConfig(**CFG), seed=0, dtype=np.float64)
    if lora:
        add_lora(model, 2, 4.0, LORA_TARGETS[:4])
        for k, p in model.params.items():
            if k.endswith("lora_up"):
                p += 0.1                      # so that every adapter gradient is non-zero
    x, y = batch(B)
    loss, grads = one_thread_grads(model, x, y)
    dp = DataParallel(model, workers)
    model.zero_grad()
    assert dp.accumulate(Batch(x, y)) == pytest.approx(loss, rel=1e-14)
    for k, g in grads.items():
        np.testing.assert_allclose(model.grads[k], g, rtol=1e-12, atol=1e-15, err_msg=k)
    dp.close()


@pytest.mark.parametrize("arch", ["gpt", "encoder-decoder"])
def test_weighted_batches_split_by_their_share_of_the_weight(arch):
    """Rows with unequal weights: each worker's share is its weight, not its row count."""
    rng = np.random.default_rng(4)
    cfg = ModelConfig.from_dict(dict(**CFG, arch=arch, pad_id=0 if arch != "gpt" else None))
    model = build_model(cfg, seed=0, dtype=np.float64)
    weights = (rng.random((5, 8)) < 0.5) * 1.0
    weights[:, 0] = 1.0
    weights[0] = 1.0                                          # a heavy first row
    if arch == "gpt":
        b = Batch(rng.integers(0, 13, (5, 8)), rng.integers(0, 13, (5, 8)), weights)
    else:
        b = Batch(rng.integers(1, 13, (5, 8)), rng.integers(1, 13, (5, 8)), weights, source=rng.integers(1, 13, (5, 6)))
    model.zero_grad()
    loss = model.batch_accumulate(b)
    want = model.layout.grads.copy()
    with DataParallel(model, 2) as dp:
        model.zero_grad()
        assert dp.accumulate(b) == pytest.approx(loss, rel=1e-13)
    np.testing.assert_allclose(model.layout.grads, want, rtol=1e-11, atol=1e-15)


def test_gradients_accumulate_with_a_scale_like_backward():
    model = GPT(ModelConfig(**CFG), seed=1, dtype=np.float64)
    (x1, y1), (x2, y2) = batch(4, 1), batch(4, 2)
    _, g1 = one_thread_grads(model, x1, y1)
    _, g2 = one_thread_grads(model, x2, y2)
    dp = DataParallel(model, 2)
    model.zero_grad()
    dp.accumulate(Batch(x1, y1), 0.5)
    dp.accumulate(Batch(x2, y2), 0.5)          # two micro-batches of one step
    for k in g1:
        np.testing.assert_allclose(model.grads[k], (g1[k] + g2[k]) / 2, rtol=1e-12, atol=1e-15, err_msg=k)


def test_replicas_share_the_parameters_and_own_their_gradients():
    model = GPT(ModelConfig(**CFG), seed=0)
    replica = DataParallel(model, 2).replicas[1]
    for k, p in model.params.items():
        assert replica.params[k] is p                 # an optimizer step is seen by every thread
        assert not np.shares_memory(replica.grads[k], model.grads[k])
    assert replica.layout.grads is not model.layout.grads
    assert replica.layout.grads.shape == model.layout.grads.shape
    assert replica.layout.params is model.layout.params


def test_losses_of_many_batches_match_one_by_one():
    model = GPT(ModelConfig(**CFG), seed=0, dtype=np.float64)
    batches = [batch(2, s) for s in range(5)]
    dp = DataParallel(model, 2)
    assert dp.losses([Batch(x, y) for x, y in batches]) == pytest.approx([model.loss(x, y) for x, y in batches], rel=1e-14)
    dp.close()


def test_one_worker_is_refused():
    with pytest.raises(ValueError, match="2 or more"):
        DataParallel(GPT(ModelConfig(**CFG)), 1)


@pytest.mark.skipif(openblas() is None, reason="NumPy's BLAS is not OpenBLAS")
def test_blas_threads_is_restored():
    get, _ = openblas()
    before = get()
    with blas_threads(1):
        assert get() == 1
    assert get() == before
    with DataParallel(GPT(ModelConfig(**CFG)), 2) as dp:       # what a training run uses
        assert get() == 1
        x, y = batch(2)
        dp.losses([Batch(x, y)])
    assert get() == before and dp.pool is None


@pytest.mark.skipif(openblas() is None, reason="NumPy's BLAS is not OpenBLAS")
def test_one_thread_is_one_core():
    """--threads 1 holds NumPy's BLAS to one thread too; 0 (one per core) leaves it alone."""
    get, _ = openblas()
    with blas_threads(2):
        with data_parallel(GPT(ModelConfig(**CFG)), 1, 4) as serial:
            assert get() == 1
            x, y = batch(4)
            serial.accumulate(Batch(x, y))
        assert get() == 2
        with data_parallel(GPT(ModelConfig(**CFG)), 0, 1):             # one row: one worker, BLAS as it was
            assert get() == 2


def test_threads_change_only_rounding(tmp_path, dataset):
    """One thread and two threads train the same run to float64 rounding."""
    finals = []
    for threads in (1, 2):
        mcfg = ModelConfig(vocab_size=dataset.tokenizer.vocab_size, n_layer=2, n_head=2, d_model=16, n_ctx=16)
        tcfg = TrainConfig(batch_size=4, max_iters=8, eval_interval=4, eval_batches=2, seed=3,
                           dtype="float64", threads=threads)
        trainer = launch.new_run(tmp_path / f"t{threads}", mcfg, tcfg, dataset, False, None)
        assert trainer.workers.workers == threads
        trainer.run_loop()
        finals.append({k: v.copy() for k, v in trainer.model.params.items()})
    for k in finals[0]:
        np.testing.assert_allclose(finals[1][k], finals[0][k], rtol=1e-9, atol=1e-12, err_msg=k)


def test_adamw_shared_over_threads_updates_bit_for_bit():
    models = [GPT(ModelConfig(**CFG), seed=0) for _ in range(2)]
    x, y = batch(4)
    opts = []
    for model in models:
        opt = AdamW(model.layout)
        opt.CHUNK = 100                       # several chunks per worker's share
        opts.append(opt)
    opts[1].workers = DataParallel(models[1], 3)
    for step in range(3):
        for model, opt in zip(models, opts):
            model.loss_and_backward(x, y)
            opt.step(1e-2)
    for k in models[0].params:
        np.testing.assert_array_equal(models[1].params[k], models[0].params[k], err_msg=k)
    np.testing.assert_array_equal(opts[1].v, opts[0].v)
