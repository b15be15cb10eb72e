"""Every registered design through the same checks, as a model zoo tests every registered model:
each positions scheme of the registry (learned, rope and whatever the designs add) must give the
same numbers with every kernel, decode from its cache what the full forward computes (past the
context too, where it slides), decode rows at their own positions as alone, and have its
gradient rows pass; every declaration's model cases build and decode."""
import numpy as np
import pytest

from tbp.nn.gpt import GPT
from tbp.nn.config import ConfigError, ModelConfig
from tbp.nn import build, registry
from tbp.nn.decode import Inference
import helpers

SCHEMES = sorted(registry.POSITIONS)


def model(positions: str, **kw) -> GPT:
    cfg = dict(vocab_size=13, n_ctx=12, n_layer=2, n_head=2, d_model=8, positions=positions)
    cfg.update(kw)
    return GPT(ModelConfig.from_dict(dict(**cfg)), seed=1, dtype=np.float64)


def test_the_registry_knows_the_built_in_schemes_and_the_config_reads_it():
    assert {"learned", "rope"} <= set(SCHEMES)
    with pytest.raises(Exception, match="positions must be one of " + ", ".join(registry.POSITIONS)):
        ModelConfig(positions="no-such-scheme")


@pytest.mark.parametrize("positions", SCHEMES)
def test_every_kernel_gives_the_same_numbers(positions):
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, 13, (2, 12)), rng.integers(0, 13, (2, 12))
    got = []
    for impl, rows in (("dense", 64), ("dense", 5), ("flash", None)):
        m = model(positions, attn_impl=impl)
        for block in m.blocks:
            if rows:
                block.attn.kernel.rows = rows              # query blocks of 5 rows: several blocks
            else:
                block.attn.kernel.tiles = (5, 7)           # several flash tiles across the diagonal
        m.zero_grad()
        loss = m.loss_and_backward(tokens, targets)
        got.append((loss, m.layout.grads.copy()))
    for loss, grads in got[1:]:
        np.testing.assert_allclose(loss, got[0][0], rtol=1e-12)
        np.testing.assert_allclose(grads, got[0][1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("positions", SCHEMES)
def test_cached_decoding_equals_the_full_forward_and_slides_where_it_can(positions):
    m = model(positions)
    n = 12 if "wpe" in m.embed.params else 30           # without a position table: 18 tokens past the context
    tokens = np.random.default_rng(2).integers(0, 13, (2, n))
    full = m.forward(tokens)
    dec = Inference(m, 2)
    steps = [dec.forward(tokens[:, :4]).copy()] + [dec.forward(tokens[:, t:t + 1]).copy() for t in range(4, n)]
    np.testing.assert_allclose(np.concatenate(steps, 1), full, rtol=1e-10, atol=1e-12)
    assert m.slides == (n > 12)


@pytest.mark.parametrize("positions", SCHEMES)
def test_rows_at_their_own_positions_decode_as_alone(positions):
    m = model(positions)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 13, k) for k in (3, 6, 1)]
    together, one = Inference(m, 3), Inference(m, 1)
    alone = [Inference(m, 1) for _ in prompts]
    for b, p in enumerate(prompts):
        one.reset()
        one.forward(p[None])
        together.load_row(b, one)
        alone[b].forward(p[None])
    pos = np.array([len(p) for p in prompts])
    for tokens in rng.integers(0, 13, (4, 3)):
        got = together.step_rows(tokens, pos).copy()
        for b in range(3):
            np.testing.assert_allclose(got[b], alone[b].forward(np.array([[tokens[b]]]))[0, -1], rtol=1e-10,
                                       atol=1e-12)
        pos += 1


@pytest.mark.parametrize("variant", [v for v in build.VARIANTS if v.cases("model_cases")], ids=lambda v: v.key)
def test_every_declared_model_case_builds_with_its_variant_on_and_decodes_as_it_forwards(variant):
    """Each declaration's model cases (tbp gradcheck runs their gradient rows:
    tests/test_gradcheck.py) build with the variant on, and a GPT among them decodes from its
    cache exactly what its full forward computes."""
    for label, fields in variant.cases("model_cases"):
        cfg = dict(vocab_size=11, n_ctx=6, n_layer=2, n_head=2, d_model=8)
        cfg.update(fields)
        m = build.build_model(ModelConfig.from_dict(dict(**cfg)), seed=0, dtype=np.float64)
        assert any(v is variant for v in build.active(m.config)), label
        if m.config.arch != "gpt":
            continue
        tokens = np.random.default_rng(3).integers(0, 11, (2, 6))
        dec = Inference(m, 2)
        steps = [dec.forward(tokens[:, :2]).copy()] + [dec.forward(tokens[:, t:t + 1]).copy() for t in range(2, 6)]
        np.testing.assert_allclose(np.concatenate(steps, 1), m.forward(tokens), rtol=1e-10, atol=1e-12,
                                   err_msg=label)


@pytest.mark.parametrize("variant", build.VARIANTS, ids=lambda v: v.key)
def test_every_refusal_is_a_sentence_and_names_a_variant_or_a_use(variant):
    keys = {v.key for v in build.VARIANTS}
    for other, why in variant.refuses.items():
        assert other in keys or other in registry.USES, other
        assert len(why.split()) >= 4 and not why.endswith("."), why


def test_a_kernel_registered_from_outside_is_a_choice_of_attn_impl():
    """The kernel axis of the registry: a kernel registered by name becomes a value of
    attn_impl (config and command line), and the layer runs it; here the dense kernel under a
    second name, which must give the dense kernel's numbers exactly."""
    from tbp.nn.config import ATTN_IMPLS
    registry.kernel("test-dense")(registry.KERNEL["dense"])
    try:
        assert "test-dense" in ATTN_IMPLS and "test-dense" in list(ATTN_IMPLS)
        base = dict(vocab_size=13, n_ctx=16, n_layer=1, n_head=2, d_model=8)
        idx = np.random.default_rng(0).integers(0, 13, (2, 16))
        want = GPT(ModelConfig.from_dict(dict(**base, attn_impl="dense")), seed=3, dtype=np.float64).forward(idx)
        got = GPT(ModelConfig.from_dict(dict(**base, attn_impl="test-dense")), seed=3, dtype=np.float64).forward(idx)
        np.testing.assert_array_equal(got, want)
    finally:
        del registry.KERNEL["test-dense"]
    with pytest.raises(ConfigError, match="attn_impl must be one of auto, dense, flash"):
        ModelConfig(attn_impl="test-dense")


@pytest.mark.design(*helpers.DESIGN_WORDS)      # the whole wing's: a refusal may name any design
def test_the_variant_declarations_are_consistent():
    """Every refusal names a variant or a use, no two variants share a key, and every config
    value of an axis has its class in the registry."""
    from tbp.nn import build, config
    assert build.declarations_are_consistent() == []
    assert set(build.ATTENTION) == set(config.ATTENTIONS) and set(build.RESIDUAL) == set(config.RESIDUALS)
    assert set(build.ARCH) == set(config.ARCHS)
