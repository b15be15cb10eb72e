"""FlashAttention equals dense attention; rotary positions; the sliding KV cache; O(T) memory."""
import json
import tracemalloc

import numpy as np
import pytest
from helpers import clean_fail, run, tiny

from tbp import GPT, ModelConfig
from tbp.generate.sampling import Sampling, generate_ids
from tbp.nn.attention import CausalSelfAttention
from tbp.nn.designs.flash.flash import flash_backward, flash_forward
from tbp.nn.designs.rope.rope import Rotary
from tbp.nn.designs.rope import twin as rope_twin
from tbp.train.optim import AdamW
from tbp.nn.decode import Inference


def dense(qs, k, v, causal):
    """Attention keeping P, with the queries as the last Tq positions: y, lse, P."""
    Tq, Tk = qs.shape[2], k.shape[2]
    s = qs @ k.transpose(0, 1, 3, 2)
    if causal:
        s = np.where(np.arange(Tk)[None, :] > np.arange(Tq)[:, None] + Tk - Tq, -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return (p / l) @ v, (m + np.log(l))[..., 0], p / l


def close(a, b, rtol=1e-12):
    scale = max(np.abs(b).max(), 1e-300)
    assert np.abs(a - b).max() <= rtol * scale, np.abs(a - b).max() / scale


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("Tq,Tk,bq,bk,scale", [
    (1, 1, 4, 4, 1.0),                 # one token
    (37, 37, 8, 16, 1.0),              # T not a multiple of either tile, B_r != B_c
    (37, 37, 64, 64, 1.0),             # a tile larger than T
    (257, 257, 64, 32, 1.0),
    (20, 50, 7, 9, 1.0),               # queries != keys: the last 20 positions of 50
    (37, 37, 8, 16, 30.0),             # large scores: exercises the running-max rescaling
])
def test_flash_equals_dense_forward_and_backward(rng, causal, Tq, Tk, bq, bk, scale):
    qs = rng.standard_normal((2, 3, Tq, 4)) * scale
    k, v = rng.standard_normal((2, 3, Tk, 4)), rng.standard_normal((2, 3, Tk, 5))
    y, lse, p = dense(qs, k, v, causal)
    y_flash, lse_flash = flash_forward(qs, k, v, causal, bq, bk)
    close(y_flash, y)
    close(lse_flash, lse)
    dy = rng.standard_normal(y.shape)
    ds = p * (dy @ v.transpose(0, 1, 3, 2) - (dy * y).sum(-1, keepdims=True))
    dqs, dk, dv = flash_backward(dy, qs, k, v, y_flash, lse_flash, causal, bq, bk)
    if Tk > 1:                                   # one key: every gradient of qs and k is zero
        close(dqs, ds @ k)
        close(dk, ds.transpose(0, 1, 3, 2) @ qs)
    close(dv, p.transpose(0, 1, 3, 2) @ dy)


def test_flash_keeps_float32_in_float32(rng):
    qs, k, v = (rng.standard_normal((1, 2, 33, 4)).astype(np.float32) for _ in range(3))
    y, lse = flash_forward(qs, k, v, True, 8, 8)
    assert y.dtype == lse.dtype == np.float32
    assert all(g.dtype == np.float32 for g in flash_backward(y, qs, k, v, y, lse, True, 8, 8))


@pytest.mark.parametrize("rope,d_qk", [(False, 4), (True, 4), (True, 2)])
def test_the_flash_layer_equals_the_dense_layer(rng, rope, d_qk):
    layers = []
    for impl in ("dense", "flash"):
        layers.append(CausalSelfAttention(8, 2, d_qk, 4, np.random.default_rng(0), np.float64, impl=impl,
                                          **({"positions": Rotary(d_qk)} if rope else {}), tiles=(3, 5)))
    x, dy = rng.standard_normal((2, 11, 8)), rng.standard_normal((2, 11, 8))
    outs = []
    for layer in layers:
        layer.zero_grad()
        outs.append((layer.forward(x), layer.backward(dy.copy()), dict(layer.grads)))
    close(outs[1][0], outs[0][0])
    close(outs[1][1], outs[0][1])
    for k in outs[0][2]:
        close(outs[1][2][k], outs[0][2][k])


def test_five_adamw_steps_give_the_same_losses_with_flash_and_dense(rng):
    x, y = rng.integers(0, 11, (3, 16)), rng.integers(0, 11, (3, 16))
    losses = []
    for impl in ("dense", "flash"):
        model = GPT(ModelConfig(vocab_size=11, n_ctx=16, n_layer=2, n_head=2, d_model=16, attn_impl=impl),
                    seed=0, dtype=np.float64)
        for block in model.blocks:
            block.attn.kernel.tiles = (5, 6)
        opt = AdamW(model.layout)
        run_losses = []
        for _ in range(5):
            run_losses.append(model.loss_and_backward(x, y))
            opt.step(1e-2)
        losses.append(run_losses)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-10)


def test_rope_equals_the_plain_rotation_and_keeps_only_relative_positions(rng):
    rot = Rotary(6, base=100.0)
    x = rng.standard_normal((2, 7, 6))
    np.testing.assert_allclose(rot.forward(x, 3), rope_twin.rope_forward(x, 100.0, 3), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(rot.backward(x, 3), rope_twin.rope_backward(x, 100.0, 3), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(np.linalg.norm(rot.forward(x), axis=-1), np.linalg.norm(x, axis=-1))
    q, k = rng.standard_normal((1, 6)), rng.standard_normal((1, 6))
    scores = [(rot.forward(q, t + 5) @ rot.forward(k, t).T).item() for t in (0, 9, 1000)]
    np.testing.assert_allclose(scores, scores[0], rtol=1e-9)          # depends on t - s only


def test_rope_models_have_no_wpe_and_need_an_even_d_qk():
    model = GPT(ModelConfig(vocab_size=11, n_ctx=8, n_layer=1, n_head=2, d_model=8, positions="rope"))
    assert "wpe" not in model.params
    with pytest.raises(ValueError, match="even d_qk"):
        ModelConfig(n_head=2, d_model=8, d_qk=3, positions="rope")


def rope_model(impl="dense"):
    cfg = ModelConfig(vocab_size=13, n_ctx=12, n_layer=2, n_head=2, d_model=16, positions="rope", attn_impl=impl)
    model = GPT(cfg, seed=1, dtype=np.float64)
    for p in model.params.values():                   # away from the near-uniform init
        p += np.random.default_rng(2).standard_normal(p.shape) * 0.3
    return model


@pytest.mark.parametrize("impl", ["dense", "flash"])
def test_the_sliding_cache_equals_recomputing_at_every_step(impl):
    """Past the context a rotary model attends to the last n_ctx positions at every layer
    (sliding-window attention). The cached decoder and the training forward over the whole
    sequence must agree at every step -- and so must the forward over only the last
    L (n_ctx - 1) + 1 tokens, all that the last token can depend on."""
    model = rope_model(impl)
    if impl == "flash":
        for block in model.blocks:
            block.attn.kernel.tiles = (5, 7)                 # several tiles inside and across the band
    tokens = np.random.default_rng(3).integers(0, 13, (2, 60))
    full = model.forward(tokens)                      # (2, 60, V): band attention, width 12
    decoder = Inference(model, batch=2)
    np.testing.assert_allclose(decoder.forward(tokens[:, :5]), full[:, :5], rtol=1e-10, atol=1e-12)
    reach = 2 * (12 - 1) + 1
    for t in range(5, 60):                            # 48 tokens past the 12-token context
        step = decoder.forward(tokens[:, t:t + 1])[:, -1]
        np.testing.assert_allclose(step, full[:, t], rtol=1e-10, atol=1e-12, err_msg=str(t))
        recent = model.forward(tokens[:, max(0, t + 1 - reach):t + 1])[:, -1]
        np.testing.assert_allclose(step, recent, rtol=1e-10, atol=1e-12, err_msg=str(t))


def test_generation_past_the_context_is_the_same_with_and_without_the_cache():
    model = rope_model()
    streams = []
    for use_cache in (True, False):
        gen = generate_ids(model, [1, 2, 3], 50, Sampling(1.0), np.random.default_rng(5), 2, use_cache)
        streams.append(np.stack(list(gen)))
    np.testing.assert_array_equal(streams[0], streams[1])


def test_a_learned_position_decoder_still_refuses_to_pass_its_context():
    model = GPT(ModelConfig(vocab_size=13, n_ctx=4, n_layer=1, n_head=2, d_model=8), dtype=np.float64)
    decoder = Inference(model)
    decoder.forward(np.array([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="holds 4 positions"):
        decoder.forward(np.array([[5]]), check=False)


def _peak_bytes(impl, T):
    layer = CausalSelfAttention(32, 2, 16, 16, np.random.default_rng(0), np.float32, impl=impl)
    x = np.random.default_rng(1).standard_normal((1, T, 32)).astype(np.float32)
    tracemalloc.start()
    layer.backward(layer.forward(x))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_flash_memory_grows_linearly_with_the_context_where_dense_grows_quadratically():
    tracemalloc.start()
    probe = np.ones(1 << 20, np.uint8)                 # tracemalloc sees NumPy's allocations
    assert tracemalloc.get_traced_memory()[1] >= probe.nbytes
    tracemalloc.stop()
    flash = _peak_bytes("flash", 2048) / _peak_bytes("flash", 1024)
    dense = _peak_bytes("dense", 2048) / _peak_bytes("dense", 1024)
    assert flash < 2.3 and dense > 3.5, (flash, dense)


def test_training_and_generating_with_rope_and_flash_from_the_cli(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 5, "--positions", "rope",
             "--attn-impl", "flash", *tiny(n_ctx=32)])
    assert r.exit_code == 0, r.output
    info = json.loads(run(["info", "r", "--json"]).stdout)
    assert info["model"]["attn_impl"] == "flash" and info["model"]["positions"] == "rope"
    assert "flash" in run(["info", "r"]).output
    g = run(["generate", "--checkpoint", "r", "--max-new-tokens", 80, "--seed", 1])   # past n_ctx = 32
    assert g.exit_code == 0, g.output
    clean_fail(run(["export", "r", "--out", "hf"]), 1, "positions = rope (GPT-2 has learned)")


def test_auto_picks_flash_from_a_context_of_2048():
    assert ModelConfig(n_ctx=128).attn_kernel == "dense"
    assert ModelConfig(n_ctx=1024).attn_kernel == "dense"
    assert ModelConfig(n_ctx=2048).attn_kernel == "flash"
    assert ModelConfig(n_ctx=4096, attn_impl="dense").attn_kernel == "dense"
    model = GPT(ModelConfig(vocab_size=11, n_ctx=2048, n_layer=1, n_head=2, d_model=8))
    assert model.blocks[0].attn.impl == "flash"


def test_one_thread_training_with_flash_runs_blas_on_one_thread():
    from tbp.train.parallel import Serial
    from tbp.machine.cores import openblas
    if openblas() is None:
        pytest.skip("NumPy's BLAS thread count cannot be read here")
    get = openblas()[0]
    before = get()
    with Serial(GPT(ModelConfig(vocab_size=11, n_ctx=8, n_layer=1, n_head=2, d_model=8, attn_impl="flash"))):
        assert get() == 1
    assert get() == before
