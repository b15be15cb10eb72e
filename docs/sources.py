"""The code a page shows from the repository, kept in the page itself.

A page marks where a function's (or class's, or ``Class.method``'s) source goes:

    <!-- source: tbp/nn/reference.py::attention_backward -->
    `tbp/nn/reference.py`, lines 120-151:

    ```{.python .no-run}
    def attention_backward(...): ...
    ```
    <!-- /source -->

The code between the two markers is the file's, so the Markdown reads whole on its own (on
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


def source_of(path: str, name: str) -> tuple[str, int, int]:
    """(code, first line, last line) of ``name`` in ``path`` (relative to the repository)."""
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
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = text.splitlines()[first - 1:node.end_lineno]
    indent = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
    return "\n".join(x[indent:] for x in lines), first, node.end_lineno


def include_sources(markdown: str) -> str:
    """Every source region filled from the files as they are now."""
    if len(MARKER.findall(markdown)) != len(SOURCE.findall(markdown)):
        raise ValueError("a <!-- source: ... --> marker without its <!-- /source --> (or a malformed one)")

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
