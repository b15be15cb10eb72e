"""AdamW, the warmup + cosine learning-rate schedule, and global-norm gradient clipping."""
from __future__ import annotations

import math

import numpy as np


def lr_at(step: int, lr: float, min_lr: float, warmup: int, decay_iters: int) -> float:
    """Learning rate for 0-based ``step``: linear warmup to ``lr``, then cosine down to ``min_lr``.

    Warmup reaches lr at step = warmup (nanoGPT's and the PyTorch reference's formula);
    after ``decay_iters`` it stays at min_lr.
    """
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= decay_iters:
        return min_lr
    ratio = (step - warmup) / max(1, decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def global_norm(grads: dict[str, np.ndarray]) -> float:
    """sqrt of the sum of squares of every gradient entry (accumulated in float64)."""
    return math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))


def clip_grads(grads: dict[str, np.ndarray], max_norm: float, flat: np.ndarray | None = None) -> float:
    """Scale all gradients in place so their global norm is at most ``max_norm``; returns the
    norm before clipping (what a logger wants to see). max_norm <= 0 disables clipping.

    ``flat``: the packed buffer every gradient lives in (Module.pack), when all of them train;
    then the norm and the scaling are one operation each.
    """
    if flat is not None:
        norm = math.sqrt(float(np.vdot(flat, flat)))
    else:
        norm = global_norm(grads)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in ((flat,) if flat is not None else grads.values()):
            g *= g.dtype.type(scale)
    return norm


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW computes it.

    p -= lr * wd * p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    Weight decay applies to matrices only (ndim >= 2: embeddings and linear weights), never to
    biases or layer-norm gains, following nanoGPT. Moments are kept in the parameters' dtype.
    """

    def __init__(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray],
                 weight_decay: float = 0.1, beta1: float = 0.9, beta2: float = 0.99, eps: float = 1e-8,
                 flat: tuple | None = None):
        self.params, self.grads = params, grads
        self.names = list(grads)          # only what has a gradient: frozen weights are not stepped
        self.weight_decay, self.beta1, self.beta2, self.eps = weight_decay, beta1, beta2, eps
        # fast path: every parameter lives in one packed buffer (Module.pack) and all train
        self.flat = flat if flat is not None and len(grads) == len(params) else None
        if self.flat is not None:
            fp = self.flat[0]
            self.flat_m, self.flat_v = np.zeros_like(fp), np.zeros_like(fp)
            self.m = {k: self._view(self.flat_m, params[k]) for k in self.names}
            self.v = {k: self._view(self.flat_v, params[k]) for k in self.names}
        else:
            self.m = {k: np.zeros_like(params[k]) for k in self.names}
            self.v = {k: np.zeros_like(params[k]) for k in self.names}
        self.t = 0
        self.parallel = None              # a DataParallel: share the packed update over its threads
        self._scratch_arrays: dict = {}

    def _view(self, buf: np.ndarray, p: np.ndarray) -> np.ndarray:
        """The slice of ``buf`` at the offset where ``p`` sits in the packed parameter buffer."""
        off = (p.__array_interface__["data"][0] - self.flat[0].__array_interface__["data"][0]) // p.itemsize
        return buf[off:off + p.size].reshape(p.shape)

    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        if self.flat is not None:
            self._step_flat(lr, bc1, bc2)
            return
        for k in self.names:
            p, g, m, v = self.params[k], self.grads[k], self.m[k], self.v[k]
            f = p.dtype.type
            if self.weight_decay and p.ndim >= 2:
                p *= f(1 - lr * self.weight_decay)
            m *= f(b1)
            m += f(1 - b1) * g
            v *= f(b2)
            v += f(1 - b2) * (g * g)
            denom = np.sqrt(v)
            denom *= f(1 / math.sqrt(bc2))
            denom += f(self.eps)
            p -= f(lr / bc1) * (m / denom)

    CHUNK = 1 << 18

    def _step_flat(self, lr: float, bc1: float, bc2: float) -> None:
        """The per-tensor arithmetic, op for op, over the packed buffers in cache-sized chunks.

        Whole-buffer expressions would allocate several model-sized temporaries per step and
        stream every buffer through memory ten times; chunks of 256K entries (1 MiB each in
        float32) stay in cache and reuse two scratch arrays. Every entry is updated on its own,
        so with ``parallel`` set (a ``DataParallel``) each worker thread takes one contiguous
        share of the buffer, and the result is the same to the bit.
        """
        p, g, n_matrix = self.flat
        m, v = self.flat_m, self.flat_v
        f = p.dtype.type
        decay = f(1 - lr * self.weight_decay)
        b1, c1, b2, c2 = f(self.beta1), f(1 - self.beta1), f(self.beta2), f(1 - self.beta2)
        inv_bc2, eps, step = f(1 / math.sqrt(bc2)), f(self.eps), f(lr / bc1)

        def update(lo: int, hi: int, k: int) -> None:
            a_buf, b_buf = self._scratch(k, p.dtype)
            for s in range(lo, hi, self.CHUNK):
                e = min(s + self.CHUNK, hi)
                ps, gs, ms, vs = p[s:e], g[s:e], m[s:e], v[s:e]
                a, b = a_buf[:e - s], b_buf[:e - s]
                if self.weight_decay and s < n_matrix:
                    ps[:min(e, n_matrix) - s] *= decay
                ms *= b1
                np.multiply(c1, gs, out=a)
                ms += a
                vs *= b2
                np.multiply(gs, gs, out=a)
                a *= c2
                vs += a
                np.sqrt(vs, out=a)
                a *= inv_bc2
                a += eps
                np.divide(ms, a, out=b)
                b *= step
                ps -= b

        if self.parallel is None:
            update(0, p.size, 0)
            return
        n = self.parallel.workers
        bounds = [p.size * i // n for i in range(n + 1)]
        self.parallel.each(lambda k: update(bounds[k], bounds[k + 1], k))

    def _scratch(self, k: int, dtype) -> tuple[np.ndarray, np.ndarray]:
        """Worker k's two chunk-sized scratch arrays."""
        pair = self._scratch_arrays.get(k)
        if pair is None:
            pair = self._scratch_arrays[k] = (np.empty(self.CHUNK, dtype), np.empty(self.CHUNK, dtype))
        return pair

    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {f"m.{k}": self.m[k] for k in self.names}
        out.update({f"v.{k}": self.v[k] for k in self.names})
        return out

    def load_state_arrays(self, arrays: dict[str, np.ndarray], t: int) -> None:
        want = set(self.state_arrays())
        if set(arrays) != want:
            missing = sorted(want - set(arrays))[:3]
            raise ValueError(f"optimizer state does not match the model (missing {missing})")
        for k in self.names:
            np.copyto(self.m[k], arrays[f"m.{k}"])
            np.copyto(self.v[k], arrays[f"v.{k}"])
        self.t = t
