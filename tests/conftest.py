import numpy as np
import pytest


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
