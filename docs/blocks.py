"""The runnable parts of a Markdown page: its ```bash and ```python blocks, in order.

One reader for the three places that need it: the tests that run every page's code
(tests/test_docs.py, tests/test_readme.py), and the site's notebooks (hooks.py). A block
fenced as ```bash or ```python is run; one that only shows something (output, a file's
contents, a sketch) is fenced as ```text, ```console, ```json or similar, or as
```{.python .no-run} where Python should be highlighted but not run, and is not.
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

RUN = ("bash", "python")
# lines of a bash block that CI does not run: installs, the test suite itself, other machines,
# servers that run until stopped (a page's Python block starts tbp serve itself and stops it)
SKIPPED = ("pip install", "python -m pytest", "mpiexec", "srun", "sbatch", "salloc", "mkdocs serve", "tbp serve")


# the modules each optional extra brings (pyproject.toml): what a page or a line that needs the
# extra cannot run without. A page declares its extras in a comment, <!-- needs: plot, view -->;
# a README line names one in its own comment, "# ... (tbp[view])".
EXTRAS = {"plot": ("matplotlib",), "view": ("plotly",), "gguf": ("gguf", "llama_cpp"),
          "serve": ("starlette", "uvicorn", "openai"), "parquet": ("pyarrow",), "zstd": ("zstandard",),
          "mpi": ("mpi4py",), "tensorboard": ("tensorboardX",), "docs": ("mkdocs",)}
_NEEDS = re.compile(r"<!--\s*needs:\s*([\w ,-]+?)\s*-->")
_LINE_NEEDS = re.compile(r"tbp\[([\w,-]+)\]")


def needs(text: str) -> list[str]:
    """The extras a page declares it needs (``<!-- needs: a, b -->``)."""
    return [e.strip() for m in _NEEDS.finditer(text) for e in m.group(1).split(",") if e.strip()]


def line_needs(line: str) -> list[str]:
    """The extras a line's comment names as ``tbp[extra]``."""
    comment = line[len(without_comment(line)):]
    return [e for m in _LINE_NEEDS.finditer(comment) for e in m.group(1).split(",")]


# a page's use of these reaches beyond the extra (llama.cpp itself, the openai client): the test extra brings all
BEYOND = {"gguf": "test-all", "serve": "test-all"}


def pip(extras) -> str:
    """The install line that brings ``extras`` as the pages use them."""
    wanted = sorted({BEYOND.get(e, e) for e in extras})
    return f"pip install -e '.[{','.join(wanted)}]'"


def missing(extras) -> list[str]:
    """Those of ``extras`` whose modules are not installed here."""
    import importlib.util
    return [e for e in extras if any(importlib.util.find_spec(m) is None for m in EXTRAS[e])]


@dataclass
class Block:
    kind: str          # "md" (the Markdown between fences), or the fence's language
    line: int          # first line of the block's contents (1-based)
    code: str


def blocks(text: str) -> list[Block]:
    """The page cut into Markdown text and fenced blocks, in order (fences of ``` only, the
    language the first word after them; none: "plain")."""
    out, kind, start, lines = [], "md", 1, []
    for n, line in enumerate(text.splitlines(), 1):
        fence = line.strip()
        opens = kind == "md" and fence.startswith("```")
        if opens or (kind != "md" and fence == "```"):
            out.append(Block(kind, start, "\n".join(lines)))
            kind = (fence[3:].split() or ["plain"])[0] if opens else "md"
            start, lines = n + 1, []
            continue
        lines.append(line)
    out.append(Block(kind, start, "\n".join(lines)))
    # a block inside a note (an exercise's answer) is indented with the note: read it without
    return [Block(b.kind, b.line, b.code if b.kind == "md" else textwrap.dedent(b.code)) for b in out if b.code.strip()]


def without_comment(line: str) -> str:
    """The line up to an unquoted ``#`` that starts a word (bash's comment)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(block: Block) -> list[tuple[int, str]]:
    """(line number, command) of every line of a bash block CI runs, continuation lines
    joined, the SKIPPED parts of an ``&&`` chain left out."""
    out, pending, start = [], "", block.line
    for n, line in enumerate(block.code.splitlines(), block.line):
        code = without_comment(line)
        if not code and not pending:
            continue
        if not pending:
            start = n
        if code.endswith("\\"):
            pending += code[:-1] + " "
            continue
        command, pending = pending + code, ""
        parts = [p.strip() for p in command.split("&&")]
        parts = [p for p in parts if p and not p.startswith(SKIPPED)]
        if parts:
            out.append((start, " && ".join(parts)))
    return out


def runnable(text: str) -> list[Block]:
    return [b for b in blocks(text) if b.kind in RUN]

