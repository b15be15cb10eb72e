"""Allocator tuning for the CLI: keep freed activation memory for reuse instead of returning it.

Every training step allocates and frees the same large activation arrays. glibc's defaults
serve blocks over 128 KiB-32 MiB with fresh mmap()s and hand freed heap top back to the
kernel, so each step page-faults its activations in again (the kernel zeroes every page).
Raising the mmap and trim thresholds keeps those pages mapped across steps. This changes no
number anywhere, only where memory comes from; other platforms are left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
_done = False


def tune_malloc() -> bool:
    """Apply once per process on glibc; returns whether it took effect."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1
              and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
              and libc.mallopt(M_TOP_PAD, 64 << 20) == 1)
    except (OSError, AttributeError):     # not glibc (musl, macOS): nothing to tune
        ok = False
    _done = ok
    return ok
