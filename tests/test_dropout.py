"""Dropout: the masks, their backward (gradcheck with fixed masks; a backward that ignores
them fails), no dropout outside training, the same gradients on any number of threads, an
exact resume, and the refusals."""
import numpy as np
import pytest
from helpers import assert_equals_twin

from tbp import GPT, ModelConfig
from tbp.check import gradcheck
from tbp.runs import disk
from tbp.nn.attention import CausalSelfAttention
from tbp.nn.config import ConfigError
from tbp.nn.batch import Batch
from tbp.nn.dropout import Dropout, Noise
from tbp.train.parallel import DataParallel

CFG = dict(vocab_size=13, n_ctx=16, n_layer=2, n_head=2, d_model=16, dropout=0.3)


def model(**kw):
    m = GPT(ModelConfig(**{**CFG, **kw}), seed=1, dtype=np.float64)
    for p in m.params.values():
        p += np.random.default_rng(2).standard_normal(p.shape) * 0.3
    return m


def test_masks_keep_one_minus_p_scaled_and_each_row_is_its_own():
    noise = Noise([5, 6, 7], 0.25)
    m = noise.mask((40, 50), np.float64)
    assert set(np.unique(m)) == {0.0, 1 / 0.75}
    assert abs((m > 0).mean() - 0.75) < 0.02
    np.testing.assert_array_equal(Noise([6], 0.25).mask((40, 50), np.float64)[0], m[1])   # row 1 alone: the same


def test_attention_dropout_is_the_mask_on_the_weights(rng):
    layer = CausalSelfAttention(16, 2, 8, 8, rng, np.float64)
    x = rng.standard_normal((3, 6, 16))
    noise_seeds = [1, 2, 3]
    y = layer.forward(x, None, Noise(noise_seeds, 0.5))
    P = layer.weights()
    drop = Noise(noise_seeds, 0.5).mask((2, 6, 6), np.float64)
    qkv = x @ layer.c_attn.params["weight"] + layer.c_attn.params["bias"]
    v = qkv[..., 32:].reshape(3, 6, 2, 8).transpose(0, 2, 1, 3)
    heads = ((P * drop) @ v).transpose(0, 2, 1, 3).reshape(3, 6, 16)
    np.testing.assert_allclose(y, heads @ layer.c_proj.params["weight"] + layer.c_proj.params["bias"], rtol=1e-12)


def test_attention_with_dropout_equals_its_plain_twin_forward_and_backward(rng):
    from tbp.nn import reference_variants as twin
    layer = CausalSelfAttention(16, 2, 8, 8, rng, np.float64)
    for p in layer.params.values():
        p += rng.standard_normal(p.shape) * 0.3
    x, dy = rng.standard_normal((3, 6, 16)), rng.standard_normal((3, 6, 16))
    layer.zero_grad()
    y = layer.forward(x, None, Noise([4, 5, 6], 0.3))
    dx = layer.backward(dy.copy())
    P = layer.params
    masks = Noise([4, 5, 6], 0.3).mask((2, 6, 6), np.float64)          # the same draws
    y_ref, cache = twin.dropout_attention_forward(x, P["c_attn.weight"], P["c_attn.bias"], P["c_proj.weight"],
                                                  P["c_proj.bias"], 2, 8, masks)
    assert_equals_twin(layer, y, dx, y_ref, *twin.dropout_attention_backward(dy, cache))


def test_no_dropout_outside_training():
    with_p, without = model(), model(dropout=0.0)
    idx = np.random.default_rng(3).integers(0, 13, (2, 16))
    np.testing.assert_array_equal(with_p.forward(idx), without.forward(idx))
    assert with_p.loss(idx, idx) != with_p.loss(idx, idx, noise=np.array([1, 2]))


def test_a_backward_that_ignores_the_mask_fails_the_check(monkeypatch):
    monkeypatch.setattr(Dropout, "backward", lambda self, dy: dy)
    rows = gradcheck.run(layer="gpt [dropout 0.3, fixed masks]")
    assert not all(r.passed for r in rows)


def test_threads_give_the_one_thread_gradients_with_dropout():
    m = model()
    rng = np.random.default_rng(4)
    batch = Batch(rng.integers(0, 13, (5, 16)), rng.integers(0, 13, (5, 16)), noise=rng.integers(0, 1 << 40, 5))
    loss = m.loss_and_backward(batch.idx, batch.targets, noise=batch.noise)
    want = m.layout.grads.copy()
    with DataParallel(m, 2) as dp:
        m.zero_grad()
        assert dp.accumulate(batch) == pytest.approx(loss, rel=1e-13)
    np.testing.assert_allclose(m.layout.grads, want, rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("changes,message", [(dict(attn_impl="flash"), "flash kernel has tiles"),
                                             (dict(attention="mta"), "Multi-Token Attention"),
                                             (dict(arch="encoder-decoder"), "built for the GPT")])
def test_the_refusals(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**CFG, **changes})


def test_training_draws_the_masks_and_a_fine_tune_may_change_p(tmp_path, corpus_file, monkeypatch):
    """A run with dropout trains on dropped-out forwards (its weights differ from p = 0's, same
    seed and batches); dropout is free to change when fine-tuning, as the kernel is."""
    from helpers import run, tiny
    monkeypatch.chdir(tmp_path)
    for name, p in (("p0", 0.0), ("p3", 0.3)):
        assert run(["train", "--data", corpus_file, "--out", name, "--max-iters", 3, *tiny(dropout=p)]).exit_code == 0
    a, _, _ = disk.load_model(tmp_path / "p0")
    b, _, _ = disk.load_model(tmp_path / "p3")
    assert any(not np.array_equal(p, b.params[k]) for k, p in a.params.items())
    r = run(["train", "--init-from", "p0", "--data", corpus_file, "--out", "ft", "--max-iters", 2, "--dropout", 0.1,
             "-q"])
    assert r.exit_code == 0, r.output
    assert disk.read_model_config(tmp_path / "ft").dropout == 0.1


def test_a_dropout_run_resumes_exactly(tmp_path, corpus_file, monkeypatch):
    from helpers import run, tiny
    monkeypatch.chdir(tmp_path)
    args = ["--data", corpus_file, *tiny(dropout=0.2, eval_interval=3)]
    assert run(["train", "--out", "whole", "--max-iters", 6, *args]).exit_code == 0
    assert run(["train", "--out", "half", "--max-iters", 3, *args]).exit_code == 0
    assert run(["train", "--out", "half", "--resume", "--max-iters", 6, "-q"]).exit_code == 0
    a, _, _ = disk.load_model(tmp_path / "whole")
    b, _, _ = disk.load_model(tmp_path / "half")
    for k, p in a.params.items():
        np.testing.assert_array_equal(p, b.params[k], err_msg=k)
    assert "p = 0.2 on attention weights" in run(["info", "whole"]).output
