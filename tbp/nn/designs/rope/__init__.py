"""Rotary positions (Su et al. 2021): queries and keys rotated by their position, no position
embedding; past the context, attention slides over the last n_ctx positions.

Its parts: ``rope.py`` (the positions object, registered as ``--positions rope``, its
declaration and its gradcheck cases) and ``twin.py`` (the rotation written the plain way; the
core's GPT twin takes it as ``rotate``, and grouped-query attention's and sparse decoding's twins
call it)."""
from . import rope  # noqa: F401  (registers --positions rope and its declaration)
