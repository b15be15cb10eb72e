"""Grouped-query attention: its plain twin, standard attention as its H = Hkv case, the KV cache
n_head / n_kv_head times smaller, cached and sparse decoding, and the refusals."""
import numpy as np
import pytest
from helpers import assert_equals_twin

from tbp import GPT, ModelConfig
from tbp.errors import TbpError
from tbp.nn.attention import CausalSelfAttention
from tbp.nn.config import ConfigError
from tbp.nn.designs.sparse import twin as sparse_twin
from tbp.nn.designs.gqa.gqa import GroupedQueryAttention
from tbp.nn.designs.gqa import twin as gqa_twin
from tbp.nn.designs.rope.rope import Rotary
from tbp.nn.designs.rope import twin as rope_twin
from tbp.nn.designs.sparse.sparse import SparseRule
from tbp.nn.decode import Inference

B, T, C = 2, 7, 16


def randomize(module, rng, scale=0.5):
    for p in module.params.values():
        p[...] = rng.standard_normal(p.shape) * scale


@pytest.mark.parametrize("n_kv_head,options", [
    (2, {}), (1, {}), (4, {}), (2, {"bias": False}), (1, {"causal": False}),
    (2, {"impl": "flash", "tiles": (2, 3)}), (2, {"split_rows": 2}), (1, {"rope": True}),
    (2, {"rope": True, "impl": "flash", "tiles": (3, 2)})], ids=str)
def test_the_layer_equals_its_plain_twin_forward_and_backward(rng, n_kv_head, options):
    options = dict(options)
    rope = options.pop("rope", False)
    layer = GroupedQueryAttention(C, 4, 4, C // 4, rng, np.float64, n_kv_head,
                                  **({"positions": Rotary(4)} if rope else {}), **options)
    randomize(layer, rng)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    layer.zero_grad()
    y = layer.forward(x)
    dx = layer.backward(dy.copy())
    P = layer.params
    y_ref, cache = gqa_twin.gqa_attention_forward(x, P["c_attn.weight"], P.get("c_attn.bias"), P["c_proj.weight"],
                                              P.get("c_proj.bias"), 4, n_kv_head, 4, options.get("causal", True),
                                              rope_twin.rotation(10000.0) if rope else None)
    assert_equals_twin(layer, y, dx, y_ref, *gqa_twin.gqa_attention_backward(dy, cache))


def test_with_a_key_value_head_per_query_head_it_is_standard_attention(rng):
    gqa = GroupedQueryAttention(C, 4, 4, 4, rng, np.float64, 4)
    std = CausalSelfAttention(C, 4, 4, 4, rng, np.float64)
    randomize(gqa, rng)
    for k, p in std.params.items():
        p[...] = gqa.params[k]
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    np.testing.assert_array_equal(gqa.forward(x), std.forward(x))
    np.testing.assert_array_equal(gqa.backward(dy.copy()), std.backward(dy.copy()))
    for k, g in std.grads.items():
        np.testing.assert_array_equal(gqa.grads[k], g)


def gqa_model(n_kv_head=2, **kw):
    cfg = dict(vocab_size=13, n_ctx=48, n_layer=3, n_head=4, d_model=16, attention="gqa", n_kv_head=n_kv_head)
    cfg.update(kw)
    m = GPT(ModelConfig.from_dict(dict(**cfg)), seed=1, dtype=np.float64)
    randomize(m, np.random.default_rng(2), 0.3)
    return m


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_the_kv_cache_is_n_head_over_n_kv_head_times_smaller(n_kv_head):
    """Measured: the bytes the Inference's caches hold, against standard attention's."""
    std = Inference(GPT(ModelConfig(vocab_size=13, n_ctx=48, n_layer=3, n_head=4, d_model=16), dtype=np.float64), 2)
    gqa = Inference(gqa_model(n_kv_head), 2)
    assert std.cache_bytes == 4 // n_kv_head * gqa.cache_bytes
    assert gqa.cache_bytes == gqa.cache_size(gqa.model, 2)
    assert {a.shape[1] for _, name, a in gqa.caches()} == {n_kv_head}            # (B, Hkv, ., .)


@pytest.mark.parametrize("options", [{}, {"positions": "rope", "n_ctx": 16}, {"n_kv_head": 1, "tie_head": False}],
                         ids=str)
def test_cached_decoding_equals_the_full_forward_at_every_step(rng, options):
    m = gqa_model(**options)
    tokens = rng.integers(0, 13, (3, 16))
    full = m.forward(tokens)
    dec = Inference(m, 3)
    steps = [dec.forward(tokens[:, :5]).copy()] + [dec.forward(tokens[:, t:t + 1]).copy() for t in range(5, 16)]
    np.testing.assert_allclose(np.concatenate(steps, 1), full, rtol=0, atol=1e-12)


def test_rope_decoding_slides_past_the_context(rng):
    m = gqa_model(positions="rope", n_ctx=8, n_layer=1)
    tokens = rng.integers(0, 13, (1, 20))
    dec = Inference(m, 1)
    dec.forward(tokens[:, :8])
    for t in range(8, 20):                      # the ring of slots equals sliding-window attention
        got = dec.forward(tokens[:, t:t + 1])[:, -1]
        np.testing.assert_allclose(got, m.forward(tokens[:, t - 7:t + 1])[:, -1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["lessismore", "topk", "window"])
def test_sparse_decoding_chooses_per_key_value_group(rng, kind):
    """The kept set is one per key/value group (B, Hkv, K), the selection rule applied to the
    group's query heads together; a budget covering every position is dense bit for bit."""
    m = gqa_model(n_kv_head=2)
    tokens = rng.integers(0, 13, (2, 40))
    sparse = Inference(m, 2, SparseRule(kind, budget=12, layers=(1,)))
    dense, full = Inference(m, 2), Inference(m, 2, SparseRule(kind, budget=48, layers=(1,)))
    for d in (sparse, dense, full):
        d.forward(tokens[:, :4])
    for t in range(4, 40):
        got = sparse.forward(tokens[:, t:t + 1])
        np.testing.assert_array_equal(full.forward(tokens[:, t:t + 1]), dense.forward(tokens[:, t:t + 1]))
        assert np.isfinite(got).all()
        if t + 1 <= 12:
            continue
        assert sparse.last.keep.shape == (2, 2, 12)
        scores = sparse.last.scores.reshape(2 * 2, 2, t + 1)              # (B Hkv, G, t)
        if kind == "topk":
            scores = scores.max(axis=1, keepdims=True)
        want = sparse_twin.select_positions(scores, kind, 12)
        np.testing.assert_array_equal(sparse.last.keep.reshape(4, -1), np.array(want).reshape(4, -1))


@pytest.mark.parametrize("changes,message", [
    (dict(n_kv_head=3), "must divide n_head"),
    (dict(n_kv_head=None), "needs --n-kv-head"),
    (dict(attention="standard"), "pass --attention gqa"),
    (dict(arch="encoder-decoder"), "grouped-query attention is built for the GPT"),
])
def test_the_config_refusals(changes, message):
    cfg = dict(vocab_size=13, n_ctx=8, n_layer=1, n_head=4, d_model=16, attention="gqa", n_kv_head=2)
    cfg.update(changes)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(dict(**cfg))


def test_export_to_gpt2_is_refused_with_the_reason():
    from tbp.interop.hf import exportable
    with pytest.raises(TbpError, match="attention = gqa .*a key and a value head for every query head"):
        exportable(ModelConfig.from_dict(dict(vocab_size=13, n_ctx=8, n_layer=1, n_head=4, d_model=16, attention="gqa",
                               n_kv_head=2)))


def test_train_info_and_generate_from_the_cli(tmp_path, corpus_file):
    from click.testing import CliRunner
    from tbp.cli.main import main
    run = lambda args: CliRunner().invoke(main, args, catch_exceptions=False)
    out = str(tmp_path / "r")
    r = run(["train", "--data", str(corpus_file), "--out", out, "--attention", "gqa", "--n-kv-head", "1",
             "--n-layer", "1", "--n-head", "4", "--d-model", "16", "--n-ctx", "16", "--max-iters", "3",
             "--eval-interval", "3", "--batch-size", "2"])
    assert r.exit_code == 0, r.output
    r = run(["info", out])
    assert r.exit_code == 0 and "grouped-query" in r.output and "1 key/value head for 4 query heads" in r.output
    r = run(["generate", "--checkpoint", out, "--max-new-tokens", "8", "--seed", "1", "--sparse", "lessismore",
             "--budget", "6", "--sparse-layers", "0"])
    assert r.exit_code == 0, r.output


# --- converting a full-head model: mean-pooled key/value heads (uptraining's start) --------
def full_head_model(**kw):
    cfg = dict(vocab_size=13, n_ctx=16, n_layer=2, n_head=4, d_model=16)
    cfg.update(kw)
    m = GPT(ModelConfig.from_dict(dict(**cfg)), seed=1, dtype=np.float64)
    randomize(m, np.random.default_rng(2), 0.3)
    return m


def kv_columns(cfg, weight, head, which):
    """The columns of c_attn holding key (which=0) or value (1) head ``head``."""
    H, Hs, D = cfg.n_head, cfg.designs["gqa"].n_kv_head or cfg.n_head, cfg.d_qk
    start = H * D + which * Hs * D + head * D
    return weight[..., start:start + D]


def test_pooled_heads_are_the_means_of_their_groups():
    from tbp.nn.designs.gqa.gqa import pool_kv_heads
    src = full_head_model()
    pooled = pool_kv_heads(src, 2)
    assert (pooled.config.attention, pooled.config.designs["gqa"].n_kv_head) == ("gqa", 2)
    for name in ("h.1.attn.c_attn.weight", "h.1.attn.c_attn.bias"):
        w, p = src.params[name], pooled.params[name]
        q = src.config.n_head * src.config.d_qk
        np.testing.assert_array_equal(p[..., :q], w[..., :q])                    # the queries are kept
        for which in (0, 1):
            for j, group in enumerate(((0, 1), (2, 3))):
                mean = (kv_columns(src.config, w, group[0], which) + kv_columns(src.config, w, group[1], which)) / 2
                np.testing.assert_allclose(kv_columns(pooled.config, p, j, which), mean, rtol=1e-15, atol=0)
    for name, p in src.params.items():
        if "c_attn" not in name:
            np.testing.assert_array_equal(pooled.params[name], p)


@pytest.mark.parametrize("source,n_kv_head", [({}, 4), ({}, 2), ({}, 1), ({"positions": "rope"}, 2),
                                               ({"attention": "gqa", "n_kv_head": 2}, 1)], ids=str)
def test_a_model_whose_grouped_heads_agree_computes_the_same_after_pooling(source, n_kv_head):
    """Pooling changes nothing where the heads of a group are already equal; where they are not,
    the model changes (so the equality is not vacuous)."""
    from tbp.nn.designs.gqa.gqa import pool_kv_heads
    src = full_head_model(**source)
    idx = np.random.default_rng(3).integers(0, 13, (2, 16))
    Hs = src.config.designs["gqa"].n_kv_head or src.config.n_head
    R = Hs // n_kv_head
    if R > 1:
        np.testing.assert_raises(AssertionError, np.testing.assert_allclose,
                                 pool_kv_heads(src, n_kv_head).forward(idx), src.forward(idx), rtol=1e-6)
    for name, w in src.params.items():
        if name.endswith("c_attn.weight") or name.endswith("c_attn.bias"):
            for which in (0, 1):
                for i in range(Hs):
                    kv_columns(src.config, w, i, which)[...] = kv_columns(src.config, w, i - i % R, which)
    np.testing.assert_allclose(pool_kv_heads(src, n_kv_head).forward(idx), src.forward(idx), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("changes,n_kv_head,message", [
    ({}, 3, "must divide the model's 4 key/value heads"),
    ({"attention": "gqa", "n_kv_head": 2}, 4, "must divide the model's 2 key/value heads"),
    ({"attention": "mta"}, 2, "standard or grouped-query attention, not gpt with mta"),
])
def test_pooling_refuses_what_it_cannot_pool(changes, n_kv_head, message):
    from tbp.nn.designs.gqa.gqa import pool_kv_heads
    with pytest.raises(ValueError, match=message):
        pool_kv_heads(full_head_model(**changes), n_kv_head)


def test_a_fine_tune_into_grouped_query_attention_starts_from_the_pooled_heads(tmp_path, corpus_file):
    """`tbp train --init-from RUN --attention gqa --n-kv-head K`: uptraining, from the base run's
    key/value heads mean-pooled; K must divide them, and the other shape options stay refused."""
    from click.testing import CliRunner
    from tbp.runs import disk
    from tbp.train import launch
    from tbp.cli.main import main
    from tbp.nn.designs.gqa.gqa import pool_kv_heads
    run = lambda args: CliRunner().invoke(main, args, catch_exceptions=False)
    tiny = ["--n-layer", "1", "--n-head", "4", "--d-model", "16", "--n-ctx", "16", "--eval-interval", "3",
            "--batch-size", "2"]
    full = str(tmp_path / "full")
    assert run(["train", "--data", str(corpus_file), "--out", full, "--max-iters", "3", *tiny]).exit_code == 0
    trainer = launch.start(launch.RunRequest(out=tmp_path / "up", data=str(corpus_file), init_from=tmp_path / "full",
                                         model={"attention": "gqa", "n_kv_head": 2}, train={"max_iters": 2}))
    want = pool_kv_heads(disk.load_model(full)[0], 2)
    assert trainer.model.config == want.config
    for name, p in want.params.items():
        np.testing.assert_array_equal(trainer.model.params[name], p)
    trainer.lock.release()
    r = run(["train", "--data", str(corpus_file), "--init-from", full, "--out", str(tmp_path / "mqa"),
             "--attention", "gqa", "--n-kv-head", "1", "--max-iters", "2", "--eval-interval", "2"])
    assert r.exit_code == 0, r.output
    assert "1 key/value head for 4 query heads" in run(["info", str(tmp_path / "mqa")]).output
    r = CliRunner().invoke(main, ["train", "--data", str(corpus_file), "--init-from", full, "--out",
                                  str(tmp_path / "x"), "--attention", "gqa", "--n-kv-head", "3"])
    assert r.exit_code == 2 and "n_kv_head (3) must divide n_head (4)" in r.output
    r = CliRunner().invoke(main, ["train", "--data", str(corpus_file), "--init-from", str(tmp_path / "mqa"), "--out",
                                  str(tmp_path / "x"), "--attention", "gqa", "--n-kv-head", "2"])
    assert r.exit_code == 2 and "--n-kv-head 2" in r.output and "must divide the model's 1 key/value heads" in r.output
    r = CliRunner().invoke(main, ["train", "--data", str(corpus_file), "--init-from", full, "--out",
                                  str(tmp_path / "x"), "--attention", "gqa", "--n-kv-head", "2", "--n-head", "2"])
    assert r.exit_code == 2 and "a model's shape is fixed once trained" in r.output
    assert not (tmp_path / "x").exists()


def test_adapters_on_pooled_heads_are_refused_before_a_run_nothing_could_load(tmp_path, corpus_file):
    """LoRA trains adapters on the base's own weights; pooling its key/value heads makes new
    ones that no file would hold: refused up front, nothing written."""
    from helpers import clean_fail, run
    tiny = ["--n-layer", "1", "--n-head", "4", "--d-model", "16", "--n-ctx", "16", "--batch-size", "2"]
    full = tmp_path / "full"
    assert run(["train", "--data", corpus_file, "--out", full, "--max-iters", "2", *tiny]).exit_code == 0
    clean_fail(run(["train", "--data", corpus_file, "--init-from", full, "--out", tmp_path / "lora",
                    "--attention", "gqa", "--n-kv-head", "2", "--lora-rank", "2", "--max-iters", "2"]),
               2, "--n-kv-head 2")
    assert not (tmp_path / "lora").exists()
