"""The engine's product seam (tbp.nn.gemm) and the library behind it (tbp.machine.libraries): NumPy by
default, MKL's sgemm when installed and chosen. The MKL tests skip where it cannot be loaded
(``pip install -e '.[mkl]'``)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tbp.machine import libraries
from tbp.errors import TbpError
from tbp.nn.gpt import GPT
from tbp.nn.config import ModelConfig
from tbp.nn import gemm
from tbp.train.parallel import DataParallel

CFG = dict(vocab_size=23, n_ctx=32, n_layer=2, n_head=4, d_model=64)


@pytest.fixture
def mkl():
    lib = libraries.mkl()
    if lib is None:
        pytest.skip("MKL cannot be loaded here (pip install -e '.[mkl]')")
    return lib


def _operand(rng, shape, transposed, dtype=np.float32):
    """A (rows, cols) matrix, stored row-major or as the transpose of a row-major array."""
    if transposed:
        return rng.standard_normal(shape[::-1]).astype(dtype).T
    return rng.standard_normal(shape).astype(dtype)


def test_numpy_is_the_default_and_using_restores_it():
    assert isinstance(gemm.library, gemm.NumPy) and gemm.matmul == gemm.NumPy.matmul
    calls = []

    class Counting(gemm.NumPy):
        def matmul(self, a, b):
            calls.append("p")
            return np.dot(a, b)
    with gemm.using(Counting()):
        gemm.matmul(np.eye(2), np.eye(2))
        assert gemm.matmul_add == gemm.NumPy.matmul_add
    assert calls == ["p"] and isinstance(gemm.library, gemm.NumPy) and gemm.matmul == gemm.NumPy.matmul


def test_column_sums_add_is_the_sum_over_rows(rng):
    a = rng.standard_normal((37, 5))
    out = np.ones(5)
    gemm.column_sums_add(out, a)
    np.testing.assert_allclose(out, 1 + a.sum(axis=0), rtol=1e-13)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_mkl_products_equal_numpys_to_float32_rounding(mkl, rng, ta, tb):
    m, k, n = 96, 160, 112                                     # m k n above MIN_WORK
    assert m * k * n >= libraries.MIN_WORK
    a, b = _operand(rng, (m, k), ta), _operand(rng, (k, n), tb)
    exact = np.dot(a.astype(np.float64), b.astype(np.float64))
    got, ref = mkl.matmul(a, b), np.dot(a, b)
    assert got.dtype == np.float32 and got.shape == (m, n) and got.flags.c_contiguous
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)     # the rounding's scale
    assert np.max(np.abs(got - exact) / scale) < 4 * k * np.finfo(np.float32).eps
    assert np.max(np.abs(got - exact) / scale) < 10 * np.max(np.abs(ref - exact) / scale) + 1e-7
    out = rng.standard_normal((m, n)).astype(np.float32)
    before = out.copy()
    mkl.matmul_add(out, a, b)
    np.testing.assert_allclose(out, before + exact, rtol=0, atol=float(4 * k * np.finfo(np.float32).eps * scale.max()))


def test_mkl_leaves_what_it_cannot_do_to_numpy_bit_for_bit(mkl, rng):
    big = rng.standard_normal((128, 200)).astype(np.float32)
    w = rng.standard_normal((200, 96)).astype(np.float32)
    cases = [
        (big.astype(np.float64), w.astype(np.float64)),       # float64: gradient checks stay NumPy's
        (big[:, ::2], w[::2]),                                 # neither row- nor column-contiguous
        (big[:4, :8], w[:8, :4]),                              # small: below MIN_WORK
        (big[:1], w),                                          # one row: a matrix-vector product
    ]
    for a, b in cases:
        assert np.array_equal(mkl.matmul(a, b), np.dot(a, b))
        out = np.zeros((a.shape[0], b.shape[1]), a.dtype)
        mkl.matmul_add(out, a, b)
        assert np.array_equal(out, np.zeros_like(out) + np.dot(a, b))


def test_a_training_step_with_mkl_matches_numpy(mkl, monkeypatch):
    """The whole model's loss and gradients through MKL equal NumPy's to float32 rounding."""
    model = GPT(ModelConfig(**CFG), seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 23, (4, 32)), rng.integers(0, 23, (4, 32))
    calls = []
    sgemm = mkl._sgemm
    monkeypatch.setattr(mkl, "_sgemm", lambda *args: calls.append(args[3:6]) or sgemm(*args))
    grads = []
    for product in (None, mkl):
        model.zero_grad()
        with gemm.using(product):
            loss = model.accumulate(x, y)
        grads.append((loss, model.layout.grads.copy()))
    (l0, g0), (l1, g1) = grads
    # MKL did the products above MIN_WORK: y, dW and dx of c_attn, c_fc and mlp.c_proj in both
    # layers (attn.c_proj's 128 x 64 x 64 and the head's are below it, and stay NumPy's)
    assert len(calls) == 2 * 3 * 3 and (128, 192, 64) in calls and (64, 64, 128) not in calls
    assert abs(l0 - l1) < 1e-5 * abs(l0)
    assert np.abs(g0 - g1).max() < 1e-4 * np.abs(g0).max()


def _choose(monkeypatch, mode, **fakes):
    monkeypatch.setenv("TBP_GEMM", mode)
    for name, value in fakes.items():
        monkeypatch.setattr(libraries, name, value)
    return libraries.choose(libraries.products(64, 128))


def test_the_choice_follows_tbp_gemm_and_the_measurement(monkeypatch):
    fake = type("FakeMKL", (), {"version": "2099.1"})()
    numpy = "scipy-openblas 0.3.31"
    assert _choose(monkeypatch, "numpy", mkl=lambda: fake).name == "numpy"
    choice = _choose(monkeypatch, "auto", mkl=lambda: fake, numpy_blas=lambda: numpy, _measured=lambda s, t: 0.8)
    assert (choice.name, choice.ratio) == ("mkl", 0.8) and "0.80x the time of scipy-openblas" in choice.reason
    choice = _choose(monkeypatch, "auto", mkl=lambda: fake, numpy_blas=lambda: numpy, _measured=lambda s, t: 0.99)
    assert choice.name == "numpy" and "measured at 0.99x" in choice.reason
    choice = _choose(monkeypatch, "auto", mkl=lambda: None, numpy_blas=lambda: numpy)
    assert choice.name == "numpy" and "not installed" in choice.reason
    choice = _choose(monkeypatch, "auto", mkl=lambda: fake, numpy_blas=lambda: "mkl 2024.2")
    assert choice.name == "numpy" and "already" in choice.reason            # a conda NumPy: left alone
    assert _choose(monkeypatch, "mkl", mkl=lambda: fake).name == "mkl"
    with pytest.raises(TbpError, match="cannot be loaded"):
        _choose(monkeypatch, "mkl", mkl=lambda: None)
    with pytest.raises(TbpError, match="TBP_GEMM must be"):
        _choose(monkeypatch, "fast")


def test_data_parallel_installs_the_choice_and_restores_numpy(mkl, monkeypatch):
    monkeypatch.setenv("TBP_GEMM", "mkl")
    with DataParallel(GPT(ModelConfig(**CFG)), 2, rows=64) as dp:
        assert dp.gemm.name == "mkl" and gemm.library is mkl
    assert isinstance(gemm.library, gemm.NumPy)


def test_measure_times_both_libraries(mkl, monkeypatch):
    # a clock that each product advances, NumPy's by 2, MKL's by 1: the ratio is exact, and
    # no machine's load can move it (the real products still run, on the real operands)
    clock = [0.0]
    monkeypatch.setattr(libraries.time, "perf_counter", lambda: clock[0])
    real_dot, real_matmul = np.dot, mkl.matmul

    def dot(a, b):
        clock[0] += 2.0
        return real_dot(a, b)

    def matmul(a, b):
        clock[0] += 1.0
        return real_matmul(a, b)

    monkeypatch.setattr(libraries.np, "dot", dot)
    monkeypatch.setattr(mkl, "matmul", matmul)
    assert libraries.measure(mkl, libraries.products(64, 128), rounds=3) == 0.5      # MKL's time over NumPy's


def test_bench_reports_the_library_and_a_bad_setting_is_one_line(tmp_path):
    base = [sys.executable, "-m", "tbp", "bench", "--json", "--n-layer", "1", "--n-head", "2", "--d-model", "16",
            "--n-ctx", "16", "--batch-size", "2", "--iters", "2", "--gen-tokens", "0"]
    out = subprocess.run(base, capture_output=True, text=True, env={**os.environ, "TBP_GEMM": "numpy"}, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert (res["train_gemm"], res["train_gemm_reason"]) == ("numpy", "TBP_GEMM=numpy")
    bad = subprocess.run(base, capture_output=True, text=True, env={**os.environ, "TBP_GEMM": "fast"})
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == ["Error: TBP_GEMM must be auto, numpy, mkl or onednn, got 'fast'"]


def test_a_bad_setting_leaves_blas_as_it_was(monkeypatch):
    from tbp.machine.cores import openblas
    fns = openblas()
    if fns is None:
        pytest.skip("NumPy's OpenBLAS thread count cannot be read here")
    before = fns[0]()
    monkeypatch.setenv("TBP_GEMM", "fast")
    with pytest.raises(TbpError):
        DataParallel(GPT(ModelConfig(**CFG)), 2).__enter__()
    assert fns[0]() == before and isinstance(gemm.library, gemm.NumPy)
