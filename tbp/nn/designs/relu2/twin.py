"""The plain twin of ReLU²: the equations of relu2.py written out, with the signature of the
core's MLP twin (reference.mlp_forward/_backward), so the core's GPT twin can take it as its ``mlp``."""
from __future__ import annotations

import numpy as np

from ...reference import linear_backward, linear_forward


def relu2_forward(x, w_fc, b_fc, w_proj, b_proj, activation=None):
    """u = x w_fc + b_fc; g = max(u, 0)^2; y = g w_proj + b_proj. ``activation`` is the standard
    MLP's and is not read."""
    u, fc = linear_forward(x, w_fc, b_fc)
    y, proj = linear_forward(np.maximum(u, 0) ** 2, w_proj, b_proj)
    return y, (fc, proj, u)


def relu2_backward(dy, cache):
    """dg = dy w_proj^T; du = dg 2 max(u, 0); then back through c_fc.
    Returns dx, dw_fc, db_fc, dw_proj, db_proj."""
    fc, proj, u = cache
    dg, dw_proj, db_proj = linear_backward(dy, proj)
    dx, dw_fc, db_fc = linear_backward(dg * 2 * np.maximum(u, 0), fc)
    return dx, dw_fc, db_fc, dw_proj, db_proj
