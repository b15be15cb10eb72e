"""The plain twin of SwiGLU: the equations of swiglu.py written out, with the signature of the
core's MLP twin (reference.mlp_forward/_backward), so the core's GPT twin can take it as its ``mlp``."""
from __future__ import annotations

import numpy as np

from ...reference import linear_backward, linear_forward


def swiglu_forward(x, w_fc, b_fc, w_proj, b_proj, activation=None):
    """[a | b] = x w_fc + b_fc (the gate's F columns, then the value's); h = a sigmoid(a) b;
    y = h w_proj + b_proj. ``activation`` is the standard MLP's and is not read."""
    u, fc = linear_forward(x, w_fc, b_fc)
    F = u.shape[-1] // 2
    a, b = u[..., :F], u[..., F:]
    s = 1.0 / (1.0 + np.exp(-a))
    h = a * s * b
    y, proj = linear_forward(h, w_proj, b_proj)
    return y, (fc, proj, a, b, s)


def swiglu_backward(dy, cache):
    """dh = dy w_proj^T; db = dh a s; da = dh b (s + a s (1 - s)); then back through c_fc.
    Returns dx, dw_fc, db_fc, dw_proj, db_proj."""
    fc, proj, a, b, s = cache
    dh, dw_proj, db_proj = linear_backward(dy, proj)
    da = dh * b * (s + a * s * (1 - s))
    db = dh * a * s
    dx, dw_fc, db_fc = linear_backward(np.concatenate([da, db], axis=-1), fc)
    return dx, dw_fc, db_fc, dw_proj, db_proj
