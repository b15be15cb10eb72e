"""The documentation site builds in strict mode, and every page's code runs as written.

Each page runs in its own fresh folder holding only examples/: its ```bash lines in order
(with the small sizes of test_readme.py appended to tbp train/generate/chat), its ```python
blocks in one namespace, like a notebook, each at its place among the bash lines. A page
whose code fails fails here, with the page, the line and the output.
"""
import contextlib
import html
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import blocks  # noqa: E402
from helpers import DESIGN_WORDS, browser, designs_named  # noqa: E402
from test_readme import small  # noqa: E402

PAGES = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
RUNNABLE = [p for p in PAGES if blocks.runnable((ROOT / "docs" / p).read_text(encoding="utf-8"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once, in strict mode: a warning (a dead link, a missing reference, an unknown
    source name, a bad formula) fails the build."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("docs") / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.mark.design(*DESIGN_WORDS)          # the site builds every design's page
def test_the_site_builds_in_strict_mode(site):
    page = (site / "learn" / "3-self-attention.html").read_text(encoding="utf-8")   # offline: file URLs
    import hooks
    code = html.unescape(re.sub(r"<[^>]+>", "", page))
    assert "<math" in page and "arithmatex" not in page                 # every formula rendered
    assert hooks.source_of("tbp/nn/reference.py", "attention_backward")[0] in code   # the file's code
    assert any((site / "notebooks").glob("*.ipynb"))
    cli = (site / "reference" / "cli.html").read_text(encoding="utf-8")
    for anchor in ('id="tbp-train--max-iters"', 'id="tbp-train--early-stop"', 'id="tbp-serve--api-key"',
                   'id="tbp-runs-rm--yes"'):
        assert anchor in cli, anchor                                    # an anchor per command and option
    missing = (site / "404.html").read_text(encoding="utf-8")     # its links reach the site's own files
    links = re.findall(r'(?:href|src)="([^"#]+)"', missing)
    assert links and not [u for u in links if u.startswith("/") and not u.startswith("//")]
    assert all((site / u).exists() for u in links if u.startswith("./")), links


@pytest.mark.design(*DESIGN_WORDS)          # the site builds every design's page
def test_search_works_offline_from_the_files(site):
    """The built site opened as file:// URLs in Chromium with the network cut: a query typed into
    the search box lists pages that hold the word, and nothing the site loads asks the network."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    remote = re.compile(r"<(script|link)[^>]*(src|href)=\"(https?:)?//")      # a script or style from afar
    assert not [p for p in site.rglob("*.html") if remote.search(p.read_text(encoding="utf-8"))]
    driver = browser()
    try:
        driver.get((site / "learn" / "index.html").as_uri())
        driver.find_element(By.TAG_NAME, "body").send_keys("/")          # the theme's key for search
        box = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
        WebDriverWait(driver, 10).until(lambda d: box.is_displayed())
        box.send_keys("softmax")
        WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))
        items = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
        links = [a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, ".md-search-result__link")]
        assert len(items) >= 3 and any("3-self-attention.html" in u for u in links), links
        assert all(u.startswith("file://") for u in links)
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe                                       # no request was refused
    finally:
        driver.quit()


def _by_design(pages: list[str]) -> list:
    """Each page as a parameter marked with the designs it names (tests/conftest.py)."""
    return [pytest.param(p, marks=pytest.mark.design(*designs_named((ROOT / "docs" / p).read_text(encoding="utf-8"))))
            for p in pages]


@pytest.mark.parametrize("page", _by_design(PAGES))
def test_the_code_a_page_shows_is_the_repositorys(page):
    """Each <!-- source --> region holds the file's code now (python docs/sources.py rewrites them)."""
    import sources
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert sources.include_sources(text) == text, f"docs/{page}: run python docs/sources.py"


def test_a_source_region_is_the_code_or_refused():
    import sources
    text = (ROOT / "docs" / "learn" / "3-self-attention.md").read_text(encoding="utf-8")
    assert "def attention_backward(" in text                       # readable as Markdown, not a placeholder
    with pytest.raises(ValueError, match="without its"):
        sources.include_sources("<!-- source: tbp/nn/reference.py::attention_forward -->\ntext\n")
    with pytest.raises(ValueError, match="has no nothing_here"):
        sources.include_sources("<!-- source: tbp/nn/reference.py::nothing_here -->\n<!-- /source -->")


def test_every_page_with_code_is_found():
    assert len(RUNNABLE) >= 15 and "learn/3-self-attention.md" in RUNNABLE


def run_in_order(items, tmp_path, monkeypatch, where: str) -> None:
    """Run (kind, line, code) items as a reader would, in one fresh folder holding examples/:
    python in one namespace, like a notebook, each bash line in its own shell with the small
    sizes of test_readme.py appended to tbp train/generate/chat. A failure names the place."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "80", "TBP_GEMM": "numpy", "MPLBACKEND": "Agg"}
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for kind, line, code in items:
        if kind == "python":
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(code, f"{where}:{line}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{where} line {line}: the python block fails: {e!r}\n"
                                     f"{out.getvalue()[-2000:]}") from e
            continue
        for n, command in blocks.commands(blocks.Block("bash", line, code)):
            r = subprocess.run(["bash", "-o", "pipefail", "-c", small(command)], cwd=tmp_path, env=env,
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, (f"{where} line {n}: {command}\nexit {r.returncode}\n"
                                       f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


@pytest.mark.parametrize("page", _by_design(RUNNABLE))
def test_every_page_runs_as_written(page, tmp_path, monkeypatch):
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    lacking = blocks.missing(blocks.needs(text))
    if lacking:
        pytest.skip(f"docs/{page} needs {', '.join(lacking)}: {blocks.pip(lacking)}")
    run_in_order([(b.kind, b.line, b.code) for b in blocks.runnable(text)], tmp_path, monkeypatch, f"docs/{page}")


LEARN = sorted(p for p in PAGES if re.match(r"learn/\d", p))


@pytest.mark.parametrize("page", _by_design(LEARN))
def test_each_equation_of_the_path_sits_above_the_lines_that_compute_it(page):
    """On every page of §1-§7, each display equation (outside a derivation box) carries a number,
    \\tag{n.m}, and right under it one or more regions showing the code lines marked with that
    number; numbers are unique, and each page has its picture, its proof's output and its
    "Try it" output generated at build time."""
    import outputs
    import sources
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    lines = text.splitlines()
    tags, in_fence = [], False
    for i, line in enumerate(lines):
        in_fence ^= line.strip().startswith("```")
        if in_fence or not line.startswith("$$"):        # indented $$: inside a note, a derivation step
            continue
        tag = re.search(r"\\tag\{(\d+\.\d+)\}", line)
        assert tag, f"docs/{page} line {i + 1}: a display equation without a number: {line[:60]}"
        below = next(x for x in lines[i + 1:] if x.strip())
        assert below.startswith("<!-- lines: ") and below.endswith(f"({tag[1]}) -->"), \
            f"docs/{page} line {i + 1}: equation ({tag[1]}) has no lines under it"
        tags.append(tag[1])
    section = page.split("/")[1].split("-")[0]
    assert tags and len(tags) == len(set(tags)) and all(t.split(".")[0] == section for t in tags), tags
    assert f"../images/flow-{section}.svg" in text
    marked = outputs._marked(text)
    runnable = blocks.runnable(text)
    gradcheck = [b.line for b in runnable if "tbp gradcheck" in b.code]
    assert gradcheck and set(gradcheck) <= set(marked)                # the proof's rows, generated
    assert runnable[-1].line in marked                                 # the "Try it" output, generated
    assert sources.include_sources(text) == text


def test_a_lines_region_needs_marked_lines_and_shows_them_in_place():
    import sources
    with pytest.raises(ValueError, match=r"marks no line with eq. \(9.9\)"):
        sources.include_sources("<!-- lines: tbp/nn/reference.py::attention_forward (9.9) -->\n<!-- /lines -->")
    shown = sources.include_sources("<!-- lines: tbp/nn/reference.py::attention_backward (3.6) -->\n<!-- /lines -->")
    assert "dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))" in shown
    assert "for h, (q, k, v, P) in enumerate(per_head):" in shown     # the loop it sits in
    assert "dq = dS @ k" not in shown                                  # (3.7)'s line is not (3.6)'s
    assert sources.tags("x = 1  # (B, T)   eqs. (3.3), (4.1)") == ["3.3", "4.1"] and sources.tags("# (B, T)") == []


def test_the_pictures_are_what_the_script_draws():
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "diagrams.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.design(*DESIGN_WORDS)          # the site builds every design's page
def test_the_built_pages_number_equations_and_show_generated_output(site):
    page = (site / "learn" / "3-self-attention.html").read_text(encoding="utf-8")
    assert 'id="eq-3.6"' in page and '<span class="eqno">(3.6)</span>' in page
    shown = html.unescape(re.sub(r"<[^>]+>", "", page))
    assert "What it printed when this site was built" in shown and "tensors pass" in shown
    assert "plain twin, cached rows against all rows at once:" in shown
    assert "<!-- output -->" not in page and "\\tag" not in page


@pytest.mark.parametrize("page", _by_design(LEARN))
def test_each_learn_notebook_runs_with_the_plain_twin_as_code(page, tmp_path, monkeypatch):
    """The page's notebook: the plain twin's functions are code cells (after one import cell), and
    every cell runs in order, the twin's definitions included."""
    import hooks
    nb = hooks.notebook((ROOT / "docs" / page).read_text(encoding="utf-8"))
    code = [c["source"] for c in nb["cells"] if c["cell_type"] == "code"]
    twin = [c for c in code if re.match(r"def \w+\(", c)]
    assert twin and code[0] == hooks.TWIN_IMPORT
    items = [("bash", 1, c[len("%%bash\n"):]) if c.startswith("%%bash\n") else ("python", 1, c) for c in code]
    run_in_order(items, tmp_path, monkeypatch, f"notebook of docs/{page}")


def test_every_extra_a_page_or_line_names_exists():
    """A page's needs and a README line's tbp[extra] name extras pyproject.toml defines, with modules."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    defined = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(blocks.BEYOND.values()) <= set(defined)
    assert set(blocks.EXTRAS) <= set(defined)
    named = {e for p in PAGES for e in blocks.needs((ROOT / "docs" / p).read_text(encoding="utf-8"))}
    named |= {e for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines() for e in blocks.line_needs(line)}
    assert named and named <= set(blocks.EXTRAS), named - set(blocks.EXTRAS)
    assert blocks.line_needs('tbp view --out run.html   # a page (tbp[view])') == ["view"]
    assert blocks.line_needs('echo "tbp[view]"') == [] and blocks.needs("<!-- needs: plot, view -->") == ["plot", "view"]


def test_the_block_reader_runs_bash_and_python_only():
    page = ("# t\n\n```text\nnot run\n```\n\ntext\n\n```bash\ntbp info  # a comment\npip install x\n```\n"
            "```{.python .no-run}\nshown()\n```\n```python\nprint(1)\n```\n")
    found = [(b.kind, b.line, b.code) for b in blocks.runnable(page)]
    assert found == [("bash", 10, "tbp info  # a comment\npip install x"), ("python", 17, "print(1)")]
    assert blocks.commands(blocks.runnable(page)[0]) == [(10, "tbp info")]


def test_the_path_sends_the_reader_to_tbp_view_where_it_shows_the_section():
    for page in ("learn/3-self-attention.md", "learn/4-multi-head.md", "learn/7-gpt.md"):
        assert "../how-to/generate.md#in-a-browser-tbp-view" in (ROOT / "docs" / page).read_text(encoding="utf-8")
