"""Every handwritten gradient against centred finite differences, in float64.

Each case (cases.py) builds a small random instance of a layer (or of a whole model),
defines a scalar f (a random projection of the layer's output, ``f = sum(out * w)``, or the model's
loss), computes the analytic gradient of f with one backward, and compares it with
``(f(p + eps) - f(p - eps)) / (2 eps)`` for:

* a random sample of entries of every tensor (all entries of small ones), and
* one random direction d over the whole tensor: ``<grad, d>`` against the directional
  difference, so every entry takes part even when only a sample is probed one by one.

Error measure (CS231n's, per tensor): ``max |a - n| / max(|a| + |n|)`` over the probed
entries, and ``|a_d - n_d| / max(|a_d| + |n_d|, |grad|)`` for the (unit) direction, whose
projection can be small by chance; the larger is reported.
The key bias's gradient is exactly zero in exact arithmetic (softmax ignores a shift of
its scores, paper §3.2), as is a padded key's: such a row passes when both gradients are
zero to ``zero_atol``.

This module is numbers only: the CLI renders the results.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
import numpy as np

from .cases import Case, Target
from .cases import cases as build


DEFAULT_EPS = 1e-5
DEFAULT_RTOL = 1e-6
ZERO_ATOL = 1e-8


@dataclass
class Row:
    """One tensor's verdict."""
    layer: str
    tensor: str
    shape: tuple
    checked: int           # entries probed one by one (plus one random direction)
    max_abs: float
    max_rel: float
    passed: bool
    note: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def check_case(case: Case, rng: np.random.Generator, eps: float = DEFAULT_EPS,
               rtol: float = DEFAULT_RTOL, max_entries: int = 24) -> list[Row]:
    rows = []
    for t in case.prepare():
        rows.append(_check_tensor(case, t, rng, eps, rtol, max_entries))
    return rows


def _check_tensor(case: Case, t: Target, rng, eps, rtol, max_entries) -> Row:
    flat, gflat = t.value.reshape(-1), t.grad.reshape(-1)
    if not np.shares_memory(flat, t.value):
        raise ValueError(f"{t.name}: cannot perturb a non-contiguous view in place")
    n = flat.size
    probe = np.arange(n) if n <= max_entries else rng.choice(n, max_entries, replace=False)
    ana, num = [], []
    for i in probe:
        old = flat[i]
        flat[i] = old + eps
        fp = case.f()
        flat[i] = old - eps
        fm = case.f()
        flat[i] = old
        ana.append(gflat[i])
        num.append((fp - fm) / (2 * eps))
    ana, num = np.array(ana), np.array(num)
    # one random direction over the whole tensor
    saved = t.value.copy()
    d = rng.standard_normal(t.value.shape)
    d /= np.linalg.norm(d)     # unit length: the step is eps, as for single entries
    t.value += eps * d
    fp = case.f()
    t.value[...] = saved - eps * d
    fm = case.f()
    t.value[...] = saved
    ana_d, num_d = float(np.sum(t.grad * d)), (fp - fm) / (2 * eps)

    max_abs = float(max(np.abs(ana - num).max(), abs(ana_d - num_d)))
    if t.expect_zero:
        biggest = float(max(np.abs(ana).max(), np.abs(num).max(), abs(ana_d), abs(num_d)))
        return Row(case.layer, t.name, t.value.shape, len(probe), max_abs, biggest,
                   biggest < ZERO_ATOL, f"zero, as expected ({t.why_zero})")
    scale = float((np.abs(ana) + np.abs(num)).max())
    rel_e = float(np.abs(ana - num).max() / scale) if scale > 0 else 0.0
    # a random direction can be nearly orthogonal to the gradient, making <grad, d> tiny by
    # chance: its error is measured against the gradient's norm, the largest <grad, d> can be
    scale_d = max(abs(ana_d) + abs(num_d), float(np.linalg.norm(t.grad)))
    rel_d = abs(ana_d - num_d) / scale_d if scale_d > 0 else 0.0
    max_rel = max(rel_e, rel_d)
    note = "all zero" if scale == 0 and scale_d == 0 else ""
    return Row(case.layer, t.name, t.value.shape, len(probe), max_abs, max_rel, max_rel < rtol, note)


def cases(rng: np.random.Generator) -> list[Case]:
    """Every case cases.py builds."""
    return build(rng)


def run(seed: int = 0, eps: float = DEFAULT_EPS, rtol: float = DEFAULT_RTOL,
        layer: str | None = None) -> list[Row]:
    """All rows for the cases whose name starts with ``layer`` (all when None)."""
    rng = np.random.default_rng(seed)
    layer = None if layer is None else FORMER_NAMES.get(layer, layer)
    selected = [c for c in cases(rng) if layer is None or c.layer.startswith(layer)]
    if not selected:
        raise ValueError(f"no gradcheck case matches layer {layer!r}; try one of {', '.join(LAYERS)}")
    rows = []
    for case in selected:
        rows += check_case(case, rng, eps, rtol)
    return rows


# one spelling: a name of several words is hyphenated, as cross-attention and encoder-decoder are
CORE_LAYERS = ("embedding", "linear", "lora", "layernorm", "attention", "cross-attention", "mlp", "block",
               "decoder-block", "depth-attention", "cross-entropy", "gpt", "encoder-decoder")


def _design_layers() -> tuple[str, ...]:
    """The layers a design brings of its own: the first word of its layer cases' labels where the
    core has no such layer (a normalisation, say); the core's own words first."""
    from ..nn.build import VARIANTS
    found = [label.split(" [")[0] for v in VARIANTS for label, _ in v.cases("layer_cases")]
    return tuple(dict.fromkeys(name for name in found if name not in CORE_LAYERS))


LAYERS = CORE_LAYERS + _design_layers()
FORMER_NAMES = {"decoder block": "decoder-block", "depth attention": "depth-attention",
                "cross_entropy": "cross-entropy"}      # still read: scripts that used them keep working
