"""Reading back a results file that ``specdec-bench`` wrote, for ``--from-json``: anything else (a
truncated copy, another JSON document, a binary file) is an error naming the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec_trt.bench.harness import SCHEMA
from specdec_trt.bench.methods import Method
from specdec_trt.bench.summary import summarise

_FIX = "give the --out JSON of a specdec-bench run"
_KEYS = ("status", "command", "config", "environment", "methods", "runs")


class ResultsFileError(ValueError):
    """A file given to ``--from-json`` is not a readable specdec-bench results file."""


def read_results(path: Path) -> dict[str, Any]:
    """The results in ``path`` with their summary computed again (and so checked) from the runs."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ResultsFileError(f"{path} is not a text file: {_FIX}") from None
    except json.JSONDecodeError as err:
        raise ResultsFileError(f"{path} is not valid JSON, perhaps truncated ({err}): {_FIX}") from None
    if not isinstance(data, dict):
        raise ResultsFileError(f"{path} holds a JSON {type(data).__name__}, not an object: {_FIX}")
    if data.get("schema") != SCHEMA:
        raise ResultsFileError(f"{path} has schema {data.get('schema')!r}, not {SCHEMA!r}: {_FIX}")
    missing = [key for key in _KEYS if key not in data]
    if missing:
        raise ResultsFileError(f"{path} lacks {', '.join(missing)}: {_FIX}")
    try:
        methods = [Method(m["family"], m["draft"], m["num_draft_tokens"]) for m in data["methods"]]
        data["summary"] = summarise(data["runs"], methods, data.get("limits"))
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise ResultsFileError(f"{path} holds damaged methods or runs ({type(err).__name__}: {err}): {_FIX}") from None
    return data
