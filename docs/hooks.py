"""MkDocs hooks: code shown from the source files, math rendered offline, pages as notebooks.

- a ``<!-- source: tbp/nn/reference.py::attention_backward -->`` ... ``<!-- /source -->``
  region is filled with that function's (or class's, or ``Class.method``'s) source, read from
  the file when the site is built, so the code on a page is the code in the repository
  (sources.py; the pages keep a copy, so that they read whole as Markdown, and the tests keep
  it current). An unknown name fails the build.
- ``$...$`` and ``$$...$$`` (pymdownx.arithmatex, generic mode) become MathML when the page
  is written (latex2mathml), so formulas render with no script and no network.
- ``<!-- cli-reference -->`` becomes every command's ``--help``, as click formats it for a
  80-column terminal, one section per command: the reference cannot disagree with the CLI.
- ``<!-- lines: tbp/nn/reference.py::attention_backward (3.6) -->`` regions show, under an
  equation, the lines of code marked with its number (sources.py).
- A runnable block followed by ``<!-- output -->`` shows what it printed when the site was
  built (outputs.py): the gradcheck rows and the "Try it" results are never typed by hand.
- Every page of the learner's path, the designs and the how-to guides with runnable blocks
  (blocks.py) is also written as a Jupyter notebook,
  ``notebooks/<page>.ipynb``: its text as Markdown cells, its ```python blocks as code cells,
  its ```bash blocks as ``%%bash`` cells, and the plain twin's functions (the regions from
  ``tbp/nn/reference.py``) as code cells too, so that a learner can change one and run it; the
  page links to it.
"""
from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

from latex2mathml.converter import convert
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).parent))
import blocks  # noqa: E402
import outputs  # noqa: E402
import sources  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLI = "<!-- cli-reference -->"
NOTEBOOKS = "notebooks"
NOTEBOOK_SECTIONS = ("learn/", "designs/", "how-to/")      # the pages a learner works through


def source_of(path: str, name: str) -> tuple[str, int, int]:
    try:
        return sources.source_of(path, name)
    except ValueError as e:
        raise PluginError(str(e)) from None


def include_sources(markdown: str) -> str:
    try:
        return sources.include_sources(markdown)
    except ValueError as e:
        raise PluginError(str(e)) from None


def cli_reference() -> str:
    """Every command's ``--help`` as click prints it, then its options, each with an anchor a link
    can point at: ``reference/cli.md#tbp-train--max-iters``."""
    import click
    from tbp.cli.main import main

    def help_of(command, name: str, parent=None):
        ctx = click.Context(command, info_name=name, parent=parent, terminal_width=80, max_content_width=80)
        return command.get_help(ctx), ctx

    def options(command, path: str, ctx) -> str:
        rows = []
        for param in command.get_params(ctx):
            if not isinstance(param, click.Option) or param.hidden:
                continue
            record = param.get_help_record(ctx)
            if record is None:
                continue
            names, text = record
            anchor = path.replace(" ", "-") + param.opts[0]                   # tbp-train--max-iters
            rows.append(f'- <span id="{anchor}"></span>`{names}`: {html.escape(text)}')
        return "\n".join(rows)

    def section(command, name: str, parent, path: str) -> list[str]:
        text, ctx = help_of(command, name, parent)
        out = [f"## {path}\n\n```text\n{text}\n```\n\n" + options(command, path, ctx)]
        if isinstance(command, click.Group):
            for sub in sorted(command.commands):
                out += section(command.commands[sub], sub, ctx, f"{path} {sub}")
        return out

    text, root = help_of(main, "tbp")
    out = [f"```text\n{text}\n```"]
    for name in sorted(main.commands):
        out += section(main.commands[name], name, root, f"tbp {name}")
    return "\n\n".join(out)


def notebook_name(src_uri: str) -> str:
    return src_uri[:-3].replace("/", "-") + ".ipynb"


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = include_sources(markdown)
    try:
        markdown = outputs.fill(markdown, page.file.src_uri)
    except RuntimeError as e:
        raise PluginError(str(e)) from None
    if CLI in markdown:
        markdown = markdown.replace(CLI, cli_reference())
    if page.file.src_uri.startswith(NOTEBOOK_SECTIONS) and blocks.runnable(markdown):
        depth = page.file.src_uri.count("/")
        link = "../" * depth + f"{NOTEBOOKS}/{notebook_name(page.file.src_uri)}"
        lines = markdown.split("\n", 1)
        markdown = lines[0] + f"\n\n[:material-notebook: this page as a notebook]({link}){{ .md-button }}\n" + \
            (lines[1] if len(lines) > 1 else "")
    return markdown


def _mathml(latex: str, display: bool, page) -> str:
    try:
        return convert(html.unescape(latex), display="block" if display else "inline")
    except Exception as e:                  # noqa: BLE001 -- any failure is a bad formula on that page
        raise PluginError(f"{page.file.src_uri}: cannot render ${latex}$: {e}") from e


TAG = re.compile(r"\\tag\{([^}]*)\}")


def _display(latex: str, page) -> str:
    """A display formula; its ``\\tag{3.6}`` as the equation's number at the right margin, with
    an anchor (``#eq-3.6``) that the lines under it and other pages can point at."""
    tag = TAG.search(latex)
    math = _mathml(TAG.sub("", latex), True, page)
    if tag is None:
        return f'<div class="math">{math}</div>'
    n = html.escape(tag[1])
    return f'<div class="math numbered" id="eq-{n}">{math}<span class="eqno">({n})</span></div>'


def on_page_content(content: str, page, config, files) -> str:
    content = re.sub(r'<div class="arithmatex">\\\[(.*?)\\\]</div>',
                     lambda m: _display(m[1], page), content, flags=re.S)
    return re.sub(r'<span class="arithmatex">\\\((.*?)\\\)</span>',
                  lambda m: _mathml(m[1], False, page), content, flags=re.S)


TWIN = "tbp/nn/reference.py"
TWIN_IMPORT = ("# the plain twin's functions below call each other and these helpers (softmax, linear_forward, ...)\n"
               "import numpy as np\nfrom tbp.nn.reference import *  # noqa: F403")


def runnable_twin(markdown: str) -> str:
    """The page with each plain-twin region's code fenced as ```python, so that the notebook runs
    it (the page shows it as {.python .no-run}: it only defines functions)."""
    return sources.SOURCE.sub(
        lambda m: m[0].replace("```{.python .no-run}", "```python") if m["path"] == TWIN else m[0], markdown)


def notebook(markdown: str) -> dict:
    cells = []
    markdown = include_sources(markdown)
    twin = runnable_twin(markdown)
    if twin != markdown:
        cells.append({"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                      "source": TWIN_IMPORT})
    for b in blocks.blocks(twin):
        if b.kind == "python":
            cells.append({"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                          "source": b.code})
        elif b.kind == "bash":
            cells.append({"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                          "source": "%%bash\n" + b.code})
        else:
            text = b.code if b.kind == "md" else f"```{b.kind}\n{b.code}\n```"
            if cells and cells[-1]["cell_type"] == "markdown":
                cells[-1]["source"] += "\n\n" + text
            else:
                cells.append({"cell_type": "markdown", "metadata": {}, "source": text})
    return {"nbformat": 4, "nbformat_minor": 5, "cells": cells,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}


def on_files(files, config):
    for f in list(files.documentation_pages()):
        if not f.src_uri.startswith(NOTEBOOK_SECTIONS):
            continue
        text = Path(f.abs_src_path).read_text(encoding="utf-8")
        if blocks.runnable(include_sources(text)):
            files.append(File.generated(config, f"{NOTEBOOKS}/{notebook_name(f.src_uri)}",
                                        content=json.dumps(notebook(text), indent=1)))
    return files


def on_post_template(output: str, template_name: str, config) -> str:
    """The 404 page's links relative to the site's root folder, where the page lies: MkDocs
    writes them from the web root ("/assets/...") when no site_url is set, which is nowhere for
    a site opened from its files or served from a folder of a larger site."""
    if template_name != "404.html":
        return output
    return re.sub(r'(href|src)="/(?!/)', r'\1="./', output)
