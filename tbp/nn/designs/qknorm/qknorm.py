"""QK-norm: S = scale * rms(q) rms(k)^T, per head, with rms(x) = x / sqrt(mean(x^2) + eps).

Each query and key row of a head (Dk numbers) is divided by its root mean square, so
|rms(q) . rms(k)| <= Dk and a score is at most scale * Dk in size: attention cannot saturate
because a projection's weights grew (Dehghani et al. 2023 saw that divergence at 8B+; the
modded-nanogpt speedruns use it to train faster at a higher learning rate). No parameter is
added; ``--qk-norm-scale`` sets the factor on the normalised scores (0: 1/sqrt(Dk), the usual).

The backward of y = x r, r = (mean(x^2) + eps)^(-1/2), over the Dk channels of a row:

    dx = r (dy - y mean(dy * y))

(dr/dx_j = -r^3 x_j / Dk, and r^3 x_j sum_i dy_i x_i / Dk = r y_j mean(dy * y)).

The normalisation enters the layer through the positions protocol the core already has
(positions.py: transform queries and keys before their product, the transform's backward on
their gradients, in place on a decoding step's rows): each layer wraps the model's positions
object in :class:`NormedQK`, which normalises, then applies the model's own transform (rotary
positions rotate the normalised rows, as in the speedruns). The decoding fold leaves the query
scale out and the step puts it back after the norm, which would undo it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import registry
from ...attention import CausalSelfAttention
from ...config import Options, option
from ...linear import weight_of
from ...positions import LEARNED, Positions
from ...variant import Variant


@dataclass(frozen=True)
class QKNormOptions(Options):
    """QK-norm's own options (``cfg.designs["qknorm"]``), flags ``--qk-norm-*``."""
    PREFIX = "qk_norm_"
    eps: float = option(1e-6, "QK-norm: epsilon inside the root mean square of each query and key row.", min=0.0)
    scale: float = option(0.0, "QK-norm: the factor on the normalised scores rms(q) rms(k)^T (0: 1/sqrt(d_qk)).",
                          min=0.0)


def rms_rows(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(y, r): y = x r, r = (mean(x^2) + eps)^(-1/2) over the last axis, (..., D) and (..., 1)."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps))
    return x * r, r


def rms_rows_backward(dy: np.ndarray, y: np.ndarray, r: np.ndarray) -> np.ndarray:
    """dx = r (dy - y mean(dy * y)), the backward of :func:`rms_rows`."""
    return r * (dy - y * np.mean(dy * y, axis=-1, keepdims=True))


class NormedQK(Positions):
    """One layer's view of the model's positions ``inner``: queries and keys normalised per head
    (and the queries scaled by ``scale`` on a decoding step), then ``inner``'s transform. Keeps
    the last forward's normalised rows for the backward, so each layer has its own."""

    rotates = True

    def __init__(self, inner: Positions, eps: float, n_head: int, scale):
        self.inner, self.eps, self.n_head, self.scale = inner, eps, n_head, scale
        self.embeds, self.bias = inner.embeds, inner.bias
        self.cache = None

    def window(self, n_ctx: int) -> int | None:
        return self.inner.window(n_ctx)

    def rotate(self, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """q (B, H, T, Dk), k (B, Hkv, T, Dk) -> the model's transform of rms(q), rms(k)."""
        qn, rq = rms_rows(q, self.eps)
        kn, rk = rms_rows(k, self.eps)
        self.cache = qn, rq, kn, rk
        return self.inner.rotate(qn, kn)

    def rotate_back(self, dq: np.ndarray, dk: np.ndarray) -> None:
        """In place: back through the model's transform, then through the norm."""
        self.inner.rotate_back(dq, dk)
        qn, rq, kn, rk = self.cache
        dq[...] = rms_rows_backward(dq, qn, rq)
        dk[...] = rms_rows_backward(dk, kn, rk)

    def rotate_rows(self, qk: np.ndarray, out: np.ndarray, step) -> None:
        """A decoding step's rows (B, Tn, H + Hkv, Dk), in place: normalised, the queries scaled
        (the fold left the scale out), then the model's transform."""
        qk *= 1.0 / np.sqrt(np.mean(qk * qk, axis=-1, keepdims=True) + qk.dtype.type(self.eps))
        qk[:, :, :self.n_head] *= self.scale
        if self.inner.rotates:
            self.inner.rotate_rows(qk, out, step)


@registry.attention("qknorm")
class QKNormAttention(CausalSelfAttention):
    """CausalSelfAttention with each head's queries and keys RMS-normalised before their product;
    ``scale``: the factor on the normalised scores (None: 1/sqrt(Dk))."""

    def __init__(self, d_model: int, n_head: int, d_qk: int, d_v: int, rng: np.random.Generator,
                 dtype=np.float32, eps: float = 1e-6, scale: float | None = None,
                 positions: Positions = LEARNED, **kw):
        scale = np.dtype(dtype).type(scale or 1.0 / np.sqrt(d_qk))
        super().__init__(d_model, n_head, d_qk, d_v, rng, dtype, positions=NormedQK(positions, eps, n_head, scale),
                         **kw)
        self.scale = scale

    @classmethod
    def from_config(cls, cfg, rng: np.random.Generator, dtype, layer: int, proj_std: float,
                    positions: Positions = LEARNED):
        o = cfg.designs["qknorm"]
        return cls(cfg.d_model, cfg.n_head, cfg.d_qk, cfg.d_v, rng, dtype, o.eps, o.scale or None, positions,
                   bias=cfg.bias, causal=cfg.causal, proj_std=proj_std, impl=cfg.attn_kernel,
                   window=positions.window(cfg.n_ctx))

    def fold(self, ln) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """As the standard fold, without the query scale: the norm would undo it (NormedQK puts
        it back after the norm)."""
        qkv = ln.fold(weight_of(self.c_attn), self.c_attn.params.get("bias"))
        return qkv, weight_of(self.c_proj), self.c_proj.params.get("bias")


def _layer(C: int, H: int, rng, dtype, **kw):
    return QKNormAttention(C, H, 4, C // H, rng, dtype, **kw)


VARIANT = registry.declare(Variant(
    key="qknorm", name="QK-norm", active=lambda cfg: cfg.attention == "qknorm", axis="attention",
    summary="qknorm: each head's queries and keys RMS-normalised before their product (QK-norm).",
    options=QKNormOptions, switch="--attention qknorm",
    refuses={"export": "GPT-2's attention does not normalise its queries and keys",
             "gguf": "llama.cpp's gpt2 and gptneox graphs do not normalise queries and keys"},
    describe=lambda cfg: ("qk-norm", f"queries and keys RMS-normalised per head · eps {cfg.designs['qknorm'].eps:g} "
                                     f"· scale {cfg.designs['qknorm'].scale or 1 / np.sqrt(cfg.d_qk):.4g}"),
    # eps 0.1 and a scale of 2: both options reach the gradient (the default eps barely does)
    # (with the flash kernel and rotary positions where those designs are there)
    layer_cases=lambda: (
        ("attention [qk-norm]", lambda C, H, rng, dtype: _layer(C, H, rng, dtype)),
        ("attention [qk-norm, eps 0.1, scale 2]",
         lambda C, H, rng, dtype: _layer(C, H, rng, dtype, eps=0.1, scale=2.0)),
        *((("attention [qk-norm, flash in tiles]",
            lambda C, H, rng, dtype: _layer(C, H, rng, dtype, eps=0.1, impl="flash", tiles=(2, 3))),)
          * registry.has("kernel", "flash"))),
    model_cases=lambda: (
        ("gpt [qk-norm, eps 0.1, scale 2]", dict(attention="qknorm", qk_norm_eps=0.1, qk_norm_scale=2.0)),
        *((("gpt [qk-norm + rope]", dict(attention="qknorm", positions="rope")),) * registry.has("positions", "rope"))),
))
