"""Multi-Token Attention: identity at initialisation, the convolution by loops, causality, the cache."""
import numpy as np
import pytest

from tbp.nn.gpt import GPT
from tbp.nn.config import ConfigError, ModelConfig
from tbp.nn.designs.mta.map import conv_map, conv_map_backward
from tbp.nn.designs.mta import twin
from tbp.nn.decode import Inference

BASE = dict(vocab_size=11, n_ctx=12, n_layer=2, n_head=4, d_model=16)
ALL = dict(attention="mta", mta_cq=3, mta_ck=5, mta_post=True, mta_mix=True, mta_group=2)


def randomize(model, rng, scale=0.2):
    for p in model.params.values():
        p += rng.standard_normal(p.shape) * scale


def test_a_fresh_mta_model_is_the_standard_model(rng):
    std = GPT(ModelConfig.from_dict(dict(**BASE)), seed=3, dtype=np.float64)
    mta = GPT(ModelConfig.from_dict(dict(**BASE, **ALL)), seed=3, dtype=np.float64)
    for k in std.params:                 # the same draws: MTA's own parameters start as identities
        np.testing.assert_array_equal(mta.params[k], std.params[k])
    idx, y = rng.integers(0, 11, (2, 12)), rng.integers(0, 11, (2, 12))
    assert np.abs(std.forward(idx) - mta.forward(idx)).max() < 1e-12
    assert std.loss_and_backward(idx, y) == pytest.approx(mta.loss_and_backward(idx, y), abs=1e-12)
    for k in std.grads:
        assert np.abs(std.grads[k] - mta.grads[k]).max() < 1e-12, k


@pytest.mark.parametrize("cq,ck", [(1, 1), (2, 9), (3, 5)])
def test_the_vectorised_convolution_equals_four_loops(rng, cq, ck):
    X = rng.standard_normal((2, 3, 7, 7))
    theta = rng.standard_normal((3, cq, ck))
    np.testing.assert_allclose(conv_map(X, theta), twin.mta_conv(X, theta), rtol=1e-12, atol=1e-12)
    # and its backward is the transpose: <dZ, conv(X)> = <conv^T(dZ), X>
    dZ = rng.standard_normal(X.shape)
    dX, dtheta = conv_map_backward(dZ, X, theta)
    assert np.sum(dZ * conv_map(X, theta)) == pytest.approx(np.sum(dX * X), rel=1e-12)
    assert np.sum(dtheta * theta) == pytest.approx(np.sum(dZ * conv_map(X, theta)), rel=1e-12)


@pytest.mark.parametrize("changes", [dict(mta_ck=9), dict(mta_ck=9, mta_cq=3, mta_post=True, mta_mix=True,
                                                          mta_group=4, mta_norm=True)])
def test_no_output_reads_a_later_token(rng, changes):
    model = GPT(ModelConfig.from_dict(dict(**BASE, attention="mta", **changes)), seed=1, dtype=np.float64)
    randomize(model, rng, 0.5)
    idx = rng.integers(0, 11, (1, 12))
    before = model.forward(idx).copy()
    for t in (3, 7, 11):
        other = idx.copy()
        other[0, t] = (other[0, t] + 1) % 11
        after = model.forward(other)
        assert np.array_equal(after[0, :t], before[0, :t]), t       # bit-identical before t
        assert not np.array_equal(after[0, t:], before[0, t:])


@pytest.mark.parametrize("max_scores,scaled", [(1 << 22, False), (40, False), (1 << 22, True)])
def test_cached_decoding_equals_the_full_forward_at_every_step(rng, max_scores, scaled):
    model = GPT(ModelConfig.from_dict(dict(**BASE, **ALL, mta_norm=True, mta_depth_scale=scaled)), seed=2, dtype=np.float64)
    randomize(model, rng)
    idx = rng.integers(0, 11, (3, 12))
    full = model.forward(idx)
    dec = Inference(model, 3)
    dec.max_scores = max_scores               # 40: the prefill runs in chunks of rows
    dec._chunk = max(1, max_scores // (3 * 4 * 12))
    steps = [dec.forward(idx[:, :5]).copy()] + [dec.forward(idx[:, t:t + 1]).copy() for t in range(5, 12)]
    assert np.abs(np.concatenate(steps, 1) - full).max() < 1e-12
    dec.reset()                                # a new sequence forgets the old rows
    assert np.abs(dec.forward(idx[:, :4]) - model.forward(idx[:, :4])).max() < 1e-12


@pytest.mark.parametrize("changes,message", [
    (dict(attention="mta", attn_impl="flash"), "flash"),
    (dict(attention="mta", positions="rope"), "learned positions"),
    (dict(attention="mta", mta_ck=4), "odd"),
    (dict(attention="mta", mta_group=3), "divide"),
    (dict(attention="mta", mta_layers="0,5"), "layers 0 .. 1"),
    (dict(mta_post=True), "pass --attention mta"),
    (dict(attention="mta", mta_depth_scale=True), "needs mta_norm"),
])
def test_config_refuses_what_mta_cannot_do(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(dict(**{**BASE, **changes}))


def test_mta_runs_through_the_command_line(tmp_path, corpus_file, monkeypatch):
    from helpers import clean_fail, run, train_tiny
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "run", 6, "--attention", "mta", "--mta-ck", "5",
                     "--mta-mix")
    r = run(["generate", "--checkpoint", out, "--prompt", "the", "--max-new-tokens", "5", "--seed", "1"])
    assert r.exit_code == 0, r.output
    r = run(["info", out])
    assert r.exit_code == 0, r.output
    assert "2×5 key-query convolution in layers 0" in r.output and "head mixing" in r.output
    clean_fail(run(["export", out, "--out", tmp_path / "hf"]), 1, "no convolution over its score maps")
    clean_fail(run(["generate", "--checkpoint", out, "--prompt", "the", "--sparse", "topk"]), 2, "--sparse")
    clean_fail(run(["train", "--data", corpus_file, "--out", "f", "--attention", "mta", "--attn-impl", "flash"]),
               2, "flash")
    r = run(["bench", "--attention", "mta", "--n-layer", "1", "--n-ctx", "16", "--d-model", "16", "--n-head", "2",
             "--iters", "1", "--gen-tokens", "4", "--batch-size", "2", "--json"])
    assert r.exit_code == 0, r.output


def test_only_the_chosen_layers_carry_the_convolution():
    model = GPT(ModelConfig.from_dict(dict(**BASE, attention="mta", mta_layers="1", mta_mix=True)))
    names = set(model.params)
    assert "h.1.attn.mta.theta" in names and "h.0.attn.mta.theta" not in names
    assert {"h.0.attn.mta.mix", "h.1.attn.mta.mix"} <= names
    assert ModelConfig.from_dict(dict(**BASE, attention="mta")).attn_kernel == "dense"


def test_depth_scaling_multiplies_each_layers_normed_output_by_its_factor(rng):
    """1 - lambda(l), lambda(l) = 0.8 - 0.6 exp(-0.3 l): 0.8 at layer 0, falling towards 0.2 with depth."""
    from tbp.nn.designs.mta.map import depth_scale
    assert depth_scale(0) == pytest.approx(0.8) and depth_scale(1) == pytest.approx(1 - 0.8 + 0.6 * np.exp(-0.3))
    x = rng.standard_normal((2, 6, 16))
    cfg = dict(**BASE, attention="mta", mta_norm=True)
    for layer in (0, 1):
        plain, scaled = (GPT(ModelConfig.from_dict(dict(**cfg, mta_depth_scale=on)), seed=3, dtype=np.float64).blocks[layer].attn
                         for on in (False, True))
        for a in (plain, scaled):
            a.params["c_proj.bias"][...] = 0            # the bias is added after the scaling
        np.testing.assert_allclose(scaled.forward(x), depth_scale(layer) * plain.forward(x), rtol=1e-12)

