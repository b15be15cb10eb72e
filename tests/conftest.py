import os

import numpy as np
import pytest

# The library for the engine's products is chosen by timing (tbp/blas.py); pin it, so that no
# result depends on the machine's speed at that moment. TBP_GEMM=mkl runs the suite through MKL.
os.environ.setdefault("TBP_GEMM", "numpy")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


CORPUS = "".join(f"{i % 7} the cat sat on the mat; the dog ate the log. line {i}\n" for i in range(600))


@pytest.fixture
def corpus_file(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(CORPUS)
    return p


@pytest.fixture
def dataset(tmp_path):
    from tbp import data
    data.prepare(CORPUS, "tiny", "test", tmp_path / "tiny")
    return data.Dataset.load(tmp_path / "tiny")
