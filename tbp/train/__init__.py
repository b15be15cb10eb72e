"""A training run: its options (``config``), how it starts -- new, resumed, from another run, as
MPI ranks (``launch``, ``ranks``) --, the loop (``loop``: ``Trainer``), the optimizer
(``optim``), threads and ranks (``parallel``, ``distributed``, ``gradsync``), evaluation
(``evaluate``) and what it reports on the way (``layerstats``, ``tensorboard``)."""
