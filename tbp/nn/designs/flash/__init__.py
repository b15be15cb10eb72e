"""FlashAttention (Dao et al. 2022; Dao 2023): exact attention in tiles, O(T) memory.

Its parts: ``flash.py`` (the tiled forward and backward, and the kernel object registered as
``--attn-impl flash``, which ``auto`` picks from the context it declares) and the declaration
below. Its plain twin is the dense kernel: the same numbers, every score kept."""
from . import flash  # noqa: F401  (registers --attn-impl flash and its declaration)
