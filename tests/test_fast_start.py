"""Every command parses its options, answers --help and refuses bad input before it imports torch, transformers,
ONNX or the server: each case runs in a fresh interpreter, which then must not have loaded any of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec_trt.backend import DTYPE_NAMES
from specdec_trt.build_engines.model import DTYPES

HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "fastapi", "uvicorn", "matplotlib", "gguf", "ray")
COMMANDS = {
    "specdec-run": ("specdec_trt.cli", "run"),
    "specdec-build": ("specdec_trt.cli", "build_command"),
    "specdec-serve": ("specdec_trt.serve.cli", "serve"),
    "specdec-bench": ("specdec_trt.bench.cli", "bench"),
    "specdec-distill": ("specdec_trt.distill.cli", "distill_command"),
}
CASES = [
    ("specdec-run", ["--help"], 0, "Generate from PROMPT"),
    ("specdec-run", ["-n", "abc", "hi"], 2, "'abc' is not a valid integer"),
    ("specdec-run", ["--engines", "/nonexistent", "hi"], 2, "does not exist"),
    ("specdec-run", ["--engines", ".", "--device", "cuda", "hi"], 2, "--device does not apply"),
    ("specdec-build", ["--help"], 0, "Compile a target"),
    ("specdec-build", ["--out", "x"], 2, "give --target"),
    ("specdec-serve", ["--help"], 0, "Serve the OpenAI API"),
    ("specdec-serve", ["--port", "99999"], 2, "99999 is not in the range"),
    ("specdec-bench", ["--help"], 0, "Time plain decoding"),
    ("specdec-bench", ["-k", "x"], 2, "is neither a draft length"),
    ("specdec-distill", ["--help"], 0, "Train a small draft"),
    ("specdec-distill", ["--out", "d", "--steps", "-1"], 2, "-1 is not in the range"),
]
PROBE = """
import json, sys
from importlib import import_module
from click.testing import CliRunner
module, name, args = json.loads(sys.argv[1])
result = CliRunner().invoke(getattr(import_module(module), name), args)
heavy = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)
print(json.dumps({"code": result.exit_code, "output": result.output, "heavy": heavy}))
"""


@pytest.mark.parametrize(("command", "args", "code", "message"), CASES)
def test_a_command_answers_before_importing_the_runtime(command: str, args: list[str], code: int, message: str) -> None:
    module, name = COMMANDS[command]
    argv = [sys.executable, "-c", PROBE, json.dumps([module, name, args]), json.dumps(HEAVY)]
    found = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout)
    assert (found["code"], found["heavy"]) == (code, []), found
    assert message in " ".join(found["output"].split()), found["output"]


def test_the_dtype_choices_are_the_engine_s_dtypes() -> None:
    assert sorted(DTYPE_NAMES) == sorted(DTYPES)
