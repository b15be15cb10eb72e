"""The plain twin of RMSNorm: the equations of rmsnorm.py written out, one line each, with the
signature of the core's layer-norm twin (reference.layernorm_forward/_backward), so the core's
GPT twin can take it as its ``norm``."""
from __future__ import annotations

import numpy as np


def rmsnorm_forward(x, w, b=None, eps=1e-5):
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis; ``b`` must be None (no shift)."""
    if b is not None:
        raise ValueError("RMSNorm has no shift")
    ms = (x ** 2).mean(axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(ms + eps)
    xhat = x * r
    return xhat * w, (xhat, r, w)


def rmsnorm_backward(dy, cache):
    """dxhat = dy w; dx = r (dxhat - xhat mean(dxhat xhat)); dw = sum of dy xhat over rows.
    Returns dx, dw, None (no shift)."""
    xhat, r, w = cache
    dxhat = dy * w
    dx = r * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    dw = (dy * xhat).reshape(-1, xhat.shape[-1]).sum(axis=0)
    return dx, dw, None
