"""Rotary positions (Su et al. 2021): queries and keys rotated by their position, no position
embedding; past the context, attention slides over the last n_ctx positions.

Its parts: ``rope.py`` (the positions object, registered as ``--positions rope``, its
declaration and its gradcheck cases). Its plain twin is the core's (``reference.rope_forward``,
``rope_backward``): the GPT twin and grouped-query attention's twin use it too."""
from .rope import VARIANT, Rotary

__all__ = ["Rotary", "VARIANT"]
