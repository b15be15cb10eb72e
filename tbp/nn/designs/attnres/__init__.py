"""Attention Residuals (Kimi Team 2026): each sublayer's input a learned softmax over depth.

Its parts: ``depth.py`` (the depth attention: one operation's softmax over the sources, its
backward), ``attnres.py`` (the residual scheme registered as ``--residual attention``, its
declaration, and what tbp view shows of it: the depth map) and ``twin.py`` (the whole model the
plain way, forward and backward)."""
from . import attnres  # noqa: F401  (registers --residual attention and its declaration)
