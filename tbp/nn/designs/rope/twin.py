"""Rotary positions (RoPE, Su et al. arXiv 2104.09864) written the plain way: the rotation of
each (x_i, x_{i+d/2}) pair by its position's angle, and its transpose. The core's attention
twin (``reference.attention_forward``) and grouped-query attention's take it as
``rotate=rotation(base)``; sparse decoding's twin calls it directly. tests/test_long_context.py holds
``Rotary`` to it in float64.
"""
from __future__ import annotations

import numpy as np


def rope_angles(T, d, base, t0=0):
    """(T, d/2): pair i at position t0 + t turns by (t0 + t) * base^(-2i/d)."""
    theta = base ** (-2.0 * np.arange(d // 2) / d)
    return (t0 + np.arange(T))[:, None] * theta


def rope_forward(x, base, t0=0):
    """Rotate each pair (x_i, x_{i+d/2}) of x (..., T, d) by its position's angle:
    [a, b] -> [a cos - b sin, a sin + b cos]."""
    angle = rope_angles(x.shape[-2], x.shape[-1], base, t0)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), a * np.sin(angle) + b * np.cos(angle)], -1)


def rope_backward(dy, base, t0=0):
    """A rotation's transpose is the rotation by the opposite angle."""
    angle = rope_angles(dy.shape[-2], dy.shape[-1], base, t0)
    h = dy.shape[-1] // 2
    a, b = dy[..., :h], dy[..., h:]
    return np.concatenate([a * np.cos(angle) + b * np.sin(angle), -a * np.sin(angle) + b * np.cos(angle)], -1)


def rotation(base, t0=0):
    """The pair (rotation, its transpose) of positions t0, t0 + 1, ... at ``base``, as
    ``reference.attention_forward`` takes it."""
    return (lambda x: rope_forward(x, base, t0)), (lambda dy: rope_backward(dy, base, t0))
