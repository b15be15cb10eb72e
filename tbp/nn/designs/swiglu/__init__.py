"""SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): the feed-forward sublayer as a
gated linear unit, one projection gating another through SiLU -- the MLP of the Llama family.

Its parts: ``swiglu.py`` (its option, the layer registered as ``--mlp swiglu``, its declaration)
and ``twin.py`` (the same equations written the plain way, which the layer must equal)."""
from . import swiglu  # noqa: F401  (registers --mlp swiglu and its declaration)
