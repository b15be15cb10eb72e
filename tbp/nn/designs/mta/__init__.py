"""Multi-Token Attention (Golovneva et al. 2025): convolutions over the attention map.

Its parts: ``mta.py`` (the layer, registered as ``--attention mta``, its decoding, its
declaration and what ``tbp view`` shows of it), ``map.py`` (the steps between the scores and
the output, with their backward) and ``twin.py`` (the plain loops the layer must equal)."""
from . import mta  # noqa: F401  (registers --attention mta and its declaration)
