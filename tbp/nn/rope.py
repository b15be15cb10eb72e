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

import numpy as np

from .config import ConfigError
from .variant import Variant


class Rotary:
    """The rotation for heads of width ``d`` (even), with frequency base ``base``."""

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


def _check(cfg) -> None:
    if cfg.d_qk % 2:
        raise ConfigError(f"rotary positions need an even d_qk (pairs of channels), got {cfg.d_qk}")


VARIANT = Variant(
    key="rope", name="rotary positions", active=lambda cfg: cfg.positions == "rope", axis="positions", check=_check,
    switch="--positions rope",      # rope_base is not its option: older runs saved it with learned positions
    describe=lambda cfg: ("rotary", f"base {cfg.rope_base:g} · past the context of {cfg.n_ctx}, a sliding window"),
    refuses={"export": "GPT-2 learns a vector per position; it has no rotation of queries and keys"},
)
