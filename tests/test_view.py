"""tbp view: one self-contained page whose numbers are the model's, tested in a real browser.

The browser tests need Chromium and its driver (Debian: chromium, chromium-driver; CI installs
both, see .ci/run) and Selenium; where they are missing they are skipped with the reason, and
under CI=true they fail instead, so CI can never pass them by skipping.
"""
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import CORPUS
from helpers import browser, clean_fail, run, train_tiny

from tbp.runs import disk

pytest.importorskip("plotly", reason="the view extra is not installed: pip install -e '.[view]'")

PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("view")
    corpus_file = tmp / "corpus.txt"
    corpus_file.write_text(CORPUS)
    mp = pytest.MonkeyPatch()
    try:
        run_dir = train_tiny(tmp, corpus_file, mp, "r", 10)
        r = run(["view", "--checkpoint", run_dir, "--prompt", PROMPT, "--out", tmp / "r.html"])
        assert r.exit_code == 0, r.output
        weights = json.loads(run(["attention", "--checkpoint", run_dir, "--prompt", PROMPT, "--json"]).stdout
                             .splitlines()[-1])
    finally:
        mp.undo()
    return tmp / "r.html", weights, run_dir


def embedded(path) -> dict:
    text = path.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="tbp-data">(.*?)</script>', text, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_the_page_is_self_contained(page):
    text = page[0].read_text(encoding="utf-8")
    assert "<script src" not in text and "<link" not in text          # nothing fetched: all inlined
    assert 'content="tbp view"' in text and "Plotly" in text


def test_the_page_holds_the_numbers_of_tbp_attention_json(page):
    path, weights, _ = page
    data = embedded(path)["prompt"]
    assert data["tokens"] == weights["tokens"] and data["ids"] == weights["ids"]
    for layer, w in weights["layers"].items():
        assert data["attention"][int(layer)] == w
    assert embedded(path)["figures"]["grad_norm"]["layout"]["yaxis"]["ticktext"][:3] == ["wte", "wpe", "h.0.ln_1"]


def test_bad_input_one_line(page, tmp_path):
    path, _, run_dir = page
    clean_fail(run(["view", "--checkpoint", run_dir, "--prompt", "a" * 40, "--out", tmp_path / "a.html"]), 2,
               "context is 16")
    clean_fail(run(["view", "--checkpoint", run_dir, "--prompt", PROMPT, "--out", path]), 1, "already exists")
    clean_fail(run(["view", "--checkpoint", run_dir, "--prompt", PROMPT, "--out", tmp_path]), 1, "is a folder")
    foreign = tmp_path / "notes.html"
    foreign.write_text("<html>mine</html>")
    clean_fail(run(["view", "--checkpoint", run_dir, "--prompt", PROMPT, "--out", foreign, "--force"]), 1,
               "not a page tbp view wrote")
    assert foreign.read_text() == "<html>mine</html>"
    own = tmp_path / "own.html"
    shutil.copy(path, own)
    r = run(["view", "--checkpoint", run_dir, "--prompt", "hi", "--out", own, "--force"])
    assert r.exit_code == 0, r.output
    assert embedded(own)["prompt"]["tokens"] == ["h", "i"]             # its own page: replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((run_dir / "config.json").read_text())
    clean_fail(run(["view", "--checkpoint", empty, "--prompt", PROMPT, "--out", tmp_path / "b.html"]), 1,
               "no tokenizer here")                              # not a whole run
    data_dir = run_dir.parent / "data" / "corpus"
    clean_fail(run(["view", "--checkpoint", data_dir, "--prompt", PROMPT, "--out", tmp_path / "b.html"]), 1,
               "is a prepared dataset, not a checkpoint")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    clean_fail(run(["view", "--checkpoint", run_dir, "--prompt", PROMPT, "--out", fifo, "--force"]), 1,
               "is not a regular file")


def test_a_run_without_metrics_still_shows_its_prompt(page, tmp_path):
    """An imported or merged model has no metrics.jsonl: the page holds the prompt's attention
    and says the curves are absent; a --compare run, there for its curves, must have some."""
    path, weights, run_dir = page
    bare = tmp_path / "bare"
    shutil.copytree(run_dir, bare)
    (bare / "metrics.jsonl").unlink()
    r = run(["view", "--checkpoint", bare, "--prompt", PROMPT, "--out", tmp_path / "bare.html"])
    assert r.exit_code == 0, r.output
    assert "no training metrics" in " ".join(r.output.split())
    d = embedded(tmp_path / "bare.html")
    assert d["prompt"]["tokens"] == weights["tokens"] and "grad_norm" not in d["figures"]
    clean_fail(run(["view", "--checkpoint", run_dir, "--compare", bare, "--prompt", PROMPT, "--out",
                    tmp_path / "c.html"]), 1, "no metrics.jsonl lines to compare")


def test_in_a_real_browser_hovering_a_token_shows_what_it_reads(page, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    path, weights, _ = page
    driver = browser()
    try:
        driver.get(path.as_uri())
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        assert driver.find_elements(By.CSS_SELECTOR, "#fig-curves .main-svg")      # Plotly drew the curves
        spans = driver.find_elements(By.CSS_SELECTOR, "#tokens span")
        assert [s.text for s in spans][:2] == [weights["tokens"][0], weights["tokens"][1]]
        before = [s.get_attribute("style") for s in spans]
        t = 5
        ActionChains(driver).move_to_element(spans[t]).perform()
        after = [s.get_attribute("style") for s in spans]
        assert after != before and "focus" in spans[t].get_attribute("class")
        outline = driver.execute_script("return document.getElementById('fig-map').layout.shapes[0]")
        assert (outline["y0"], outline["y1"]) == (t - 0.5, t + 0.5)     # the hovered token's row, outlined
        last = str(len(weights["layers"]) - 1)                 # the page opens on the last layer, head 0
        row = np.array(weights["layers"][last][0])             # (T, T) of head 0
        shown = [float(s.get_attribute("data-weight") or "nan") for s in spans]
        roles = [s.get_attribute("data-role") for s in spans]
        for j in range(len(spans)):
            if j <= t:
                assert roles[j] == "read" and shown[j] == pytest.approx(row[t, j], abs=1e-6)
            else:
                assert roles[j] == "reader" and shown[j] == pytest.approx(row[j, t], abs=1e-6)
        driver.save_screenshot(os.environ.get("TBP_VIEW_SCREENSHOT", str(tmp_path / "view.png")))
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        driver.quit()


def test_in_a_real_browser_every_row_is_named_and_the_overview_opens_a_head(page):
    """Every heat-map row carries its label (whitespace shown as a visible mark), each chart has
    its "what to look for" line, and the overview holds one map per layer and head: a click on
    one selects that layer and head above."""
    from selenium.webdriver.common.by import By
    path, weights, _ = page
    driver = browser()
    try:
        driver.get(path.as_uri())
        T = len(weights["tokens"])
        for fig in ("fig-map", "fig-grad_norm", "fig-update_ratio"):
            labels = [t.text for t in driver.find_elements(By.CSS_SELECTOR, f"#{fig} .ytick text")]
            rows = T if fig == "fig-map" else len(embedded(path)["figures"][fig[4:]]["data"][0]["y"])
            assert len(labels) == rows and all(x.strip() for x in labels), (fig, labels)
        assert "␣" in [t.text for t in driver.find_elements(By.CSS_SELECTOR, "#fig-map .ytick text")]  # "the cat"
        looks = driver.find_elements(By.CSS_SELECTOR, "p.look")
        assert len(looks) >= 4 and all("look for" in p.text for p in looks[1:])
        config = dict(driver.execute_script(
            "return [...document.querySelectorAll('#config tr')].map(r => [...r.cells].map(c => c.textContent))"))
        assert config["n_layer"] == "1" and int(config["parameters"].replace(",", "")) > 0 and config["steps"] == "10"
        tiles = driver.find_elements(By.CSS_SELECTOR, "#overview figure")
        L, H = len(weights["layers"]), len(weights["layers"]["0"])
        assert len(tiles) == L * H
        assert [t.get_attribute("class") for t in tiles].count("current") == 1
        tiles[1].click()                                            # layer 0, head 1
        assert driver.execute_script("return [layer.value, head.value]") == ["0", "1"]
        assert "current" in tiles[1].get_attribute("class")
        title = driver.find_element(By.CSS_SELECTOR, "#fig-map .gtitle").text
        assert "layer 0" in title and "head 1" in title
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        driver.quit()


def test_with_the_library_beside_the_page_is_small_and_still_offline(page, tmp_path):
    """--plotly beside writes the chart library once next to the page; the page (a tenth of the
    inlined one's size or less) draws from it with the network cut; a file of that name that is
    not the library is left alone, with one line."""
    from selenium.webdriver.common.by import By
    from tbp.look.view import plotly_file
    _, _, run_dir = page
    out = tmp_path / "pages"
    out.mkdir()
    for name in ("a.html", "b.html"):
        r = run(["view", "--checkpoint", run_dir, "--prompt", PROMPT, "--out", out / name, "--plotly", "beside"])
        assert r.exit_code == 0, r.output
    lib = out / plotly_file()[0]
    assert sorted(p.name for p in out.iterdir()) == sorted(["a.html", "b.html", lib.name])
    assert (out / "a.html").stat().st_size * 10 < page[0].stat().st_size
    driver = browser()
    try:
        driver.get((out / "b.html").as_uri())
        assert driver.find_elements(By.CSS_SELECTOR, "#fig-curves .main-svg")
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        driver.quit()
    lib.write_text("// someone else's file\n")
    r = run(["view", "--checkpoint", run_dir, "--prompt", PROMPT, "--out", out / "c.html", "--plotly", "beside"])
    clean_fail(r, 1, "is not this Plotly's bundle")
    assert lib.read_text() == "// someone else's file\n" and not (out / "c.html").exists()


def test_dropped_and_future_positions_never_share_a_colour():
    from tbp.look.view import KEPT_COLOURS, kept_map
    shown = kept_map([[1, 0, 0], [1, 1, 0], [0.5, 0, 1]])
    assert shown == [[1, None, None], [1, 1, None], [0.5, 0, 1]]     # future: no value, the plot's grey
    assert KEPT_COLOURS[0] == [0.0, "#f4a582"] and KEPT_COLOURS[1][0] > 0   # dropped (0) has its own colour


class _CharTok:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_the_page_shows_each_design_it_has():
    """Depth weights, MTA kernels and kept positions, where the model has them: the numbers of
    the designs' own inspection and of lookinside (tbp attention --json's sources), and a page
    that builds with their charts."""
    from tbp import GPT, ModelConfig
    from tbp.look import inside, view
    from tbp.nn.designs.attnres.attnres import depth_map
    from tbp.nn.designs.sparse.sparse import SparseRule
    model = GPT(ModelConfig.from_dict(dict(vocab_size=26, n_ctx=32, n_layer=2, n_head=2, d_model=16, residual="attention",
                            attention="mta", mta_ck=3)), seed=0)
    ids = list(range(20))
    data = view.data_for_prompt(model, _CharTok(), ids)
    assert data["depth"]["mean"] == np.asarray(depth_map(model, ids)["mean"]).round(6).tolist()
    assert data["mta"]["0"]["theta"] == np.asarray(model.blocks[0].attn.mta.params["theta"]).round(6).tolist()
    metrics = [{"step": 1, "lr": 1e-3, "train_loss": 3.0}, {"step": 2, "lr": 1e-3, "train_loss": 2.9, "val_loss": 2.8}]
    shown = embedded_text(view.page([{"label": "r", "metrics": metrics}], model, _CharTok(), ids))
    figures = shown["figures"]
    assert {"curves", "depth", "mta-0-theta", "mta-1-theta"} <= set(figures) and "kept" not in figures
    assert "grad_norm" not in figures                # no per-layer statistics in these metrics: none drawn
    assert [s["charts"] for s in shown["sections"]] == [["depth"], ["mta-0-theta", "mta-1-theta"]]  # declared order
    plain = GPT(ModelConfig(vocab_size=26, n_ctx=32, n_layer=2, n_head=2, d_model=16), seed=0)   # sparse decoding
    rule = SparseRule("window", budget=8, layers=(1,))
    data = view.data_for_prompt(plain, _CharTok(), ids, rule)
    assert data["kept"]["map"] == inside.kept_positions(plain, ids, rule).round(6).tolist()
    assert "depth" not in data and "mta" not in data


def test_in_a_real_browser_each_design_draws_its_own_section(tmp_path):
    """The page draws what each design's declaration draws (its ``draw``): a heading, the
    charts and the line on what to look for, with no design named in the page's script."""
    from selenium.webdriver.common.by import By
    from tbp import GPT, ModelConfig
    from tbp.look import view
    model = GPT(ModelConfig.from_dict(dict(vocab_size=26, n_ctx=32, n_layer=2, n_head=2, d_model=16,
                                           residual="attention", attention="mta", mta_ck=3)), seed=0)
    metrics = [{"step": 1, "lr": 1e-3, "train_loss": 3.0}]
    path = tmp_path / "designs.html"
    path.write_text(view.page([{"label": "r", "metrics": metrics}], model, _CharTok(), list(range(20))))
    js = (Path(view.__file__).with_name("view.js")).read_text()
    assert not re.search(r"mta|depth|residual", js, re.I)
    driver = browser()
    try:
        driver.get(path.as_uri())
        heads = [h.text for h in driver.find_elements(By.CSS_SELECTOR, "#more h2")]
        assert heads == ["Attention Residuals over depth", "Multi-Token Attention kernels"]
        for key in ("mta-0-theta", "mta-1-theta", "depth"):
            assert driver.find_elements(By.CSS_SELECTOR, f"#fig-{key} .main-svg"), key
        looks = [p.text for p in driver.find_elements(By.CSS_SELECTOR, "#more p.look")]
        assert len(looks) == 2 and all(t.startswith("What to look for") for t in looks)
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        driver.quit()


def embedded_text(text: str) -> dict:
    m = re.search(r'<script type="application/json" id="tbp-data">(.*?)</script>', text, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_an_encoder_decoder_page_holds_its_cross_attention(tmp_path, monkeypatch):
    from helpers import tiny
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--task", "reverse", "--examples", "300", "--max-len", "5"]).exit_code == 0
    r = run(["train", "--data", "data/reverse", "--arch", "encoder-decoder", "--out", "run", "--max-iters", "10",
             *tiny(n_ctx=12)])
    assert r.exit_code == 0, r.output
    r = run(["view", "--checkpoint", "run", "--prompt", "1234", "--out", "run.html"])
    assert r.exit_code == 0, r.output
    shown = embedded(tmp_path / "run.html")
    want = json.loads(run(["attention", "--checkpoint", "run", "--prompt", "1234", "--json"]).stdout.splitlines()[-1])
    assert shown["prompt"]["cross"]["source"] == want["source"] and shown["prompt"]["cross"]["target"] == want["target"]
    assert {str(i): m for i, m in enumerate(shown["prompt"]["cross"]["maps"])} == want["layers"]
    last = [m for m in disk.read_metrics(tmp_path / "run") if "layers" in m][-1]["layers"]
    assert "grad_norm" in last and "stream_rms" not in last          # no one residual stream to read


class _HostileTok:
    PIECES = ["<!--<script", "<b>bold</b>", "&amp;", "</script><script>alert(1)</script>"]

    def decode(self, ids):
        return "".join(self.PIECES[i % 4] for i in ids)


def test_data_in_the_page_is_only_ever_text():
    """Run names, layer names and tokens that look like markup: the embedded JSON carries no <, >
    or & (so nothing closes the script or opens a comment), and every Plotly label holds them as
    entities (Plotly renders a subset of HTML in labels), yet the page's data reads back exactly."""
    from tbp import GPT, ModelConfig
    from tbp.look import view
    from tbp.nn.designs.sparse.sparse import SparseRule
    model = GPT(ModelConfig(vocab_size=26, n_ctx=32, n_layer=2, n_head=2, d_model=16), seed=0)
    label = 'run <!--<script>&"x"'
    layers = {"grad_norm": {"<b>h.0</b>": 1.0, "h.1&": 2.0}, "update_ratio": {"<i>h.0": 0.1}, "stream_rms": [1.0]}
    metrics = [{"step": 1, "lr": 1e-3, "train_loss": 3.0},
               {"step": 2, "lr": 1e-3, "train_loss": 2.9, "val_loss": 2.8, "layers": layers}]
    text = view.page([{"label": label, "metrics": metrics}], model, _HostileTok(), list(range(20)),
                     SparseRule("window", budget=8, layers=(1,)))
    block = re.search(r'<script type="application/json" id="tbp-data">(.*?)</script>', text, re.S).group(1)
    assert not set("<>&") & set(block)
    data = json.loads(block)
    assert data["about"]["runs"] == [label] and data["prompt"]["tokens"][:4] == _HostileTok.PIECES
    figures = data["figures"]
    names = [t["name"] for t in figures["curves"]["data"]]
    assert names[0] == 'run &lt;!--&lt;script&gt;&amp;"x": train'
    assert figures["grad_norm"]["layout"]["yaxis"]["ticktext"] == ["&lt;b&gt;h.0&lt;/b&gt;", "h.1&amp;"]
    assert {c for row in figures["grad_norm"]["data"][0]["customdata"] for c in row} == \
        {"&lt;b&gt;h.0&lt;/b&gt;", "h.1&amp;"}
    kept = figures["kept"]["layout"]["xaxis"]["ticktext"]
    assert kept[0] == "&lt;!--&lt;script" and kept[3] == "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;"
    assert all("<" not in c and ">" not in c for row in figures["kept"]["data"][0]["customdata"] for c in row)
    assert text.count("<script") == 3                 # Plotly's, the data block, the page's own: no more
