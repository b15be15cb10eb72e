"""The code a page shows from the repository, kept in the page itself.

A page marks where a function's (or class's, or ``Class.method``'s) source goes:

    <!-- source: tbp/nn/reference.py::attention_backward -->
    `tbp/nn/reference.py`, lines 120-151:

    ```{.python .no-run}
    def attention_backward(...): ...
    ```
    <!-- /source -->

An equation is tied to the lines that compute it: the code marks them with a comment naming
the equation's number (``dS = P * (dP - ...)   # eq. (3.6)``; ``# eqs. (3.3), (4.1)`` for
two), and under the equation (``$$ ... \\tag{3.6} $$``) a region shows those lines alone:

    <!-- lines: tbp/nn/reference.py::attention_backward (3.6) -->
    ...
    <!-- /lines -->

A marked line that opens a statement brings the whole statement (a call over three lines);
one that opens a block (``for``, ``if``) brings its first line only, and so does each block
around a marked line, so that the lines read in their place. A region whose function marks
no line with its number is an error.

The code between the markers is the file's, so the Markdown reads whole on its own (on
GitHub, in an editor); ``python docs/sources.py`` rewrites every region from the files, and
``--check`` (run by the tests) fails when a page shows code the repository no longer has. The
site's hook (hooks.py) fills the regions from the files again when it builds, so the site is
current even between the two. An unknown file or name is an error.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = re.compile(r"^<!-- source: (?P<path>[\w/.]+)::(?P<name>[\w.]+) -->\n"
                    r"(?:(?:(?!<!-- source:).)*?\n)?<!-- /source -->$", re.M | re.S)
MARKER = re.compile(r"^<!-- source: [^\n]*-->$", re.M)
LINES = re.compile(r"^<!-- lines: (?P<path>[\w/.]+)::(?P<name>[\w.]+) \((?P<tag>\d+\.\d+)\) -->\n"
                   r"(?:(?:(?!<!-- lines:).)*?\n)?<!-- /lines -->$", re.M | re.S)
LINES_MARKER = re.compile(r"^<!-- lines: [^\n]*-->$", re.M)
TAGGED = re.compile(r"#.*\beqs?\. (\(\d+\.\d+\)(?:, \(\d+\.\d+\))*)")


def _node(path: str, name: str) -> tuple[ast.AST, list[str]]:
    """The definition ``name`` (``f``, ``C``, ``C.m``) in ``path``, and the file's lines."""
    file = ROOT / path
    if not file.is_file():
        raise ValueError(f"source: no file {path}")
    text = file.read_text(encoding="utf-8")
    scope = ast.parse(text).body
    node = None
    for part in name.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            raise ValueError(f"source: {path} has no {name}")
        scope = node.body
    return node, text.splitlines()


def source_of(path: str, name: str) -> tuple[str, int, int]:
    """(code, first line, last line) of ``name`` in ``path`` (relative to the repository)."""
    node, text_lines = _node(path, name)
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = text_lines[first - 1:node.end_lineno]
    indent = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
    return "\n".join(x[indent:] for x in lines), first, node.end_lineno


def tags(line: str) -> list[str]:
    """The equation numbers a line of code marks: ``x = 1  # eqs. (3.3), (4.1)`` -> 3.3, 4.1."""
    m = TAGGED.search(line)
    return re.findall(r"\d+\.\d+", m[1]) if m else []


def lines_of(path: str, name: str, tag: str) -> list[tuple[int, str]]:
    """(line number, text) of the statements in ``name`` that mark equation ``tag``."""
    node, text_lines = _node(path, name)
    simple = {}                                    # first line -> last line of each simple statement
    for n in ast.walk(node):
        if isinstance(n, ast.stmt) and not hasattr(n, "body"):
            simple.setdefault(n.lineno, n.end_lineno)
    picked: set[int] = set()
    for i in range(node.lineno, node.end_lineno + 1):
        if tag in tags(text_lines[i - 1]):
            picked.update(range(i, simple.get(i, i) + 1))
    if not picked:
        raise ValueError(f"lines: {path}::{name} marks no line with eq. ({tag})")
    for n in ast.walk(node):                       # the head of each block around a marked line
        if n is not node and isinstance(n, ast.stmt) and hasattr(n, "body") and \
                any(n.lineno < i <= n.end_lineno for i in picked):
            picked.add(n.lineno)
    indent = min(len(x) - len(x.lstrip()) for i, x in enumerate(text_lines) if i + 1 in picked)
    return [(i, text_lines[i - 1][indent:]) for i in sorted(picked)]


def _lines_region(m) -> str:
    rows = lines_of(m["path"], m["name"], m["tag"])
    code, last = [], None
    for i, text in rows:
        if last is not None and i > last + 1:
            code.append("...")
        code.append(text)
        last = i
    numbers = [i for i, _ in rows]
    spans, start = [], numbers[0]
    for a, b in zip(numbers, numbers[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}–{a}")
            start = b
    where = ("line " if len(numbers) == 1 else "lines ") + ", ".join(spans)
    body = "\n".join(code)
    return (f"<!-- lines: {m['path']}::{m['name']} ({m['tag']}) -->\n"
            f"`{m['path']}` · `{m['name']}`, {where}:\n\n"
            f"```{{.python .no-run .eq}}\n{body}\n```\n<!-- /lines -->")


def include_sources(markdown: str) -> str:
    """Every source and lines region filled from the files as they are now."""
    if len(MARKER.findall(markdown)) != len(SOURCE.findall(markdown)):
        raise ValueError("a <!-- source: ... --> marker without its <!-- /source --> (or a malformed one)")
    if len(LINES_MARKER.findall(markdown)) != len(LINES.findall(markdown)):
        raise ValueError("a <!-- lines: ... --> marker without its <!-- /lines --> (or a malformed one)")
    markdown = LINES.sub(_lines_region, markdown)

    def code(m):
        text, a, b = source_of(m["path"], m["name"])
        return (f"<!-- source: {m['path']}::{m['name']} -->\n`{m['path']}`, lines {a}–{b}:\n\n"
                f"```{{.python .no-run}}\n{text}\n```\n<!-- /source -->")
    return SOURCE.sub(code, markdown)


def pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page shows code the files no longer have")
    args = ap.parse_args()
    stale = []
    for page in pages():
        old = page.read_text(encoding="utf-8")
        new = include_sources(old)
        if new != old:
            name = page.relative_to(ROOT).as_posix()
            if args.check:
                stale.append(name)
            else:
                page.write_text(new, encoding="utf-8")
                print(f"{name}: code regions rewritten from the files")
    if stale:
        sys.exit(f"{', '.join(stale)}: shows code the repository no longer has; run python docs/sources.py")


if __name__ == "__main__":
    main()
