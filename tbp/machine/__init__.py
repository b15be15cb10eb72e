"""This machine: its cores and NumPy's BLAS threads (``cores``), the library that does the
engine's products -- NumPy, MKL or oneDNN, fp32 or bf16 -- chosen by measuring (``libraries``,
``onednn``), and the memory a model, a run or a decoder needs (``memory``)."""
