"""The residual scheme: how each sublayer's input is made from the ones before it.   [paper §7]

A model owns one scheme and its blocks call it, in each of the stack's three lives:

- training forward: ``stream = scheme.stream(x0)``; each sublayer reads its input
  ``h = stream.read(op)`` and hands back its output ``stream.write(f(norm(h)))``; the state
  before ``ln_f`` is ``stream.finish()``;
- training backward, in reverse: ``grad = scheme.grad(dxf)``; each sublayer takes the
  gradient of its output ``grad.output()`` and returns that of its input, ``grad.input(op, dh)``;
  ``grad.finish()`` is the embedding's gradient;
- decoding (decode.py): ``scheme.decode(layers, rows, step, state)`` runs every layer's
  sublayers on the shared rows, forming each input and taking each output (``rows.out``) as
  in training, and leaves the state before ``ln_f`` in ``rows.x``; ``state`` is what
  ``scheme.decode_state()`` prepared once.

``op`` is the per-sublayer module the scheme asked each block to own (:meth:`Sum.block_ops`),
or None; :meth:`Sum.decode_query` is its folded decoding form. This module's scheme
is the plain sum of pre-LN GPT-2, x_{l+1} = x_l + f_l(norm(x_l)); Attention Residuals
(attnres.py) is the other. A new scheme is a class with these methods and a registry line.
"""
from __future__ import annotations

import numpy as np

from . import registry
from .module import Module


@registry.residual("sum")
class Sum(Module):
    """The residual stream: every sublayer adds its output into one running sum. No parameters."""

    @classmethod
    def from_config(cls, cfg, dtype) -> "Sum":
        return cls()

    def ops(self, blocks) -> list:
        """The scheme's operations, in order: none."""
        return []

    def block_ops(self, layer: int) -> tuple[None, None]:
        """What the scheme needs each block to own, for its attention and MLP inputs: nothing."""
        return None, None

    def stream(self, x0: np.ndarray, outputs: list | None = None) -> "SumStream":
        return SumStream(x0, outputs)

    def grad(self, dxf: np.ndarray) -> "SumGrad":
        return SumGrad(dxf)

    # --- decoding ---------------------------------------------------------------------------
    @staticmethod
    def decode_query(op) -> None:
        return None

    @staticmethod
    def decode_state() -> None:
        return None

    @staticmethod
    def decode(layers: list, rows, step, state: None) -> None:
        """One decoding forward through every layer's sublayers (decode.py): rows.x is the
        stream, and each sublayer's output joins it. Per sublayer: the norm, the layer, one
        addition -- decoding's cost is its calls, so the scheme runs the loop itself."""
        for i, layer in enumerate(layers):
            step.layer = i
            for _, norm, vectors, sublayer, sublayer_state in layer:
                norm.decode(rows, vectors)
                sublayer.decode(rows, sublayer_state, step)
                rows.x += rows.out


class SumStream:
    """x_{j+1} = x_j + v_j. Each sublayer's output is a new array, so the sum is made in it."""

    def __init__(self, x0: np.ndarray, outputs: list | None):
        self.x, self.outputs = x0, outputs

    def read(self, op) -> np.ndarray:
        return self.x

    def write(self, v: np.ndarray) -> None:
        if self.outputs is not None:
            self.outputs.append(v.reshape(-1, v.shape[-1]).copy())
        v += self.x
        self.x = v

    def finish(self) -> np.ndarray:
        return self.x


class SumGrad:
    """The backward of the sum: the output's gradient passes around the branch and through it,
    dx_j = dx_{j+1} + (the branch's input gradient)."""

    def __init__(self, dxf: np.ndarray):
        self.d = dxf

    def output(self) -> np.ndarray:
        return self.d

    def input(self, op, dh: np.ndarray) -> None:
        dh += self.d
        self.d = dh

    def finish(self) -> np.ndarray:
        return self.d
