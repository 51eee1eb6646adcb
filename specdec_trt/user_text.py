"""Text users hand the commands: files and standard input decoded as UTF-8 with an error naming the
source, and backslash escapes in prompts and stop strings (as llama.cpp interprets them)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from specdec_trt.validation import InvalidValueError

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b"}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)", re.DOTALL)


class TextDecodeError(InvalidValueError):
    """Input that should be text is not valid UTF-8."""


def unescape(text: str) -> str:
    r"""``text`` with \n, \t, \r, \0, \\, \', \", \a, \b, \xHH and \uHHHH replaced by what they stand for;
    any other backslash is kept as it is."""

    def replace(match: re.Match[str]) -> str:
        code = match.group(1)
        if len(code) > 1:
            return chr(int(code[1:], 16))
        return _ESCAPES.get(code, match.group(0))

    return _ESCAPE.sub(replace, text)


def check_text(text: str, source: str) -> str:
    """``text`` if it holds only encodable characters; a command line of invalid UTF-8 reaches Python
    as lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise TextDecodeError(
            f"{source} is not valid UTF-8 (character {err.start}): convert it to UTF-8, e.g. with iconv"
        ) from None
    return text


def decode(data: bytes, source: str) -> str:
    """``data`` decoded as UTF-8, or an error naming ``source`` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TextDecodeError(
            f"{source} is not valid UTF-8 (byte {data[err.start]:#04x} at offset {err.start}): convert it to "
            "UTF-8, e.g. with iconv"
        ) from None


def read_text(path: Path) -> str:
    """A text file's contents, decoded as UTF-8."""
    return decode(Path(path).read_bytes(), str(path))


def read_stdin() -> str:
    """Standard input, decoded as UTF-8."""
    return decode(sys.stdin.buffer.read(), "standard input")
