"""bf16 products (tbp train --precision bf16): the rounding, the plain twin, MKL's product held to
the twin, a training step held to fp32's, and the run's record of it.

Tolerances come from bf16's 8 significant bits: rounding to nearest has a relative error of at
most u = 2^-8 per operand, so each term a_i b_i of a product is off by at most ~2u of itself."""
import json
import re

import numpy as np
import pytest
from helpers import TINY, clean_fail, run, train_tiny

from tbp.machine import libraries
from tbp.train.config import ConfigError, TrainConfig
from tbp.errors import TbpError
from tbp.nn.gpt import GPT
from tbp.nn.config import ModelConfig
from tbp.nn import gemm
from tbp.nn.batch import Batch
from tbp.train.parallel import data_parallel
from tbp.machine.cores import blas_threads

U = 2.0 ** -8                       # bf16's unit roundoff
CFG = dict(vocab_size=29, n_ctx=32, n_layer=2, n_head=4, d_model=64)


def _f32(*values):
    return np.array(values, np.float32)


def test_round_bf16_is_nearest_with_ties_to_even():
    one = 1.0
    # bf16 keeps 7 fraction bits: neighbours of 1 are 1 and 1 + 2^-7; 1 + 2^-8 is the midpoint
    got = gemm.round_bf16(_f32(one + 2 ** -8, one + 3 * 2 ** -8, one + 2 ** -8 + 2 ** -20, one + 2 ** -9,
                               -(one + 2 ** -8 + 2 ** -20)))
    assert got.tolist() == [1.0, 1.0 + 2 ** -6, 1.0 + 2 ** -7, 1.0, -(1.0 + 2 ** -7)]
    special = gemm.round_bf16(_f32(np.inf, -np.inf, -0.0, 3.4e38, 2.0 ** -130))
    assert special[0] == np.inf and special[1] == -np.inf and np.signbit(special[2]) and special[2] == 0
    assert special[3] == np.inf                               # past bf16's largest finite: rounds up to inf
    assert special[4] == 2.0 ** -130                           # a subnormal bf16 represents exactly
    nan = np.array([0x7FC00000, 0x7F800001, 0xFF80FFFF], np.uint32).view(np.float32)
    assert np.isnan(gemm.round_bf16(nan)).all()               # a NaN whose payload is in the dropped bits too


def test_round_bf16_matches_ml_dtypes_and_keeps_layout(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed: pip install -e '.[mkl]'")
    x = (rng.standard_normal((300, 70)) * np.exp(rng.uniform(-40, 40, (300, 70)))).astype(np.float32)
    for view in (x, x.T, x[::3, 1::2]):
        got = gemm.round_bf16(view)
        assert got.shape == view.shape
        np.testing.assert_array_equal(got, view.astype(ml_dtypes.bfloat16).astype(np.float32))
        np.testing.assert_array_equal(libraries.bf16_bits(view), view.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert gemm.round_bf16(x.T).flags.f_contiguous              # a transposed operand stays transposed
    with pytest.raises(TypeError):
        gemm.round_bf16(x.astype(np.float64))


def test_bf16_bits_without_ml_dtypes_are_the_same(rng, monkeypatch):
    import sys
    pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed: pip install -e '.[mkl]'")
    x = rng.standard_normal((40, 30)).astype(np.float32)
    x.flat[:3] = np.array([0x7F800001, 0xFFC00000, 0x7F80FFFF], np.uint32).view(np.float32)   # NaNs
    x.flat[3:6] = [np.inf, -np.inf, 3.4e38]
    with_ml = libraries.bf16_bits(x)
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)        # import fails: the NumPy bits
    without = libraries.bf16_bits(x)
    np.testing.assert_array_equal(without[~np.isnan(x)], with_ml[~np.isnan(x)])
    nan_bits = without[np.isnan(x)]                            # NaN stays NaN (never 0x7f80, infinity)
    assert ((nan_bits & 0x7F80) == 0x7F80).all() and ((nan_bits & 0x007F) != 0).all()
    finite = np.isfinite(x)
    np.testing.assert_array_equal(without[finite].astype(np.uint32) << 16, gemm.round_bf16(x)[finite].view(np.uint32))


def test_the_twin_is_the_exact_product_of_rounded_operands(rng):
    a = rng.standard_normal((50, 200)).astype(np.float32)
    b = rng.standard_normal((200, 30)).astype(np.float32)
    exact = gemm.round_bf16(a).astype(np.float64) @ gemm.round_bf16(b).astype(np.float64)
    got = gemm.BF16.matmul(a, b)
    assert got.dtype == np.float32
    # the only error left is float32 accumulation's
    assert np.abs(got - exact).max() <= 200 * 2.0 ** -24 * (np.abs(a) @ np.abs(b)).max()
    # and the rounding happened: the fp32 product is farther from it than accumulation explains
    fp32 = np.dot(a, b)
    assert np.abs(fp32 - exact).max() > 10 * np.abs(got - exact).max()
    assert np.abs(fp32 - got).max() <= 4 * U * (np.abs(a) @ np.abs(b)).max()
    out = np.ones((50, 30), np.float32)
    gemm.BF16.matmul_add(out, a, b)
    np.testing.assert_array_equal(out, np.float32(1) + got)
    x64 = rng.standard_normal((5, 4))                           # float64 checks pass through unrounded
    np.testing.assert_array_equal(gemm.BF16.matmul(x64, x64.T), x64 @ x64.T)


@pytest.fixture
def mkl():
    lib = libraries.mkl()
    if lib is None or not lib.has_bf16:
        pytest.skip("MKL with cblas_gemm_bf16bf16f32 cannot be loaded here (pip install -e '.[mkl]')")
    return libraries.MKLBF16(lib)


def _onednn_lacks_bf16() -> bool:
    """oneDNN is installed but has no bf16 product for this CPU (before 3.3, none without AVX-512)."""
    from tbp.machine import onednn
    lib = onednn.onednn()
    return lib is not None and not lib.has_bf16


# the libraries with a bf16 product here; oneDNN not installed stays, and is skipped with its reason
BF16_LIBS = ["mkl"] + ([] if _onednn_lacks_bf16() else ["onednn"])


@pytest.fixture(params=BF16_LIBS)
def bf16lib(request):
    """Each library that does bf16 products: MKL's cblas_gemm_bf16bf16f32, oneDNN's matmul."""
    if request.param == "mkl":
        return request.getfixturevalue("mkl")
    from tbp.machine import onednn
    lib = onednn.onednn()
    if lib is None:
        pytest.skip("oneDNN cannot be loaded here (pip install -e '.[onednn]')")
    return onednn.OneDNNBF16(lib)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_bf16_library_products_equal_the_twin_to_float32_accumulation(bf16lib, rng, ta, tb):
    mkl = bf16lib
    m, k, n = 96, 160, 112
    assert m * k * n >= libraries.MIN_WORK                          # the library's, not the twin's fallback
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    a, b = (a.T if ta else a), (b.T if tb else b)
    twin = gemm.BF16.matmul(a, b)
    bound = k * 2.0 ** -24 * (np.abs(a) @ np.abs(b)).max()
    assert np.abs(mkl.matmul(a, b) - twin).max() <= bound
    out = np.full((m, n), 2.0, np.float32)
    mkl.matmul_add(out, a, b)
    assert np.abs(out - (2 + twin)).max() <= bound + 2 * 2.0 ** -24
    assert np.abs(np.dot(a, b) - twin).max() > 10 * np.abs(mkl.matmul(a, b) - twin).max()   # bf16, not sgemm


def test_a_bf16_library_leaves_small_products_to_the_twin_exactly(bf16lib, rng):
    a, b = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)
    np.testing.assert_array_equal(bf16lib.matmul(a, b), gemm.BF16.matmul(a, b))


def test_bf16_products_from_several_threads_are_each_their_own(bf16lib, rng):
    """Workers call one library object at once (oneDNN: a stream and memory objects per thread):
    every thread's product is its own operands'."""
    from concurrent.futures import ThreadPoolExecutor
    pairs = [(rng.standard_normal((96, 160)).astype(np.float32), rng.standard_normal((160, 112)).astype(np.float32))
             for _ in range(8)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ab: bf16lib.matmul(*ab), pairs * 3))
    for (a, b), out in zip(pairs * 3, got):
        twin = gemm.BF16.matmul(a, b)
        assert np.abs(out - twin).max() <= 160 * 2.0 ** -24 * (np.abs(a) @ np.abs(b)).max()


def test_a_onednn_without_a_bf16_product_for_this_cpu_is_declined_in_one_line(monkeypatch):
    """oneDNN before 3.3 describes no bf16 product on an AVX2-only CPU: TBP_GEMM=onednn says so
    (exit 1, one line), and auto does bf16 with what is left, naming why oneDNN is not used."""
    from tbp.machine import onednn

    class NoBF16:
        version, has_bf16 = "3.2.0", False
    monkeypatch.setattr(onednn, "onednn", lambda: NoBF16())
    monkeypatch.setenv("TBP_GEMM", "onednn")
    with pytest.raises(TbpError, match=r"TBP_GEMM=onednn, but oneDNN 3.2.0 has no bf16 product for this CPU"):
        libraries.choose(libraries.products(64, 128), None, "bf16")
    monkeypatch.setenv("TBP_GEMM", "auto")
    monkeypatch.setattr(libraries, "mkl", lambda: None)
    c = libraries.choose(libraries.products(64, 128), None, "bf16")
    assert c.name == "numpy-bf16" and "oneDNN 3.2.0 has no bf16 product for this CPU" in c.reason


def test_onednn_says_whether_it_has_a_bf16_product_by_describing_one():
    """``has_bf16`` is the answer of oneDNN itself: where it says yes, a product runs; where no,
    describing one fails as the probe did (the bf16 choice then never picks oneDNN)."""
    from tbp.machine import onednn
    lib = onednn.onednn()
    if lib is None:
        pytest.skip("oneDNN cannot be loaded here (pip install -e '.[onednn]')")
    if lib.has_bf16:
        a = np.ones((128, 128), np.float32)
        assert np.array_equal(onednn.OneDNNBF16(lib).matmul(a, a), np.full((128, 128), 128, np.float32))
    else:
        with pytest.raises(RuntimeError, match="matmul descriptor"):
            onednn.product(lib, 32, 32, 32, False)


def _step(precision: str, seed: int = 0):
    model = GPT(ModelConfig(**CFG), seed=3)
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, CFG["vocab_size"], (2, 4, CFG["n_ctx"]))
    with data_parallel(model, 1, 4, precision=precision) as workers:
        model.zero_grad()
        loss = workers.accumulate(Batch(x, y))
        chosen = workers.gemm
    return loss, model.layout.grads.copy(), chosen


@pytest.mark.parametrize("gemm_env", ["numpy", "auto"])
def test_a_bf16_training_step_is_fp32s_to_bf16_rounding(monkeypatch, gemm_env):
    monkeypatch.setenv("TBP_GEMM", gemm_env)
    loss32, g32, c32 = _step("fp32")
    loss16, g16, c16 = _step("bf16")
    assert c32.precision == "fp32" and c16.precision == "bf16" and c16.name.endswith("-bf16")
    # the loss: each logit is off by ~u of its terms' size, the mean of the cross-entropy by less
    assert abs(loss16 - loss32) <= U * loss32
    # the gradient, over every parameter: a few u (layers compound it); and bf16 did act
    rel = np.linalg.norm(g16 - g32) / np.linalg.norm(g32)
    assert U / 64 < rel < 8 * U, rel
    cos = g16 @ g32 / np.linalg.norm(g16) / np.linalg.norm(g32)
    assert cos > 1 - 8 * U ** 2 * 64


def test_fp32_is_untouched_by_the_precision_option(monkeypatch):
    monkeypatch.setenv("TBP_GEMM", "numpy")
    loss, g, choice = _step("fp32")
    model = GPT(ModelConfig(**CFG), seed=3)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, CFG["vocab_size"], (2, 4, CFG["n_ctx"]))
    model.zero_grad()
    with blas_threads(1):                  # one worker is one core, its BLAS too (parallel.py)
        assert model.loss_and_backward(x, y) == loss
    np.testing.assert_array_equal(model.layout.grads, g)
    assert choice.name == "numpy"


def test_the_bf16_choice_says_what_it_does(monkeypatch):
    monkeypatch.setenv("TBP_GEMM", "numpy")
    c = libraries.choose(libraries.products(64, 128), None, "bf16")
    assert (c.name, c.precision, c.slower) == ("numpy-bf16", "bf16", True) and "emulated in NumPy" in c.reason
    monkeypatch.setenv("TBP_GEMM", "auto")
    from tbp.machine import onednn
    monkeypatch.setattr(libraries, "mkl", lambda: None)
    monkeypatch.setattr(onednn, "onednn", lambda: None)
    c = libraries.choose(libraries.products(64, 128), None, "bf16")
    assert c.name == "numpy-bf16" and "pip install 'tbp[onednn]'" in c.reason
    for mode in ("mkl", "onednn"):
        monkeypatch.setenv("TBP_GEMM", mode)
        with pytest.raises(TbpError, match=f"TBP_GEMM={mode}"):
            libraries.choose(libraries.products(64, 128), None, "bf16")
    with pytest.raises(ValueError, match="precision"):
        libraries.choose(libraries.products(64, 128), None, "fp16")


def test_a_measured_bf16_choice_names_its_ratio_and_the_cpu(mkl, monkeypatch):
    monkeypatch.setenv("TBP_GEMM", "auto")
    from tbp.machine import onednn
    with monkeypatch.context() as m:
        m.setattr(onednn, "onednn", lambda: None)                     # MKL alone
        c = libraries.choose(libraries.products(64, 256), None, "bf16")
    assert c.name == "mkl-bf16" and c.ratio is not None and f"{c.ratio:.2f}x" in c.reason
    assert c.slower == (c.ratio > 1.0)
    assert ("bf16 units" in c.reason)
    dnnl = onednn.onednn()
    if dnnl is None:
        pytest.skip("oneDNN cannot be loaded here (pip install -e '.[onednn]')")
    c = libraries.choose(libraries.products(64, 256), None, "bf16")
    if not dnnl.has_bf16:                       # oneDNN here has no bf16 product: MKL's, oneDNN unmeasured
        assert c.name == "mkl-bf16" and "oneDNN" not in c.reason
        return
    # both: the faster, the other named
    assert c.name in ("mkl-bf16", "onednn-bf16") and "oneDNN" in c.reason and "MKL" in c.reason
    # the other library's ratio, as the choice measured it (printed to two places): never lower
    other = float(re.search(r"; (?:MKL|oneDNN) \S+ measured at ([0-9.]+)x", c.reason)[1])
    assert round(c.ratio, 2) <= other
    monkeypatch.setenv("TBP_GEMM", "onednn")
    assert libraries.choose(libraries.products(64, 256), None, "bf16").name == "onednn-bf16"


def test_onednns_rounding_is_the_engines_bit_for_bit(rng):
    """The reorder that feeds oneDNN's products rounds as gemm.round_bf16 does: ties to even,
    infinities, NaNs and values past bf16's largest, in C and in transposed layouts."""
    from tbp.machine import onednn
    lib = onednn.onednn()
    if lib is None:
        pytest.skip("oneDNN cannot be loaded here (pip install -e '.[onednn]')")
    prod = onednn.OneDNNBF16(lib)
    x = (rng.standard_normal((64, 48)) * 10.0 ** rng.integers(-30, 30, (64, 48))).astype(np.float32)
    x[0, :6] = [np.inf, -np.inf, 3.3961e38, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -0.0]    # overflow, both ties
    for view in (x, x.T):
        got = prod._bf16(view, "a")
        want = gemm.round_bf16(np.ascontiguousarray(view))
        back = (got.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(back, want)
    x[1, 1] = np.nan
    assert np.isnan((prod._bf16(x, "a").astype(np.uint32) << 16).view(np.float32)[1, 1])


def test_bf16_with_float64_is_a_usage_error(tmp_path, corpus_file, monkeypatch):
    with pytest.raises(ConfigError, match="precision bf16"):
        TrainConfig(precision="bf16", dtype="float64")
    monkeypatch.chdir(tmp_path)
    clean_fail(run(["train", "--data", corpus_file, "--out", "r", "--precision", "bf16", "--dtype", "float64",
                    *TINY]), 2, "precision bf16")
    assert not (tmp_path / "r").exists()
    clean_fail(run(["train", "--data", corpus_file, "--out", "r", "--precision", "fp16", *TINY]), 2, "fp16")


def test_a_bf16_run_records_says_and_resumes_its_precision(tmp_path, corpus_file, monkeypatch):
    monkeypatch.setenv("TBP_GEMM", "numpy")
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 5, "--precision", "bf16", *TINY])
    assert r.exit_code == 0, r.output
    assert "precision bf16: bf16 rounding emulated in NumPy" in r.output
    assert json.loads((tmp_path / "r" / "config.json").read_text())["train"]["precision"] == "bf16"
    info = run(["info", tmp_path / "r"])
    assert info.exit_code == 0 and "trained with bf16 products" in info.output
    r = run(["train", "--out", "r", "--resume", "--max-iters", 10, "-q"])
    assert r.exit_code == 0, r.output
    assert "precision bf16" in r.output                        # the run's own precision, kept
    assert json.loads((tmp_path / "r" / "config.json").read_text())["train"]["precision"] == "bf16"


def test_a_bf16_lora_run_trains(tmp_path, corpus_file, monkeypatch):
    base = train_tiny(tmp_path, corpus_file, monkeypatch, "base", 5)
    monkeypatch.setenv("TBP_GEMM", "numpy")
    r = run(["train", "--data", corpus_file, "--init-from", base, "--out", "lora", "--lora-rank", 2,
             "--max-iters", 5, "--precision", "bf16", *TINY])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "lora" / "config.json").read_text())["train"]["precision"] == "bf16"


def test_bench_pairs_the_precisions_and_names_the_bf16_units(monkeypatch):
    monkeypatch.setenv("TBP_GEMM", "numpy")
    r = run(["bench", "--n-layer", 1, "--n-head", 2, "--d-model", 16, "--n-ctx", 16, "--batch-size", 2,
             "--iters", 5, "--gen-tokens", 0, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    paired = d["precisions"]
    assert paired["precision_rounds"] == 5 and paired["precision_steps"] == 1 and paired["bf16_speedup"] > 0
    few = json.loads(run(["bench", "--n-layer", 1, "--n-head", 2, "--d-model", 16, "--n-ctx", 16, "--batch-size", 2,
                          "--iters", 2, "--gen-tokens", 0, "--json"]).stdout)["precisions"]
    assert few["precision_rounds"] * few["precision_steps"] == 2         # --iters steps of each precision
    assert paired["fp32"]["gemm"] == "numpy" and paired["bf16"]["gemm"] == "numpy-bf16"
    assert d["train_tokens_per_s"] == paired["fp32"]["tokens_per_s"] and "bf16_units" in d["machine"]
    one = json.loads(run(["bench", "--n-layer", 1, "--n-head", 2, "--d-model", 16, "--n-ctx", 16, "--batch-size", 2,
                          "--iters", 2, "--gen-tokens", 0, "--precision", "bf16", "--json"]).stdout)
    assert one["train_precision"] == "bf16" and one["train_gemm"] == "numpy-bf16" and "precisions" not in one


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bf16_runs_evaluations_use_fp32_products(monkeypatch, threads):
    """Training steps round to bf16; evaluations (the curve, the best checkpoint, the whole-split
    loss) measure the float32 weights as tbp eval and generation use them."""
    monkeypatch.setenv("TBP_GEMM", "numpy")
    model = GPT(ModelConfig(**CFG), seed=3)
    rng = np.random.default_rng(0)
    batches = [Batch(x, y) for x, y in rng.integers(0, CFG["vocab_size"], (2, 2, 4, CFG["n_ctx"]))]
    plain = [model.batch_loss(b) for b in batches]
    with data_parallel(model, threads, 4, precision="bf16") as workers:
        assert workers.losses(batches) == plain
        assert gemm.library.__class__ is gemm.BF16               # and training goes on in bf16 after it
        model.zero_grad()
        assert workers.accumulate(batches[0]) != plain[0]


def test_bench_reports_the_decode_roofline():
    r = run(["bench", "--n-layer", 1, "--n-head", 2, "--d-model", 16, "--n-ctx", 16, "--batch-size", 2,
             "--iters", 1, "--gen-tokens", 4, "--precision", "fp32", "--json"])
    d = json.loads(r.stdout)
    model = GPT(ModelConfig(vocab_size=65, n_ctx=16, n_layer=1, n_head=2, d_model=16))
    assert d["generate_weight_bytes"] == sum(p.nbytes for p in model.params.values())
    assert d["memory_gbs"] > 0
    assert d["generate_roofline_tokens_per_s"] == pytest.approx(d["memory_gbs"] * 1e9 / d["generate_weight_bytes"])
