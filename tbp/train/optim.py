"""AdamW, the learning-rate schedules (warmup + cosine; warmup-stable-decay, over steps or over a
time budget), and global-norm gradient clipping."""
from __future__ import annotations

import math

import numpy as np

from .optimizers import optimizer


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


def wsd_at(step: int, progress: float, lr: float, min_lr: float, warmup: int, decay_fraction: float) -> float:
    """Warmup-stable-decay: linear warmup to ``lr`` over ``warmup`` steps, then ``lr`` until the
    last ``decay_fraction`` of the run, then linearly down to ``min_lr`` at its end. ``progress``
    in [0, 1]: the share of the run done -- of its steps, or of its time when a time budget ends it
    (the schedule then decays as the clock runs out, however fast the steps turn out to be)."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    left = 1.0 - progress
    if left >= decay_fraction:
        return lr
    return min_lr + (lr - min_lr) * max(left, 0.0) / decay_fraction


def scheduled_lr(cfg, step: int, clock: float | None = None) -> float:
    """The rate ``cfg``'s schedule (a TrainConfig's) gives 0-based ``step``. ``clock``: the share
    of a time budget spent, where one may end the run: wsd decays by whichever of the steps and
    the clock runs out first; the cosine is keyed to steps alone."""
    if cfg.schedule == "cosine":
        return lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.decay_iters)
    progress = max(step / cfg.max_iters, clock or 0.0)
    return wsd_at(step, progress, cfg.lr, cfg.min_lr, cfg.warmup, cfg.decay_fraction)


def clip_grads(grads: np.ndarray, max_norm: float, norm: float | None = None) -> float:
    """Scale the gradients in place so their global norm is at most ``max_norm``; returns the
    norm before clipping (what a logger wants to see). max_norm <= 0 disables clipping.

    grads: the flat gradient buffer of a :class:`~tbp.nn.Layout` (every trainable gradient
    is a view into it), so the norm and the scaling are one operation each; or one rank's
    slice of it under a sharded optimizer, with ``norm`` the whole gradient's (gradsync.py).
    """
    if norm is None:
        norm = math.sqrt(float(np.vdot(grads, grads)))
    if max_norm > 0 and norm > max_norm:
        grads *= grads.dtype.type(max_norm / (norm + 1e-6))
    return norm


@optimizer("adamw")
class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW computes it.

    p -= lr * wd * p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    Weight decay applies to matrices only (ndim >= 2: embeddings and linear weights), never to
    biases or layer-norm gains, following nanoGPT. Moments are kept in the parameters' dtype.

    It steps the trainable parameters of a :class:`~tbp.nn.Layout` (all of them, or a LoRA
    run's adapters): the moments are flat buffers laid out like the parameters.
    """

    def __init__(self, layout, weight_decay: float = 0.1, beta1: float = 0.9, beta2: float = 0.99,
                 eps: float = 1e-8):
        self.layout = layout
        self.weight_decay, self.beta1, self.beta2, self.eps = weight_decay, beta1, beta2, eps
        self.lo, self.hi = 0, layout.size        # the entries it updates: all, or a slice (slice())
        self.spans: list[tuple[int, int]] | None = None     # within those, only these (Muon's other half)
        self.m, self.v = np.zeros_like(layout.params), np.zeros_like(layout.params)
        self.t = 0
        self.workers = None               # a Serial/DataParallel: share the update over its threads
        self._scratch_arrays: dict = {}

    @classmethod
    def from_config(cls, layout, cfg) -> "AdamW":
        return cls(layout, cfg.weight_decay, cfg.beta1, cfg.beta2)

    def buffers(self) -> list[np.ndarray]:
        """Every array of its state, for ranks to share rank 0's."""
        return [self.m, self.v]

    CHUNK = 1 << 18

    def step(self, lr: float) -> None:
        """One update of every trainable entry, in cache-sized chunks.

        Whole-buffer expressions would allocate several model-sized temporaries per step and
        stream every buffer through memory ten times; chunks of 256K entries (1 MiB each in
        float32) stay in cache and reuse two scratch arrays. Every entry is updated on its own,
        so with ``workers`` set each worker thread takes one contiguous share of the buffer,
        and the result is the same to the bit.
        """
        self.t += 1
        bc1, bc2 = 1 - self.beta1 ** self.t, 1 - self.beta2 ** self.t
        lo, hi = self.lo, self.hi
        p, g, m, v = self.layout.params[lo:hi], self.layout.grads[lo:hi], self.m, self.v
        n_decay = min(max(self.layout.n_decay - lo, 0), hi - lo)      # the decayed prefix, in the slice
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
                if self.weight_decay and s < n_decay:
                    ps[:min(e, n_decay) - s] *= decay
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

        n = self.workers.workers if self.workers is not None else 1
        for a, z in self.spans or [(0, p.size)]:
            bounds = [a + (z - a) * i // n for i in range(n + 1)]
            if n == 1:
                update(a, z, 0)
            else:
                self.workers.each(lambda k: update(bounds[k], bounds[k + 1], k))

    def _scratch(self, k: int, dtype) -> tuple[np.ndarray, np.ndarray]:
        """Worker k's two chunk-sized scratch arrays."""
        pair = self._scratch_arrays.get(k)
        if pair is None:
            pair = self._scratch_arrays[k] = (np.empty(self.CHUNK, dtype), np.empty(self.CHUNK, dtype))
        return pair

    def slice(self, lo: int, hi: int) -> "AdamW":
        """An AdamW that updates entries [lo, hi) of the layout alone and holds their moments
        alone (a copy of this one's): one rank's share under a sharded optimizer (gradsync.py)."""
        part = object.__new__(AdamW)
        part.__dict__.update(self.__dict__)
        part.lo, part.hi = lo, hi
        part.m, part.v = self.m[lo:hi].copy(), self.v[lo:hi].copy()
        part._scratch_arrays = {}
        return part

    def whole(self) -> "AdamW":
        """An AdamW over the whole layout at this one's step, with this one's slice of the moments
        in place and zeros elsewhere (for gathering the other slices into)."""
        full = AdamW(self.layout, self.weight_decay, self.beta1, self.beta2, self.eps)
        full.t, full.workers = self.t, self.workers
        full.m[self.lo:self.hi], full.v[self.lo:self.hi] = self.m, self.v
        return full

    def state_arrays(self) -> dict[str, np.ndarray]:
        """m.<name> and v.<name> for every trainable tensor: what optimizer.safetensors holds."""
        if (self.lo, self.hi) != (0, self.layout.size):
            raise ValueError("a slice of the optimizer holds part of the moments: gather them (whole())")
        out = {f"m.{k}": a for k, a in self.layout.views(self.m).items()}
        out.update({f"v.{k}": a for k, a in self.layout.views(self.v).items()})
        return out

    def load_state_arrays(self, arrays: dict[str, np.ndarray], t: int) -> None:
        """Restore the moments; every name and shape must match (nothing is broadcast)."""
        restore(self.state_arrays(), arrays, "the model")
        self.t = t


def restore(want: dict[str, np.ndarray], arrays: dict[str, np.ndarray], what: str) -> None:
    """Copy ``arrays`` into an optimizer's state ``want`` (name -> its array), once every name,
    shape and value is checked: the same names, finite values, no negative second moment."""
    if set(arrays) != set(want):
        missing = sorted(set(want) - set(arrays))[:3]
        extra = sorted(set(arrays) - set(want))[:3]
        raise ValueError(f"optimizer state does not match {what} "
                         f"({f'missing {missing}' if missing else f'unexpected {extra}'})")
    for k, dst in want.items():
        a = arrays[k]
        if a.shape != dst.shape:
            raise ValueError(f"optimizer state {k} has shape {a.shape}, the model needs {dst.shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"optimizer state {k} holds non-finite values")
        if k.startswith("v.") and (a < 0).any():     # a mean of squares: a negative one is damage
            raise ValueError(f"optimizer state {k} holds negative second moments")
    for k, dst in want.items():
        np.copyto(dst, arrays[k], casting="same_kind")
