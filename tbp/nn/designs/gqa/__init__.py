"""Grouped-query attention (Ainslie et al. 2023): key/value heads shared by groups of query heads.

Its parts: ``gqa.py`` (the layer, registered as ``--attention gqa``, its declaration, and the
conversion of a full-head model by mean-pooling its key/value heads) and
``twin.py`` (the plain loop the layer must equal)."""
from . import gqa  # noqa: F401  (registers --attention gqa and its declaration)
