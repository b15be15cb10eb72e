"""What a page's commands print, generated into the page when the site is built.

A ```bash or ```python block followed by the line ``<!-- output -->`` shows, in the built
site, what it printed when the site was built: a page cannot show numbers its code no longer
gives. The page's runnable blocks run in order in one fresh folder holding a copy of
``examples/`` (the python blocks in one namespace, like a notebook; each bash line in its own
shell, with ``tbp`` from the Python that builds the site), up to the last marked block. A
block that fails fails the build, naming the page and the line.

The output goes in a collapsible box under the block, open when it is short. A Markdown
reader (GitHub, an editor) sees the marker alone, as a comment.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import blocks

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- output -->"
OPEN_UP_TO = 24                          # lines: a longer output starts collapsed


def _marked(markdown: str) -> list[int]:
    """The first content line of each runnable block a marker follows (blank lines between)."""
    lines = markdown.splitlines()
    found = []
    for b in blocks.runnable(markdown):
        end = b.line + len(b.code.splitlines())          # the closing fence's line (1-based)
        rest = [x for x in lines[end:end + 3] if x.strip()]
        if rest and rest[0].strip() == MARK:
            found.append(b.line)
    return found


def run_page(markdown: str, name: str) -> dict[int, str]:
    """{first line of a marked block: what it printed}, running the page's blocks in order."""
    marked = _marked(markdown)
    if not marked:
        return {}
    printed: dict[int, str] = {}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "80", "MPLBACKEND": "Agg", "NO_COLOR": "1", "TERM": "dumb"}
    namespace = {"__name__": "__main__"}
    with tempfile.TemporaryDirectory(prefix="tbp-docs-") as tmp:
        shutil.copytree(ROOT / "examples", Path(tmp) / "examples")
        for b in blocks.runnable(markdown):
            if b.line > marked[-1]:
                break
            if b.kind == "python":
                out = io.StringIO()
                try:
                    with contextlib.chdir(tmp), contextlib.redirect_stdout(out):
                        exec(compile(b.code, f"docs/{name}:{b.line}", "exec"), namespace)
                except Exception as e:
                    raise RuntimeError(f"docs/{name} line {b.line}: the python block fails: {e!r}") from e
                printed[b.line] = out.getvalue()
                continue
            text = []
            for n, command in blocks.commands(b):
                r = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=tmp, env=env,
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    raise RuntimeError(f"docs/{name} line {n}: {command}: exit {r.returncode}\n{r.stderr[-2000:]}")
                text.append(f"$ {command}\n{r.stdout}{r.stderr}")
            printed[b.line] = "\n".join(text)
    return {line: printed[line] for line in marked}


def fill(markdown: str, name: str) -> str:
    """The page with each marker replaced by its block's output (see the module's docstring)."""
    outputs = run_page(markdown, name)
    if not outputs:
        return markdown
    lines = markdown.splitlines()
    for first in sorted(outputs, reverse=True):
        at = next(i for i in range(first, len(lines)) if lines[i].strip() == MARK)
        text = outputs[first].rstrip("\n") or "(nothing printed)"
        title = "What it printed when this site was built"
        if text.count("\n") < OPEN_UP_TO:
            fold = "???+"
        else:                                  # collapsed: its last line (a summary) in the title
            fold, last = "???", text.splitlines()[-1].strip().replace('"', "'")
            title += f" — {last}"
        body = "\n".join("    " + x if x else "" for x in ["```text", *text.splitlines(), "```"])
        lines[at:at + 1] = [f'{fold} success "{title}"', "", body]
    return "\n".join(lines) + "\n"
