"""The ``specdec-run`` command: streaming, JSON output, chat template, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import TEXT_VOCAB_SIZE
from rich.console import Console

from specdec_trt import SamplingParams, SpeculativeDecoder, build_progress
from specdec_trt.build_engines.manifest import MANIFEST_NAME, SCHEMA_VERSION
from specdec_trt.cli import run


@pytest.fixture(scope="module")
def target(make_checkpoint):
    return make_checkpoint(family="qwen3")


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(run, list(args), input=input)


def test_streams_the_same_text_as_the_api(target) -> None:
    result = invoke("--target", str(target), "-n", "16", "-t", "0.8", "--seed", "3", "hello world")
    assert result.exit_code == 0, result.output
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=3)
    expected = SpeculativeDecoder.from_pretrained(target, "ngram").generate("hello world", params)
    assert result.stdout == expected.text + "\n"
    assert "acceptance rate" in result.stderr and "tokens/s" in result.stderr


def test_json_output(target, make_checkpoint) -> None:
    draft = make_checkpoint(draft_of=({"family": "qwen3"}, 0.1), seed=4)
    result = invoke("--target", str(target), "--draft", str(draft), "-k", "3", "-n", "12", "--json", "abc")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["num_draft_tokens"] == 3 and data["finish_reason"] in ("stop", "length")
    assert 1 <= len(data["token_ids"]) <= 12
    assert data["stats"]["generated_tokens"] == len(data["token_ids"])
    assert 0 <= data["stats"]["acceptance_rate"] <= 1 and data["stats"]["drafted_tokens"] > 0


def test_auto_draft_length(target, make_checkpoint) -> None:
    """-k auto: the JSON says "auto" and how many drafts a round made on average; greedy output is the plain
    output; the streamed table shows k=auto and the drafts per round."""
    draft = make_checkpoint(draft_of=({"family": "qwen3"}, 0.1), seed=4)
    common = ("--target", str(target), "-n", "16", "--json", "abc")
    result = invoke("--draft", str(draft), "-k", "auto", *common)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["num_draft_tokens"] == "auto"
    stats = data["stats"]
    assert stats["drafted_tokens"] > 0 and stats["rounds"] > 0
    assert stats["drafts_per_round"] == pytest.approx(stats["drafted_tokens"] / stats["rounds"])
    plain = json.loads(invoke("--draft", "none", *common).stdout)
    assert data["token_ids"] == plain["token_ids"]
    streamed = invoke("--target", str(target), "--draft", str(draft), "--num-draft-tokens", "auto", "-n", "16", "abc")
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout == data["text"] + "\n"
    assert "k=auto" in streamed.stderr and "drafts per round" in streamed.stderr


def test_plain_decoding_and_prompt_from_stdin(target) -> None:
    result = invoke("--target", str(target), "--draft", "none", "-n", "5", "--json", "-", input="hello")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["num_draft_tokens"] == 0 and data["stats"]["drafted_tokens"] == 0
    assert data["stats"]["prompt_tokens"] == len("hello")


def test_chat_template(target) -> None:
    result = invoke("--target", str(target), "--chat", "-n", "2", "--json", "hi")
    assert result.exit_code == 0, result.output
    assert (
        json.loads(result.stdout)["stats"]["prompt_tokens"] == len("<s>user: hi\n<s>assistant: ") - 2 * len("<s>") + 2
    )


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--top-p", "0", "x"], 2, "--top-p"),
        (["--temperature", "-1", "x"], 2, "--temperature"),
        (["--max-new-tokens", "0", "x"], 2, "--max-new-tokens"),
        (["--draft", "no/such/dir", "x"], 1, "does not exist"),
        (["--draft", "ngram+none", "x"], 1, "after 'ngram+' name the model"),
        (["--draft", "ngram+no/such/dir", "x"], 1, "does not exist"),
        (["--max-context", "16", "-n", "20", "x"], 1, "max context"),
        (["-n", "4", ""], 1, "prompt is empty"),
        (["--device", "tpu9", "x"], 1, "not a torch device"),
        (["-k", "automatic", "x"], 2, "'automatic' is neither a draft length (an integer from 0 to 64) nor 'auto'"),
        (["-k", "65", "x"], 2, "neither a draft length"),
        (["--num-draft-tokens", "-1", "x"], 2, "neither a draft length"),
        (["--engines", ".", "x"], 2, "--engines and --target are alternatives"),
    ],
)
def test_bad_input_is_a_clear_error(target, args: list[str], code: int, message: str) -> None:
    result = invoke("--target", str(target), *args)
    assert result.exit_code == code
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("option", ["--enforce-eager", pytest.param("--compile", marks=pytest.mark.slow)])
def test_step_modes_on_the_pytorch_engine_only(target, tmp_path, option: str) -> None:
    """--enforce-eager (on the CPU the engine is eager anyway) and --compile run with --target, and give the
    default mode's greedy tokens; both are refused for ONNX Runtime engines."""
    default = invoke("--target", str(target), "-n", "6", "--json", "hi")
    result = invoke("--target", str(target), option, "-n", "6", "--json", "hi")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["token_ids"] == json.loads(default.stdout)["token_ids"]
    assert ("torch.compile compiles the layers" in result.stderr) == (option == "--compile")  # no silent wait
    result = invoke("--engines", str(tmp_path), option, "hi")
    assert result.exit_code == 2 and f"{option} does not apply to ONNX Runtime engines" in result.output


def test_mismatched_draft_vocabulary(target, make_checkpoint) -> None:
    wider = make_checkpoint(family="qwen3", vocab_size=TEXT_VOCAB_SIZE + 3)
    result = invoke("--target", str(target), "--draft", str(wider), "x")
    assert result.exit_code == 1
    assert "Error:" in result.output and "token ids" in result.output


def test_missing_target_path() -> None:
    result = invoke("--target", "no/such/model", "x")
    assert result.exit_code == 2 and "does not exist" in result.output


@pytest.mark.parametrize("cached_version", [None, SCHEMA_VERSION - 1])
def test_default_engines_are_built_when_missing_or_stale(tmp_path, monkeypatch, cached_version) -> None:
    """The cached default engines are (re)built when absent or of another schema version. The build itself
    is replaced by a recorder here; test_default_model_answers runs the real one, and test_bad_input.py
    reuses, waits for and rebuilds tiny ones."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    directory = tmp_path / "engines" / "smollm2-135m"
    if cached_version is not None:
        directory.mkdir(parents=True)
        (directory / MANIFEST_NAME).write_text(json.dumps({"schema_version": cached_version}))
    builds = []
    monkeypatch.setattr(build_progress, "build_with_progress", lambda request, err: builds.append(request))
    console = Console(record=True, width=200)
    assert build_progress.default_engines_shown(console) == directory
    assert [(b.out, b.force) for b in builds] == [(directory, True)]
    message = console.export_text()
    assert "Building the default engines" in message
    if cached_version is not None:
        assert f"schema version {cached_version}" in message


@pytest.mark.slow
def test_default_model_answers(tmp_path) -> None:
    """The real path: the console script with no model arguments builds the default engines
    (SmolLM2-135M-Instruct, int4 self-draft) into the cache on first use, then reuses them."""
    executable = Path(sys.executable).parent / "specdec-run"  # the console script beside this interpreter
    assert executable.is_file(), f"{executable} is not installed"
    command = [str(executable), "--chat", "-n", "24", "--json", "What is the capital of France?"]
    environment = {**os.environ, "SPECDEC_CACHE": str(tmp_path)}
    runs = [subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment) for _ in range(2)]
    for completed in runs:
        assert completed.returncode == 0, completed.stderr
        data = json.loads(completed.stdout)
        assert "Paris" in data["text"]
        assert data["stats"]["generated_tokens"] == len(data["token_ids"]) > 0
        assert data["draft"] == "ngram+engine" and data["num_draft_tokens"] == "auto"
        assert data["stats"]["drafted_tokens"] > 0
    assert "Building the default engines" in runs[0].stderr
    assert "Building" not in runs[1].stderr, "the second run should reuse the cached engines"
    assert (tmp_path / "engines" / "smollm2-135m" / "manifest.json").is_file()
