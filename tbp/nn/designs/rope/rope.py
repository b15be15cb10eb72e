"""Rotary position embeddings (RoPE; Su et al., arXiv 2104.09864).

Instead of adding a learned vector per position to the input, each query and key is rotated
by an angle proportional to its position: the Dk channels of a head form Dk/2 pairs
(x_i, x_{i+Dk/2}), and pair i at position t turns by t * theta_i, theta_i = base^(-2i/Dk):

    rope(x)_t = x_t * cos(t theta) + rot(x_t) * sin(t theta),   rot([a, b]) = [-b, a].

A rotation preserves dot products up to the angle between the two vectors, so
q_t . k_s depends on the positions only through t - s: attention sees relative positions,
and a model is not capped at the positions it was trained on. The backward of a rotation is
its transpose (the rotation by -t theta):

    dx = dy * cos + rot^T(dy * sin),   rot^T([a, b]) = [b, -a].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import registry
from ...config import ConfigError, Options, option
from ...positions import Positions
from ...variant import Variant


class Rotary(Positions):
    """The rotation for heads of width ``d`` (even), with frequency base ``base``: a positions
    scheme (positions.py) with no vector per position, that rotates queries and keys."""

    embeds = False
    rotates = True

    def __init__(self, d: int, base: float = 10000.0):
        if d % 2:
            raise ValueError(f"rotary positions need an even query/key width, got {d}")
        self.d, self.base = d, base
        self.inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)     # (d/2,) theta_i
        self._tables: dict = {}

    def tables(self, t0: int, T: int, dtype) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin (T, d/2) of positions t0 .. t0+T-1, angles computed in float64.
        Training reuses one span every step, so the last few are kept."""
        key = (t0, T, np.dtype(dtype))
        cs = self._tables.get(key)
        if cs is None:
            angles = np.arange(t0, t0 + T, dtype=np.float64)[:, None] * self.inv_freq   # (T, d/2)
            cs = (np.cos(angles).astype(dtype), np.sin(angles).astype(dtype))
            if len(self._tables) >= 4:
                self._tables.clear()
            self._tables[key] = cs
        return cs

    def forward(self, x: np.ndarray, t0: int = 0) -> np.ndarray:
        """x (..., T, d) at positions t0 .. -> the rotated copy, same shape."""
        cos, sin = self.tables(t0, x.shape[-2], x.dtype)
        return rotate(x, cos, sin, np.empty_like(x))

    def backward(self, dy: np.ndarray, t0: int = 0) -> np.ndarray:
        """The transpose of forward: rotate dy by the opposite angles."""
        cos, sin = self.tables(t0, dy.shape[-2], dy.dtype)
        return rotate(dy, cos, -sin, np.empty_like(dy))

    # --- the positions protocol (positions.py) ---------------------------------------------
    def rotate(self, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.forward(q), self.forward(k)                         # rotated copies

    def rotate_back(self, dq: np.ndarray, dk: np.ndarray) -> None:
        dq[...] = self.backward(dq)
        dk[...] = self.backward(dk)

    def rotate_rows(self, qk: np.ndarray, out: np.ndarray, step) -> None:
        cos, sin = step.once(("rotary", self), lambda: self.row_tables(step))
        rotate(qk, cos, sin, out=out)
        qk[...] = out

    def row_tables(self, step) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (Tn, 1, Dk/2) of a decoding step's rows at t0 .. t1-1 -- with the step's
        ``positions`` (B,), one row per sequence, (B, 1, 1, Dk/2), each row's own."""
        if step.positions is not None:
            angles = step.positions[:, None].astype(np.float64) * self.inv_freq       # (B, Dk/2)
            return (np.cos(angles).astype(step.dtype)[:, None, None],
                    np.sin(angles).astype(step.dtype)[:, None, None])
        cos, sin = self.tables(step.t0, step.t1 - step.t0, step.dtype)
        return cos[:, None], sin[:, None]


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = x * cos + rot(x) * sin over the last axis, pairs (i, i + d/2); cos, sin (T, d/2)
    broadcast against x (..., T, d). ``out`` must not overlap ``x``."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    out_a, out_b = out[..., :h], out[..., h:]
    np.multiply(a, cos, out=out_a)
    out_a -= b * sin                                         # a cos - b sin
    np.multiply(b, cos, out=out_b)
    out_b += a * sin                                         # b cos + a sin
    return out


@dataclass(frozen=True)
class RopeOptions(Options):
    """Rotary positions' own option (``cfg.designs["rope"]``), flag ``--rope-base``. It may be
    set with other positions (KEPT_WHEN_OFF): runs of earlier releases saved it with learned ones."""
    PREFIX = "rope_"
    KEPT_WHEN_OFF = True
    base: float = option(10000.0, "RoPE frequency base: pair i turns by position * base^(-2i/d_qk).",
                         min=1.0, min_open=True)


@registry.positions("rope")
def _rotary(cfg) -> Rotary:
    return Rotary(cfg.d_qk, cfg.designs["rope"].base)


def _check(cfg) -> None:
    if cfg.d_qk % 2:
        raise ConfigError(f"rotary positions need an even d_qk (pairs of channels), got {cfg.d_qk}")


VARIANT = registry.declare(Variant(
    key="rope", name="rotary positions", active=lambda cfg: cfg.positions == "rope", axis="positions", check=_check,
    switch="--positions rope", options=RopeOptions,
    summary="rope: queries and keys rotated by position (no vector per position).",
    describe=lambda cfg: ("rotary", f"base {cfg.designs['rope'].base:g} · past the context of {cfg.n_ctx}, "
                                    f"a sliding window"),
    refuses={"export": "GPT-2 learns a vector per position; it has no rotation of queries and keys"},
    # the flash kernel in tiles of 2 query x 3 key rows over T = 5 (several tiles, a partial one,
    # the diagonal), rotating inside its tiles
    # (with the flash kernel where that design is there)
    layer_cases=lambda: (
        ("attention [rope]", lambda C, H, rng, dtype: _rotated(C, H, 4, "dense", rng, dtype)),
        *((("attention [flash + rope, d_qk=2]", lambda C, H, rng, dtype: _rotated(C, H, 2, "flash", rng, dtype)),)
          * registry.has("kernel", "flash"))),
    model_cases=lambda: (
        ("gpt [rope, no wpe]", {"positions": "rope"}),
        ("gpt [rope, dropout 0.3, untied head]", {"positions": "rope", "dropout": 0.3, "tie_head": False}),
        *((("gpt [flash + rope]", {"attn_impl": "flash", "positions": "rope"}),) * registry.has("kernel", "flash"))),
))


def _rotated(C: int, H: int, dk: int, impl: str, rng, dtype):
    """A causal attention layer with rotary positions (a gradcheck case): the standard
    attention, from the registry."""
    return registry.ATTENTION["standard"](C, H, dk, C // H, rng, dtype, True, True, impl=impl,
                                          positions=Rotary(dk), tiles=(2, 3))
