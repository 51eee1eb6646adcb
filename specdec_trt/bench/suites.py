"""Benchmark prompt suites: JSONL files of ``{"id", "prompt", "chat"}`` objects, shipped with the package.

``chat`` says whether the prompt is a user message to wrap in the model's chat template (true) or raw
text to continue (false, e.g. a code prefix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec_trt.user_text import read_text

PROMPTS_DIR = Path(__file__).parent / "prompts"
SUITES = ("code", "chat", "summarisation", "long-context")


class SuiteError(ValueError):
    """A suite name is unknown or its file is malformed."""


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of a suite."""

    id: str
    prompt: str
    chat: bool


@dataclass(frozen=True)
class Suite:
    """A named list of prompts."""

    name: str
    prompts: tuple[BenchPrompt, ...]


def load_suite(name_or_path: str | Path) -> Suite:
    """A shipped suite by name (one of ``SUITES``) or any JSONL file of the same format."""
    path = Path(name_or_path)
    if str(name_or_path) in SUITES:
        path = PROMPTS_DIR / f"{name_or_path}.jsonl"
    elif not path.is_file():
        raise SuiteError(f"{name_or_path!r} is neither a suite ({', '.join(SUITES)}) nor a JSONL file")
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if line.strip():
            prompts.append(_parse(line, f"{path}:{number}"))
    if not prompts:
        raise SuiteError(f"{path} holds no prompts")
    ids = [p.id for p in prompts]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise SuiteError(f"{path}: prompt ids must be unique, repeated: {', '.join(duplicated)}")
    return Suite(path.stem, tuple(prompts))


def interleaved_prompt_texts(tokenizer, suites: tuple[str, ...] = ("code", "chat", "summarisation")) -> list[str]:
    """The suites' prompts as texts for an OpenAI completions request, interleaved (code, chat, summarisation,
    code, ...); chat prompts rendered with ``tokenizer``'s chat template."""
    texts = []
    for group in zip(*(load_suite(name).prompts for name in suites)):
        for prompt in group:
            chat = [{"role": "user", "content": prompt.prompt}]
            texts.append(
                tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                if prompt.chat
                else prompt.prompt
            )
    return texts


def _parse(line: str, where: str) -> BenchPrompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise SuiteError(f"{where}: not valid JSON ({err})") from err
    if not isinstance(item, dict):
        raise SuiteError(f"{where}: each line must be a JSON object")
    prompt_id, prompt, chat = item.get("id"), item.get("prompt"), item.get("chat", True)
    if not isinstance(prompt_id, str) or not prompt_id:
        raise SuiteError(f"{where}: needs a non-empty string 'id'")
    if not isinstance(prompt, str) or not prompt.strip():
        raise SuiteError(f"{where}: needs a non-empty string 'prompt'")
    if not isinstance(chat, bool):
        raise SuiteError(f"{where}: 'chat' must be true or false")
    return BenchPrompt(prompt_id, prompt, chat)
