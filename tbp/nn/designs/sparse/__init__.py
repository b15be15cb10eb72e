"""Sparse decoding (LessIsMore, Yang et al. 2025, and its baselines): which cached positions a
new token attends to.

Its parts: ``sparse.py`` (the rule, :class:`SparseRule`, and the selections registered on the
registry's ``sparse`` axis: lessismore, topk, window, layer-topk) and ``twin.py`` (the
selections one position at a time, and a decoding step as a masked training forward). The
decoder asks a rule what to keep (decode.py, attention.py); it never asks its name."""
from . import sparse  # noqa: F401  (registers the sparse decoding rules)
