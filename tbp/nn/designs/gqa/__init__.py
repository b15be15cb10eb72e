"""Grouped-query attention (Ainslie et al. 2023): key/value heads shared by groups of query heads.

Its parts: ``gqa.py`` (the layer, registered as ``--attention gqa``, and its declaration) and
``twin.py`` (the plain loop the layer must equal)."""
from .gqa import VARIANT, GroupedQueryAttention

__all__ = ["GroupedQueryAttention", "VARIANT"]
