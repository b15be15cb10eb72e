"""QK-norm (Henry et al. 2020; Dehghani et al. 2023; the modded-nanogpt speedruns): each head's
query and key RMS-normalised before their product, so a score is bounded by the scale whatever
the weights grow to.

Its parts: ``qknorm.py`` (its options, the normalisation that composes with the model's own
positions, the layer registered as ``--attention qknorm``, its declaration) and ``twin.py``
(the plain loop over heads the layer must equal)."""
from . import qknorm  # noqa: F401  (registers --attention qknorm and its declaration)
