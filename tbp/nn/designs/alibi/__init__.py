"""ALiBi positions (Press et al. 2022): a linear bias on the scores, no position embedding.

Its parts: ``alibi.py`` (the positions object, registered as ``--positions alibi``), ``twin.py``
(the plain loop the layer must equal) and the declaration below (what tbp asks of it)."""
from . import alibi  # noqa: F401  (registers --positions alibi and its declaration)
