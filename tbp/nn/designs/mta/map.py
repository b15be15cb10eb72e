"""Multi-Token Attention's map: the steps between a head's scores and its output, with their
backward.   [Golovneva et al. 2025, arXiv 2504.00927]

The layer that runs them, its decoding and its declaration are in mta.py, whose docstring gives
the equations; here are the key-query convolution (``conv_map``, its transpose
``conv_map_backward``) and ``MTAParams``, the parameters and steps between the scores S and
the output O: the convolutions, head mixing, the softmax, head groups, and the per-head RMS
norm and gate, optionally scaled by depth.
"""
from __future__ import annotations

import numpy as np

from ... import init
from ...kernels import causal_mask
from ...module import Module


def depth_scale(layer: int) -> float:
    """1 - lambda(l), lambda(l) = 0.8 - 0.6 exp(-0.3 l), l the 0-based layer: the scaling of the
    normed output by depth that the MTA paper takes from the Differential Transformer (Ye et al.
    2024, whose (l - 1) counts layers from 1). The authors' released configs leave it off
    (``layer_norm_rescale: false``), as tbp does unless ``--mta-depth-scale``."""
    return 1.0 - (0.8 - 0.6 * float(np.exp(-0.3 * layer)))


def conv_map(X: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """Z[..., h, i, j] = sum_{a,b} theta[h, a, b] X[..., h, i-(cq-1)+a, j-p+b], zero outside.
    X (B, H, Tq, Tk); theta (H, cq, ck) with ck odd. Taps as shifted slices of a padded copy."""
    H, cq, ck = theta.shape
    p = (ck - 1) // 2
    B, _, Tq, Tk = X.shape
    Xp = np.zeros((B, H, Tq + cq - 1, Tk + 2 * p), X.dtype)
    Xp[:, :, cq - 1:, p:p + Tk] = X
    return _taps(Xp, theta, Tq, Tk)


def _taps(Xp: np.ndarray, theta: np.ndarray, Tq: int, Tk: int) -> np.ndarray:
    """sum_{a,b} theta[:, a, b] Xp[..., a:a+Tq, b:b+Tk]: one multiply-add per tap into a
    contiguous (B, H, Tq, Tk) result, through one scratch array."""
    H, cq, ck = theta.shape
    Z = np.zeros(Xp.shape[:2] + (Tq, Tk), Xp.dtype)
    tmp = np.empty_like(Z)
    for a in range(cq):
        for b in range(ck):
            w = theta[:, a, b]
            if w.any():
                np.multiply(Xp[:, :, a:a + Tq, b:b + Tk], w[:, None, None], out=tmp)
                Z += tmp
    return Z


def conv_map_backward(dZ: np.ndarray, X: np.ndarray, theta: np.ndarray, need_dx: bool = True):
    """(dX, dtheta) of ``conv_map``: dX[i', j'] = sum_{a,b} theta[a,b] dZ[i'+(cq-1)-a, j'+p-b]
    (the same taps, transposed), dtheta[h,a,b] = sum dZ_h * shifted X_h."""
    H, cq, ck = theta.shape
    p = (ck - 1) // 2
    B, _, Tq, Tk = X.shape
    Xp = np.zeros((B, H, Tq + cq - 1, Tk + 2 * p), X.dtype)
    Xp[:, :, cq - 1:, p:p + Tk] = X
    dtheta = np.empty_like(theta)
    for a in range(cq):
        for b in range(ck):
            dtheta[:, a, b] = np.einsum("bhij,bhij->h", dZ, Xp[:, :, a:a + Tq, b:b + Tk])
    if not need_dx:
        return None, dtheta
    # dX is the convolution of dZ with the kernel flipped, dZ padded below and on both sides:
    # dX[i, j] = sum_{a,b} theta[cq-1-a, ck-1-b] dZp[i + a, j + b]
    dZp = np.zeros((B, H, Tq + cq - 1, Tk + 2 * p), dZ.dtype)
    dZp[:, :, :Tq, p:p + Tk] = dZ
    return _taps(dZp, theta[:, ::-1, ::-1], Tq, Tk), dtheta


class MTAParams(Module):
    """The parameters and steps Multi-Token Attention adds between the scores and the output."""

    def __init__(self, n_head: int, d_v: int, dtype, conv, post: bool, mix: bool, group: int, norm: bool,
                 eps: float, scale: float = 1.0):
        super().__init__()
        self.scale = scale                  # the normed, gated output's factor (depth_scale), 1: none
        H = n_head
        self.conv, self.post, self.mixing, self.group, self.norm, self.eps = conv, post and conv, mix, group, norm, eps
        if conv is not None:
            cq, ck = conv
            if ck % 2 == 0 or cq < 1:
                raise ValueError(f"MTA kernels need cq >= 1 and an odd ck (centred on the key), got {cq} x {ck}")
            self.param("theta", _identity_kernel(H, cq, ck, dtype))
            if self.post:
                self.param("theta_post", _identity_kernel(H, cq, ck, dtype))
        if mix:
            self.param("mix", init.eye(H, dtype))
        if group:
            if H % group:
                raise ValueError(f"the head-group size {group} must divide the heads ({H})")
            self.param("group_mix", init.eye(group, dtype, (H // group,)))
        if norm:
            self.param("norm_gain", init.ones((d_v,), dtype))
            self.param("gate_weight", init.zeros((d_v,), dtype))
            self.param("gate_bias", init.zeros((1,), dtype))

    def scores_to_output(self, S: np.ndarray, v: np.ndarray, t0: int, state: dict | None = None):
        """(O (B, H, Tn, Dv), saved for the backward) from scores S (B, H, Tn, Tk) of query rows
        t0 .. t0+Tn-1 (scaled) and values v (B, H, Tk, Dv). ``state``: the previous rows for
        decoding (updated); None in training, where t0 = 0 and Tn = Tk."""
        P = self.params
        B, H, Tn, Tk = S.shape
        mask = causal_mask(Tn, t0, S.dtype)                         # (Tn, t0 + Tn), 0 / -inf
        keep = np.isfinite(mask)                                    # C, the causal pattern
        saved = {}
        if self.conv is not None:
            S0 = np.where(keep, S, 0).astype(S.dtype)
            Z = self._conv_rows(S0, P["theta"], state, "S0")
            saved["S0"] = S0
        else:
            Z = S
        if self.mixing:
            saved["Z"] = Z
            Z = np.einsum("hg,bgij->bhij", P["mix"], Z)
        A = Z + mask
        A -= np.maximum.reduce(A, axis=-1, keepdims=True)
        np.exp(A, out=A)
        A /= np.add.reduce(A, axis=-1, keepdims=True)
        saved["A"] = A
        A1 = A
        if self.post:
            A1 = self._conv_rows(A, P["theta_post"], state, "A") * keep
        saved["A1"] = A1
        A2 = A1
        if self.group:
            g = self.group
            A2 = np.einsum("kpo,bkpij->bkoij", P["group_mix"], A1.reshape(B, H // g, g, Tn, Tk)).reshape(A1.shape)
        saved["A2"] = A2
        O = A2 @ v                                                  # (B, H, Tn, Dv)
        if self.norm:
            rms = np.sqrt(np.mean(O * O, axis=-1, keepdims=True) + O.dtype.type(self.eps))
            n = O / rms * P["norm_gain"]
            u = n @ P["gate_weight"] + P["gate_bias"][0]             # (B, H, Tn)
            s = 1.0 / (1.0 + np.exp(-u))
            saved.update(O=O, rms=rms, n=n, s=s)
            O = n * (s if self.scale == 1.0 else s * O.dtype.type(self.scale))[..., None]
        return O, saved

    def _conv_rows(self, X: np.ndarray, theta: np.ndarray, state: dict | None, name: str) -> np.ndarray:
        """conv_map over rows t0 .. of X, with the previous cq - 1 rows from ``state`` (decoding)."""
        if state is None:
            return conv_map(X, theta)
        cq = theta.shape[1]
        Tk = X.shape[3]
        prev = state[name][..., :Tk]                                # (B, H, cq-1, Tk), zeros before 0
        stacked = np.concatenate([prev, X], axis=2)
        out = conv_map(stacked, theta)[:, :, cq - 1:]
        if cq > 1:
            keep = stacked[:, :, -(cq - 1):]                        # the last cq - 1 rows, for next time
            state[name][..., :] = 0
            state[name][..., :Tk] = keep
        return out

    def backward(self, dO: np.ndarray, v: np.ndarray, saved: dict):
        """(dS, dv) from dO (B, H, T, Dv): every step of ``scores_to_output`` in reverse."""
        P, G = self.params, self.grads
        if self.norm:
            O, rms, n, s = saved["O"], saved["rms"], saved["n"], saved["s"]
            if self.scale != 1.0:                                   # y = scale n s
                dO = dO * dO.dtype.type(self.scale)
            # y = n s, s = sigmoid(n . w + b):  dn = dy s + (sum_d dy n) s (1 - s) w
            ds = np.einsum("bhtd,bhtd->bht", dO, n) * s * (1 - s)
            if "gate_weight" in G:
                G["gate_weight"] += np.einsum("bht,bhtd->d", ds, n)
                G["gate_bias"] += ds.sum()
            dn = dO * s[..., None] + ds[..., None] * P["gate_weight"]
            # n = O / rms * g:  dO = (g dn - xhat mean(g dn xhat)) / rms, xhat = O / rms
            xhat = O / rms
            if "norm_gain" in G:
                G["norm_gain"] += np.einsum("bhtd,bhtd->d", dn, xhat)
            gdn = dn * P["norm_gain"]
            dO = (gdn - xhat * np.mean(gdn * xhat, axis=-1, keepdims=True)) / rms
        A2, A1, A = saved["A2"], saved["A1"], saved["A"]
        B, H, T, _ = A.shape
        dv = A2.transpose(0, 1, 3, 2) @ dO                          # (B, H, T, Dv)
        dA2 = dO @ v.transpose(0, 1, 3, 2)                          # (B, H, T, T)
        dA1 = dA2
        if self.group:
            g = self.group
            A1g, dA2g = A1.reshape(B, H // g, g, T, T), dA2.reshape(B, H // g, g, T, T)
            if "group_mix" in G:
                G["group_mix"] += np.einsum("bkpij,bkoij->kpo", A1g, dA2g)
            dA1 = np.einsum("kpo,bkoij->bkpij", P["group_mix"], dA2g).reshape(A.shape)
        keep = np.isfinite(causal_mask(T, 0, A.dtype))
        dA = dA1
        if self.post:
            dA1c = dA1 * keep
            dA, dtheta = conv_map_backward(dA1c, A, P["theta_post"])
            if "theta_post" in G:
                G["theta_post"] += dtheta
        # softmax: dZ' = A (dA - rowsum(dA A)); masked entries have A = 0
        dZ = A * (dA - np.add.reduce(dA * A, axis=-1, keepdims=True))
        if self.mixing:
            if "mix" in G:
                G["mix"] += np.einsum("bhij,bgij->hg", dZ, saved["Z"])
            dZ = np.einsum("hg,bhij->bgij", P["mix"], dZ)
        if self.conv is not None:
            dS0, dtheta = conv_map_backward(dZ, saved["S0"], P["theta"])
            if "theta" in G:
                G["theta"] += dtheta
            dS = dS0 * keep
        else:
            dS = dZ * keep
        return dS, dv


def _identity_kernel(H: int, cq: int, ck: int, dtype) -> np.ndarray:
    """theta[:, cq-1, (ck-1)/2] = 1, every other tap 0: the convolution starts as the identity."""
    theta = init.zeros((H, cq, ck), dtype)
    if not init.abstract():
        theta[:, cq - 1, (ck - 1) // 2] = 1
    return theta
