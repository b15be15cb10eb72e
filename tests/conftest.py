import os

import numpy as np
import pytest

# The library for the engine's products is chosen by timing (tbp/machine/libraries.py); pin it, so that no
# result depends on the machine's speed at that moment. TBP_GEMM=mkl runs the suite through MKL.
os.environ.setdefault("TBP_GEMM", "numpy")

# CI installs every extra (.ci/run), so there a skip means something is missing that a test
# needs: it fails, with the reason the skip gave. Elsewhere a skip is reported with its reason
# (pytest -rs, in pyproject.toml) and the extra that brings what is missing.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_fails_in_ci(report) -> None:
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where every extra is installed and nothing may be skipped: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _skip_fails_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _skip_fails_in_ci(outcome.get_result())


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
    from tbp.data import datasets
    datasets.prepare(CORPUS, "tiny", "test", tmp_path / "tiny")
    return datasets.Dataset.load(tmp_path / "tiny")


# What makes a test a design's own, for the check that removing one design's folder and its
# registration line leaves every other test green (tests/without_design.sh, TBP_WITHOUT=FOLDER):
# a test file that imports the design's code (left out there), a test whose code or parameters
# spell the design's names (helpers.DESIGN_WORDS), or one marked @pytest.mark.design("folder").
# Those are deselected there, never skipped; in a whole tree (no TBP_WITHOUT) every test runs.
def pytest_configure(config):
    config.addinivalue_line("markers", "design(*folders): the test needs these designs (their folders' names)")


def _needs(item, gone: str) -> bool:
    import inspect
    from helpers import designs_named
    if any(gone in marker.args for marker in item.iter_markers("design")):
        return True
    try:
        text = inspect.getsource(item.function)
    except (OSError, TypeError):
        text = ""
    return gone in designs_named(text + repr(getattr(getattr(item, "callspec", None), "params", "")))


def pytest_collection_modifyitems(config, items):
    gone = os.environ.get("TBP_WITHOUT")
    if not gone:
        return
    keep, drop = [], []
    for item in items:
        (drop if _needs(item, gone) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
