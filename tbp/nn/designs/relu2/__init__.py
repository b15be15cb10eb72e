"""ReLU² (So et al. 2021, "Primer: Searching for Efficient Transformers"; the modded-nanogpt
speedruns): the standard MLP with relu(u)^2 in place of GELU -- a sparse, cheap nonlinearity
that learns faster per step at small scale.

Its parts: ``relu2.py`` (the layer registered as ``--mlp relu2``, its declaration) and
``twin.py`` (the same equations written the plain way, which the layer must equal)."""
from . import relu2  # noqa: F401  (registers --mlp relu2 and its declaration)
