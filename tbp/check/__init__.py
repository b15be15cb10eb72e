"""tbp's own proofs and measurements: gradient checks (``gradcheck``) over every layer and
design (``cases``), and the throughput behind ``tbp bench`` (``bench``)."""
