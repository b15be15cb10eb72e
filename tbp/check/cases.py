"""The instances ``tbp gradcheck`` checks: every layer under every engine option, then the whole
models, each a :class:`Case` (a scalar f and the tensors to probe); gradcheck.py checks them.

Each case builds a small random instance in float64 and defines f as a random projection of
the layer's output (``f = sum(out * w)``) or the model's loss; ``prepare`` runs the one
backward and names the tensors with their analytic gradients. The checker is gradcheck.py.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..nn.gpt import GPT, Block
from ..nn.lora import LORA_TARGETS, add_lora
from ..nn.mlp import MLP
from ..nn.attention import CausalSelfAttention
from ..nn.loss import CrossEntropy
from ..nn.embedding import Embedding
from ..nn.layernorm import LayerNorm
from ..nn.linear import Linear, LoRA
from ..nn.config import ModelConfig
from ..nn.kernels import padding_mask
from ..nn.build import VARIANTS, build_model, model_class as build_model_class

B, T = 2, 5         # batch and time > 1 everywhere, so cross-token and cross-sample terms show


@dataclass
class Target:
    """A tensor to probe: the array perturbed in place and its analytic gradient."""
    name: str
    value: np.ndarray
    grad: np.ndarray
    expect_zero: bool = False
    why_zero: str = "softmax shift invariance"


@dataclass
class Case:
    """A named instance to check: f() evaluates the scalar; targets are filled by prepare()."""
    layer: str
    f: Callable[[], float]
    prepare: Callable[[], list]          # runs the backward, returns [Target, ...]


def _targets(module, x=None, dx=None, H=None, Dk=None) -> list[Target]:
    """Every trainable tensor (and the input). With H and Dk, a fused attention bias is split
    into its query, key and value parts, and the key part is expected to be exactly zero: the
    key bias adds one constant to every score of a row, which the softmax ignores -- unless its
    layer says otherwise (``key_bias_inert`` False: positions rotated per key, or an MTA
    convolution that mixes the scores of different keys)."""
    owners = dict(module.modules())
    out = []
    for name, value in module.params.items():
        if name not in module.grads:
            continue   # frozen
        grad = module.grads[name]
        if name.endswith("c_kv.bias") and H is not None:
            # keys | values: the key part is exactly zero, as for self-attention
            gk, gv = grad[:H * Dk], grad[H * Dk:]
            out += [Target(name + "[k]", value[:H * Dk], gk, expect_zero=True),
                    Target(name + "[v]", value[H * Dk:], gv)]
        elif name.endswith("c_attn.bias") and H is not None:
            # split the fused bias [queries | keys | values] so the key part's zero shows on its own row
            attn = owners[name[:-len(".c_attn.bias")]]
            q_end, k_end = attn.n_head * attn.d_qk, (attn.n_head + attn.kv_heads) * attn.d_qk
            parts = [(name + "[q]", slice(0, q_end)), (name + "[k]", slice(q_end, k_end)),
                     (name + "[v]", slice(k_end, None))]
            out += [Target(label, value[cut], grad[cut], expect_zero=label.endswith("[k]") and attn.key_bias_inert)
                    for label, cut in parts]
        else:
            out.append(Target(name, value, grad))
    if x is not None:
        out.append(Target("x (input)", x, dx))
    return out


def _randomize(module, rng, scale: float = 0.3) -> None:
    """Replace the training init by O(1) random values, in place.

    GPT-2's init (std 0.02, zero biases, unit norms) puts every layer in its near-linear
    regime with tiny activations, where centred differences lose digits to curvature on
    the scale of eps and zero biases hide bias terms. Random O(1) values exercise every term.
    """
    for name, p in module.params.items():
        noise = rng.standard_normal(p.shape) * scale
        if name.endswith("query"):
            # Attention Residuals' pseudo-queries at half the scale: a sharper softmax over depth
            # left the centred difference's eps^2 term above rtol on one draw in eight
            # (1.5e-6 on wte, falling 100x per 10x smaller eps: curvature, not the gradient)
            noise *= 0.5
        p[...] = 1 + noise if name.endswith(("ln_1.weight", "ln_2.weight", "ln_cross.weight", "ln_f.weight",
                                             "res.gain", "res_f.gain")) \
            or (name == "weight" and isinstance(module, LayerNorm)) else noise


KINK_MARGIN = 1e-3


def _randomize_away_from_kinks(module, rng, forward) -> None:
    """Randomize, redrawing until every ReLU input is at least KINK_MARGIN from zero.

    ReLU has no derivative at 0: a probe of +-eps that moves an input across it measures a
    jump, not a slope. With a margin 100x eps no single probe can reach the kink.
    """
    relus = [m for _, m in module.modules() if isinstance(m, MLP) and m.activation == "relu"]
    for _ in range(100):
        _randomize(module, rng)
        forward()
        if all(np.abs(m.cache).min() > KINK_MARGIN for m in relus):
            return
    raise RuntimeError("could not draw ReLU inputs away from the kink")


def _projected_case(layer: str, module, x: np.ndarray, rng, H=None, Dk=None) -> Case:
    """f = sum(module.forward(x) * w) for a fixed random w; dout = w."""
    _randomize_away_from_kinks(module, rng, lambda: module.forward(x))
    w = rng.standard_normal(module.forward(x).shape)

    def f():
        return float(np.sum(module.forward(x) * w))

    def prepare():
        module.zero_grad()
        module.forward(x)
        dx = module.backward(w.copy())
        return _targets(module, x, dx, H, Dk)

    return Case(layer, f, prepare)


def _embedding_case(rng) -> Case:
    emb = Embedding(7, 8, 6, rng, np.float64)
    _randomize(emb, rng)
    idx = np.array([[1, 3, 3, 0, 6], [3, 1, 2, 2, 5]])     # repeated tokens must accumulate
    w = rng.standard_normal((B, T, 6))

    def f():
        return float(np.sum(emb.forward(idx) * w))

    def prepare():
        emb.zero_grad()
        emb.forward(idx)
        emb.backward(w.copy())
        return _targets(emb)

    return Case("embedding [repeated ids]", f, prepare)


def _loss_case(rng) -> Case:
    V = 7
    logits = rng.standard_normal((B, T, V)) * 2
    targets = rng.integers(0, V, (B, T))
    ce = CrossEntropy()

    def f():
        return ce.forward(logits, targets)

    def prepare():
        ce.forward(logits, targets)
        return [Target("logits (input)", logits, ce.backward())]

    return Case("cross-entropy", f, prepare)


def _weighted_loss_case(rng) -> Case:
    """The masked loss sum(w CE) / sum(w) with random weights, some exactly zero."""
    V = 7
    logits = rng.standard_normal((B, T, V)) * 2
    targets = rng.integers(0, V, (B, T))
    weights = rng.random((B, T)) * (rng.random((B, T)) > 0.3)
    weights[0, 0] = 1.0
    ce = CrossEntropy()

    def f():
        return ce.forward(logits, targets, weights)

    def prepare():
        ce.forward(logits, targets, weights)
        return [Target("logits (input)", logits, ce.backward())]

    return Case("cross-entropy [weights]", f, prepare)


S_SRC = 7           # source length != target length T, the last position padded in row 0


def _padded(rng, C: int):
    """A source (B, S_SRC, C) whose last position in row 0 is padding, and its key mask."""
    pad = np.zeros((B, S_SRC), bool)
    pad[0, -1] = True
    return rng.standard_normal((B, S_SRC, C)), padding_mask(pad, np.float64)


def _encoder_attention_case(rng, C: int, H: int) -> Case:
    """Non-causal self-attention over a padded source: f = sum(attn(x, mask) * w)."""
    attn = CausalSelfAttention(C, H, 4, C // H, rng, np.float64, True, causal=False)
    x, mask = _padded(rng, C)
    _randomize(attn, rng)
    w = rng.standard_normal(x.shape)
    w[0, -1] = 0         # a padded position's own output is ignored downstream

    def f():
        return float(np.sum(attn.forward(x, mask) * w))

    def prepare():
        attn.zero_grad()
        attn.forward(x, mask)
        dx = attn.backward(w.copy())
        return _targets(attn, x, dx, H, 4) + [
            Target("x[padded] (input)", x[0, -1], dx[0, -1], expect_zero=True, why_zero="a masked key")]

    return Case("attention [non-causal, key padding]", f, prepare)


def _cross_case(layer: str, module, rng, C: int, H: int, Dk: int) -> Case:
    """f = sum(module(x, m, mask) * w) for the cross-attention layer or a decoder block: the
    gradient reaches the decoder's stream x (B, T, C) and the memory m (B, S, C), whose padded
    position gets exactly zero."""
    x = rng.standard_normal((B, T, C))
    m, mask = _padded(rng, C)
    _randomize(module, rng)
    w = rng.standard_normal(module.forward(x, m, mask).shape)

    def f():
        return float(np.sum(module.forward(x, m, mask) * w))

    def prepare():
        module.zero_grad()
        module.forward(x, m, mask)
        dx, dm = module.backward(w.copy())
        return _targets(module, x, dx, H, Dk) + [
            Target("m (memory)", m, dm),
            Target("m[padded] (memory)", m[0, -1], dm[0, -1], expect_zero=True, why_zero="a masked key")]

    return Case(layer, f, prepare)


def _pairs_case(layer: str, cfg: ModelConfig, rng) -> Case:
    """A whole model that reads only pairs (its collation refuses text), on random pairs of
    different lengths laid out by its collation: the padding, and the loss mask on it, are
    the architecture's own. For the encoder-decoder, every decoder layer reads the same
    memory, so the encoder's gradients check the sum over layers."""
    model = build_model(cfg, seed=int(rng.integers(1 << 31)), dtype=np.float64)
    sep, eot = cfg.vocab_size - 2, cfg.vocab_size - 1          # any ids: the collation only places them
    lengths = ((S_SRC, T - 1), (S_SRC - 2, T - 2))             # row 1 shorter: padded source and target
    pairs = [(rng.integers(1, sep, s), rng.integers(1, sep, t)) for s, t in lengths]
    batch = model.collation.collate(pairs, sep, eot, model.pad_id)
    _randomize_away_from_kinks(model, rng, lambda: model.batch_loss(batch))

    def f():
        return model.batch_loss(batch)

    def prepare():
        model.zero_grad()
        model.batch_accumulate(batch)
        return _targets(model, H=cfg.n_head, Dk=cfg.d_qk)

    return Case(layer, f, prepare)


def _part_case(label: str, make, rng) -> Case:
    """A part a design checks on its own (Variant.part_cases): make(rng, dtype) -> (module, f,
    backward); f() the scalar, backward() runs the module's backward and gives
    [(name, input, its gradient)] beside the module's parameters."""
    module, f, backward = make(rng, np.float64)

    def prepare():
        module.zero_grad()
        f()
        return _targets(module) + [Target(name, value, grad) for name, value, grad in backward()]
    return Case(label, f, prepare)


def _model_case(layer: str, cfg: ModelConfig, rng, lora_rank: int = 0, weighted: bool = False) -> Case:
    model = GPT(cfg, seed=int(rng.integers(1 << 31)), dtype=np.float64)
    if lora_rank:
        add_lora(model, lora_rank, 1.5 * lora_rank, LORA_TARGETS, seed=int(rng.integers(1 << 31)))
    idx = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    # random O(1) values everywhere; for LoRA that makes lora_up nonzero, without which
    # dlora_down = 0 and its check would prove nothing
    _randomize_away_from_kinks(model, rng, lambda: model.forward(idx))
    # completion-only training: no loss on a prompt (weight 0), random positive weights elsewhere
    weights = (rng.random((B, T)) + 0.5) * (np.arange(T) >= 2) if weighted else None

    # dropout: the same row seeds at every evaluation, so the masks are fixed and f is smooth
    noise = rng.integers(0, 1 << 31, B) if cfg.dropout else None

    def f():
        return model.loss(idx, targets, weights, noise)

    def prepare():
        model.loss_and_backward(idx, targets, weights, noise)
        return _targets(model, H=cfg.n_head, Dk=cfg.d_qk)

    return Case(layer, f, prepare)


def _d_qk(layer) -> int | None:
    """The query/key width of the first attention inside ``layer`` (itself, or a block's)."""
    return next((m.d_qk for _, m in layer.modules() if hasattr(m, "d_qk")), None)


def cases(rng: np.random.Generator) -> list[Case]:
    """Every layer under every engine option, then the whole model under each option."""
    f64 = np.float64
    C, H = 8, 2
    x = lambda: rng.standard_normal((B, T, C))
    out = [_embedding_case(rng)]
    for bias in (True, False):
        out.append(_projected_case(f"linear [bias={'on' if bias else 'off'}]",
                                   Linear(C, 6, rng, f64, bias), x(), rng))
    lin = Linear(C, 6, rng, f64, True)
    lora = LoRA(lin, rank=3, alpha=6.0, rng=rng)
    out.append(_projected_case("lora [rank 3, up != 0]", lora, x(), rng))
    for eps, bias in ((1e-5, True), (0.0, True), (1e-5, False)):
        out.append(_projected_case(f"layernorm [{f'eps={eps:g}' if bias else 'no bias'}]",
                                   LayerNorm(C, eps, f64, bias), x(), rng))
    for label, dk, bias, causal in (("causal", 4, True, True), ("d_qk=3 != d_v=4", 3, True, True),
                                    ("no biases", 4, False, True), ("non-causal", 4, True, False)):
        attn = CausalSelfAttention(C, H, dk, C // H, rng, f64, bias, causal)
        out.append(_projected_case(f"attention [{label}]", attn, x(), rng, H=H if bias else None, Dk=dk))
    # causal query blocks of 2 rows over T = 5: rows 0-1 read keys 0-1, rows 2-4 read all five
    attn = CausalSelfAttention(C, H, 4, C // H, rng, f64, split_rows=2)
    out.append(_projected_case("attention [causal, query blocks]", attn, x(), rng, H=H, Dk=4))
    # each variant's own layers (nn/variant.py): the flash kernel, rotary positions, Multi-Token
    # Attention, grouped-query attention, ...
    # a declaration's cases draw from their own generator, seeded by the run's seed and the
    # case's label: the order in which designs register does not change any case's numbers
    variants_seed = int(rng.integers(1 << 31))
    own = lambda label: np.random.default_rng([variants_seed, zlib.crc32(label.encode())])
    for variant in VARIANTS:
        for label, make in variant.cases("layer_cases"):
            mine = own(label)
            layer = make(C, H, mine, f64)
            out.append(_projected_case(label, layer, mine.standard_normal((B, T, C)), mine, H=H, Dk=_d_qk(layer)))
    for act in ("gelu", "relu"):
        out.append(_projected_case(f"mlp [{act}]", MLP(C, rng, f64, True, act), x(), rng))
    blk_cfg = ModelConfig(vocab_size=7, n_ctx=8, n_layer=1, n_head=H, d_model=C)
    out.append(_projected_case("block [pre-LN]", Block(blk_cfg, rng, f64), x(), rng, H=H, Dk=4))
    out.append(_encoder_attention_case(rng, C, H))
    for variant in VARIANTS:
        for label, make in variant.cases("memory_cases"):
            mine = own(label)
            layer = make(C, H, mine, f64)
            out.append(_cross_case(label, layer, mine, C, H, _d_qk(layer)))
    for variant in VARIANTS:
        for label, make in variant.cases("part_cases"):
            out.append(_part_case(label, make, own(label)))
    out.append(_loss_case(rng))
    out.append(_weighted_loss_case(rng))
    base = dict(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=8)
    for label, extra in (("tied head", {}),
                         ("untied head + bias", {"tie_head": False}),
                         ("relu, ln eps 0", {"activation": "relu", "ln_eps": 0.0}),
                         ("no biases", {"bias": False}),
                         ("d_qk=2 != d_v=4", {"d_qk": 2})):
        out.append(_model_case(f"gpt [{label}]", ModelConfig.from_dict({**base, **extra}), rng))
    out.append(_model_case("gpt + lora [r=2, up != 0]", ModelConfig(**base, tie_head=False), rng,
                           lora_rank=2))
    out.append(_model_case("gpt [masked loss]", ModelConfig(**base), rng, weighted=True))
    for variant in VARIANTS:
        for label, fields in variant.cases("model_cases"):
            cfg = ModelConfig.from_dict(dict(base, **fields))
            pairs_only = build_model_class(cfg).collation.refuses is not None
            out.append((_pairs_case if pairs_only else _model_case)(label, cfg, own(label)))
    return out
