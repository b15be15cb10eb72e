"""ALiBi positions (tbp/nn/designs/alibi): the slopes, the layer against its plain twin under
every kernel, the twin's own cached loop, the refusals, and a run from the command line. The
checks every positions scheme passes (kernels agree, cached decoding past the context, rows at
their own positions, gradient rows) are tests/test_designs.py's."""
import numpy as np
import pytest
from helpers import assert_equals_twin

from tbp import GPT, ModelConfig
from tbp.errors import TbpError
from tbp.nn.attention import CausalSelfAttention
from tbp.nn.config import ConfigError
from tbp.nn import build
from tbp.nn.designs.alibi.alibi import Alibi, slopes
from tbp.nn.designs.alibi import twin
from tbp.nn.designs.sparse.sparse import SparseRule
from tbp.nn.decode import Inference

B, T, C, H = 2, 9, 12, 3


def randomize(module, rng, scale=0.5):
    for p in module.params.values():
        p[...] = rng.standard_normal(p.shape) * scale


def test_the_slopes_are_the_papers():
    np.testing.assert_array_equal(slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_array_equal(slopes(4), 2.0 ** -np.array([2, 4, 6, 8]))
    # not a power of two: the 4-head slopes, then every other slope of the 8-head set
    np.testing.assert_array_equal(slopes(6), 2.0 ** -np.array([2, 4, 6, 8, 1, 3]))
    np.testing.assert_array_equal(slopes(1), [2.0 ** -8])


@pytest.mark.parametrize("options", [{}, {"split_rows": 2}, {"impl": "flash", "tiles": (2, 3)},
                                     {"window": 4}, {"impl": "flash", "tiles": (3, 2), "window": 4}], ids=str)
def test_the_layer_equals_its_plain_twin_forward_and_backward(rng, options):
    layer = CausalSelfAttention(C, H, 4, C // H, rng, np.float64, positions=Alibi(H), **options)
    randomize(layer, rng)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    layer.zero_grad()
    y = layer.forward(x)
    dx = layer.backward(dy.copy())
    P = layer.params
    y_ref, cache = twin.alibi_attention_forward(x, P["c_attn.weight"], P["c_attn.bias"], P["c_proj.weight"],
                                                P["c_proj.bias"], H, 4, options.get("window"))
    assert_equals_twin(layer, y, dx, y_ref, *twin.alibi_attention_backward(dy, cache))


def test_a_bias_of_the_wrong_sign_or_none_differs_from_the_twin(rng):
    """The twin has teeth: the same layer with the bias flipped, or without it, is far from it."""
    class Flipped(Alibi):
        def bias(self, rows, keys, dtype):
            return -super().bias(rows, keys, dtype)
    x = rng.standard_normal((B, T, C))
    for positions in (Flipped(H), None):
        layer = CausalSelfAttention(C, H, 4, C // H, np.random.default_rng(0), np.float64,
                                    **({"positions": positions} if positions else {}))
        randomize(layer, np.random.default_rng(1))
        P = layer.params
        y_ref, _ = twin.alibi_attention_forward(x, P["c_attn.weight"], P["c_attn.bias"], P["c_proj.weight"],
                                                P["c_proj.bias"], H, 4)
        assert np.abs(layer.forward(x) - y_ref).max() > 1e-3


@pytest.mark.parametrize("window", [None, 4])
def test_the_twins_cached_loop_equals_its_full_forward(rng, window):
    layer = CausalSelfAttention(C, H, 4, C // H, rng, np.float64)
    randomize(layer, rng)
    P = layer.params
    w = (P["c_attn.weight"], P["c_attn.bias"], P["c_proj.weight"], P["c_proj.bias"])
    x = rng.standard_normal((B, T, C))
    full, _ = twin.alibi_attention_forward(x, *w, H, 4, window)
    cache = {"k": [np.zeros((B, 0, 4)) for _ in range(H)], "v": [np.zeros((B, 0, 4)) for _ in range(H)]}
    rows = [twin.alibi_attention_decode(x[:, t:t + 1], t, cache, *w, H, 4, window) for t in range(T)]
    np.testing.assert_allclose(np.concatenate(rows, axis=1), full, rtol=1e-12, atol=1e-13)


def test_a_model_has_no_position_table_and_reads_past_its_context(rng):
    m = GPT(ModelConfig(vocab_size=13, n_ctx=8, n_layer=2, n_head=4, d_model=16, positions="alibi"), dtype=np.float64)
    assert "wpe" not in m.embed.params and m.slides
    assert GPT.shapes(m.config) == GPT.shapes(ModelConfig(**{**m.config.to_dict(), "n_ctx": 64}))
    assert np.isfinite(m.forward(rng.integers(0, 13, (1, 40)))).all()


@pytest.mark.parametrize("changes,message", [
    (dict(attention="mta"), "Multi-Token Attention uses learned positions here .ALiBi"),
    (dict(arch="encoder-decoder"), "an encoder-decoder uses learned positions .ALiBi"),
])
def test_the_config_refusals(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(vocab_size=13, n_ctx=8, n_layer=1, n_head=2, d_model=8, positions="alibi", **changes)


def test_sparse_decoding_export_and_gguf_are_refused_with_the_reason():
    from tbp.interop.gguf import architecture
    from tbp.interop.hf import exportable
    cfg = ModelConfig(vocab_size=13, n_ctx=8, n_layer=1, n_head=2, d_model=8, positions="alibi")
    with pytest.raises(ValueError, match="without their ALiBi bias"):
        Inference(GPT(cfg), 1, SparseRule("topk", budget=4, layers=(0,)))
    assert "ALiBi" in build.refusal(cfg, "thin")
    with pytest.raises(TbpError, match="no linear bias on the scores"):
        exportable(cfg)
    with pytest.raises(TbpError, match="neither of which has ALiBi's bias"):
        architecture(cfg)


def test_train_info_and_generate_past_the_context_from_the_cli(tmp_path, corpus_file):
    from click.testing import CliRunner
    from tbp.cli.main import main
    run = lambda args: CliRunner().invoke(main, args, catch_exceptions=False)
    out = str(tmp_path / "r")
    r = run(["train", "--data", str(corpus_file), "--out", out, "--positions", "alibi", "--n-layer", "1",
             "--n-head", "2", "--d-model", "16", "--n-ctx", "16", "--max-iters", "3", "--eval-interval", "3",
             "--batch-size", "2"])
    assert r.exit_code == 0, r.output
    r = run(["info", out])
    assert r.exit_code == 0 and "alibi" in r.output and "linear biases, slopes 0.0625 .. 0.00390625" in r.output
    r = run(["generate", "--checkpoint", out, "--max-new-tokens", "40", "--seed", "1"])
    assert r.exit_code == 0, r.output


def test_a_flash_backward_that_forgets_the_bias_fails_the_gradient_check(monkeypatch):
    """Flash recomputes P in its backward: without the bias there, the gradients are wrong, and
    the alibi rows of tbp gradcheck say so."""
    from tbp.check import gradcheck
    from tbp.nn.designs.flash.flash import Flash, flash_backward

    def forgetful(self, dy, qs, k, v, y, saved, out):
        flash_backward(dy, qs, k, v, y, saved, self.causal, *self.tiles, out=out, window=self.window)
    rng = np.random.default_rng(0)
    case = next(c for c in gradcheck.cases(rng) if c.layer == "attention [alibi, flash in tiles, window 3]")
    assert all(r.passed for r in gradcheck.check_case(case, np.random.default_rng(0)))
    monkeypatch.setattr(Flash, "backward", forgetful)
    rows = gradcheck.check_case(case, np.random.default_rng(0))
    assert any(r.tensor == "x (input)" and not r.passed for r in rows)
