"""The one door JSON from outside comes in by: files tbp wrote (config, state, meta, metrics)
and files users give (--config, pairs and chat JSON lines, --messages, a GPT-2 config).

Whatever the bytes, a reader gets a value or one TbpError naming the file and, for JSON lines,
the line: damaged syntax, nesting deep enough to exhaust Python's stack, strings holding lone
surrogates ("\\ud800", which no UTF-8 file can carry and no tokenizer can encode), integers too
long to convert. Lines are split on "\\n" alone (a trailing "\\r" dropped): ``str.splitlines``
would also cut at U+2028, U+0085 and form feeds, which are valid inside a JSON string or a TSV
field. A leading byte-order mark is dropped (:func:`strip_bom`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

from ..errors import TbpError
from .atomic import not_a_file

BOM = "\ufeff"
MAX_DEPTH = 64                 # deeper than any file tbp reads needs; far below the stack's limit


def strip_bom(text: str) -> str:
    return text[1:] if text.startswith(BOM) else text


def lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) on "\\n" only, without the line's "\\r\\n" or "\\n". One
    line at a time: no second copy of the whole text (a list of every line) is made."""
    start, n = 0, 1
    while True:
        end = text.find("\n", start)
        stop = len(text) if end < 0 else end
        if stop > start and text[stop - 1] == "\r":
            stop -= 1
        yield n, text[start:stop]
        if end < 0:
            return
        start, n = end + 1, n + 1


def parse(text: str, where: str):
    """The JSON value of ``text``; TbpError('where: ...') for anything a reader should not see."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TbpError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:                 # JSONDecodeError, and int's digit limit
        raise TbpError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
    _check_value(value, where)
    return value


def _check_value(value, where: str) -> None:
    """Walk ``value`` without recursion: refuse nesting past MAX_DEPTH and unencodable strings."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TbpError(f"{where}: JSON nested more than {MAX_DEPTH} levels deep")
        if isinstance(v, str):
            _check_text(v, where)
        elif isinstance(v, dict):
            for k, item in v.items():
                _check_text(k, where)
                stack.append((item, depth + 1))
        elif isinstance(v, list):
            stack.extend((item, depth + 1) for item in v)


SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(s: str, where: str) -> None:
    found = SURROGATE.search(s)             # a search, not an encoding: no copy of a long string
    if found:
        raise TbpError(f"{where}: a string holds lone surrogate U+{ord(found.group()):04X}, "
                       f"which is not text (no UTF-8 file can carry it)")


def read_text(path: Path) -> str:
    """A UTF-8 file's text, its BOM dropped; TbpError naming the file if it is missing or not UTF-8."""
    path = Path(path)
    why = not_a_file(path)
    if why is not None:
        raise TbpError(f"{path}: {why}")
    try:
        return strip_bom(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise TbpError(f"{path}: byte 0x{e.object[e.start]:02x} at offset {e.start} is not valid UTF-8") from None


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; TbpError naming the file if it is missing, damaged or not
    an object."""
    obj = parse(read_text(path), str(path))
    if not isinstance(obj, dict):
        raise TbpError(f"{path}: expected a JSON object")
    return obj


def read_jsonl(text: str, where: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line of JSON-lines ``text``; errors name where:line."""
    for n, line in lines(text):
        if line.strip():
            yield n, parse(line, f"{where}:{n}")
