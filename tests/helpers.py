"""What the CLI test modules share: invoking `tbp`, asserting a clean refusal, a tiny run."""
import os
import shutil

import pytest
from click.testing import CliRunner

from tbp.cli.main import main

# a model small enough that a training run takes a fraction of a second
TINY_OPTIONS = dict(n_layer=1, n_head=2, d_model=16, n_ctx=16, batch_size=4, eval_batches=1, eval_interval=5,
                    log_interval=5)


def tiny(**changes) -> list[str]:
    """`tbp train` arguments for the tiny model, with some options changed, and -q."""
    opts = {**TINY_OPTIONS, **changes}
    return [a for k, v in opts.items() for a in (f"--{k.replace('_', '-')}", str(v))] + ["-q"]


TINY = tiny()


def run(args, **kw):
    """`tbp ARGS` in-process; arguments may be paths or numbers."""
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


def clean_fail(result, code, message):
    """Exit code as given, the message shown, and no traceback."""
    assert result.exit_code == code, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def train_tiny(tmp_path, corpus_file, monkeypatch, out, iters, *extra):
    """Train TINY on the test corpus from inside tmp_path; returns the run directory."""
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", out, "--max-iters", iters, *TINY, *extra])
    assert r.exit_code == 0, r.output
    return tmp_path / out


def browser():
    """Headless Chromium driven by Selenium, with the network cut: every http(s) request is
    refused (a proxy that does not exist, and the DevTools block list), so a page that needs the
    network fails in the test as it would offline. Needs Chromium and its driver (Debian:
    chromium, chromium-driver; CI installs both, see .ci/run) and Selenium: skipped with the
    reason where they are missing, and failed instead under CI=true."""
    why = None
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        why = "selenium is not installed"
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if why is None and not (chromium and driver_path):
        why = "Chromium and chromedriver are not installed (Debian: apt-get install chromium chromium-driver)"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests: {why}")
        pytest.skip(why)
    os.environ["SE_OFFLINE"] = "true"                # never look for a driver on the network
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,2000",
              "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["http://*", "https://*"]})
    return driver


def assert_equals_twin(layer, y, dx, y_ref, dx_ref, dw, db, dw_proj, db_proj, rtol=1e-11, atol=1e-13):
    """An attention layer's output, input gradient and parameter gradients against its plain
    twin's (``*_backward`` returns dx, dw_attn, db_attn, dw_proj, db_proj); biases where it has them."""
    import numpy as np
    tol = dict(rtol=rtol, atol=atol)
    np.testing.assert_allclose(y, y_ref, **tol)
    np.testing.assert_allclose(dx, dx_ref, **tol)
    for name, want in (("c_attn.weight", dw), ("c_attn.bias", db), ("c_proj.weight", dw_proj),
                       ("c_proj.bias", db_proj)):
        if name in layer.grads:
            np.testing.assert_allclose(layer.grads[name], want, err_msg=name, **tol)


# each design's folder -> the words that name it in a test's code or parameters (tests/conftest.py)
DESIGN_WORDS = {"alibi": ("alibi",),
                "attnres": ("attnres", 'residual="attention"', "residual_blocks", "residual_query_scale", "depth_",
                            "depth-attention", "Attention Residuals", "attention-residuals", "'residual': 'attention'",
                            "'--residual', 'attention'", '"--residual", "attention"'),
                "encdec": ("encoder-decoder", "encdec", "EncoderDecoder", "CrossAttention", "cross-attention",
                           "n_enc_layer", "pad_id", "decoder block", "decoder-block"),
                "flash": ("flash",), "gqa": ("gqa", "n_kv_head", "pool_kv_heads"), "mta": ("mta",),
                "qknorm": ("qknorm", "qk_norm"), "rope": ("rope", "rotary", "Rotary"),
                "rmsnorm": ("rmsnorm", "RMSNorm", '"norm": "rms"', "'--norm', 'rms'", '"--norm", "rms"', "Llama"),
                "swiglu": ("swiglu", "SwiGLU", "Llama"),
                "relu2": ("relu2", "ReLU²", "ReLU2"),
                "sparse": ("sparse", "SparseRule", "lessismore", "--budget")}


def designs_named(text: str) -> tuple[str, ...]:
    """The designs whose words ``text`` spells (a word not inside a longer one: "rope", not "property")."""
    import re
    return tuple(d for d, words in DESIGN_WORDS.items()
                 if any(re.search(r"(?<![A-Za-z])" + re.escape(w) + r"(?![a-z])", text) for w in words))


def mlp_against_twin(layer, twin_forward, twin_backward, rng, B: int = 2, T: int = 7):
    """A feed-forward layer with random parameters, run forward and backward on random x and dy (float64),
    beside its plain twin: (y, dx, the twin's y, the twin's (dx, dw_fc, db_fc, dw_proj, db_proj))."""
    import numpy as np
    for p in layer.params.values():
        p[...] = rng.standard_normal(p.shape)
    C = layer.c_fc.d_in
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    layer.zero_grad()
    y = layer.forward(x)
    dx = layer.backward(dy.copy())
    P = layer.params
    y_ref, cache = twin_forward(x, P["c_fc.weight"], P.get("c_fc.bias"), P["c_proj.weight"], P.get("c_proj.bias"))
    return y, dx, y_ref, twin_backward(dy, cache)
