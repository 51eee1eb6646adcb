"""The OpenAI request bodies the server takes, validated field by field into what the decoder needs.

A field the server does not implement is refused by name (HTTP 400) unless it carries its neutral value
(``"n": 1``, ``"logprobs": null``, ``"presence_penalty": 0``, ...), so no request is ever served with a
setting silently ignored. Extensions: ``top_k``, ``min_p``, ``ignore_eos`` (as vLLM takes them) and
``"speculative": {"num_draft_tokens": int | "auto"}`` (0 turns speculation off for the request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec_trt.decoder import AUTO, DraftLength, check_num_draft_tokens
from specdec_trt.policy import MAX_DRAFT_LENGTH
from specdec_trt.sampling import SamplingParams
from specdec_trt.serve.request_limits import MAX_STOP_CHARS, MAX_STOP_STRINGS
from specdec_trt.validation import MAX_SEED

COMPLETIONS, CHAT = "completions", "chat"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat fills the context
ROLES = ("system", "user", "assistant")  # the roles of text chat that a chat template renders

# Fields both endpoints implement, and each endpoint's own.
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "ignore_eos",
    "speculative",
}
OWN = {COMPLETIONS: {"prompt"}, CHAT: {"messages", "max_completion_tokens"}}
# Fields of OpenAI's API the server does not implement, with the values that mean "off" and are accepted.
NEUTRAL: dict[str, tuple] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "web_search_options": (None,),
}


class APIError(Exception):
    """An error answered in OpenAI's error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: a text prompt (chat messages rendered by the template later) or token ids."""

    kind: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None  # None: chat without a limit, filled to the context
    params: SamplingParams
    num_draft_tokens: DraftLength | None  # None: the server's default
    stream: bool
    include_usage: bool
    model: str | None


def parse_request(kind: str, body: object) -> ParsedRequest:
    """Validate an endpoint's JSON body; an ``APIError`` (400) names the first field at fault."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    known = COMMON | OWN[kind]
    for name, value in body.items():
        if name in known:
            continue
        if name in NEUTRAL:
            if _neutral(value, NEUTRAL[name]):
                continue
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported_field")
        raise bad_request(f"unknown field '{name}'", name, "unknown_field")
    n = _field(body, "n", int, 1)
    if n != 1:
        raise bad_request(f"n={n} is not supported: this server returns one choice per request (n=1)", "n")
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    extra = set(options or {}) - {"include_usage", "continuous_usage_stats"}
    if extra:
        raise bad_request(f"stream_options field '{sorted(extra)[0]}' is not supported", "stream_options")
    if (options or {}).get("continuous_usage_stats"):
        raise bad_request("stream_options.continuous_usage_stats is not supported", "stream_options")
    include_usage = _field(options or {}, "include_usage", bool, False, "stream_options.include_usage")
    model = _field(body, "model", str, None)
    _field(body, "user", str, None)
    prompt, messages = (_prompt(body), None) if kind == COMPLETIONS else (None, _messages(body))
    max_tokens = _max_tokens(kind, body)
    params = _sampling(body, max_tokens)
    return ParsedRequest(kind, prompt, messages, max_tokens, params, _speculative(body), stream, include_usage, model)


def _neutral(value: object, accepted: tuple) -> bool:
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted)


def _field(body: dict, name: str, kind: type, default: Any, label: str | None = None) -> Any:
    """``body[name]`` checked to be of JSON type ``kind`` (numbers: an int is a float), or ``default`` when
    absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        label = label or name
        raise bad_request(f"'{label}' must be {_TYPE_NAMES[kind]}, got {_json_type(value)}", label)
    return value


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "an object"}


def _json_type(value: object) -> str:
    return (_TYPE_NAMES | {list: "an array"}).get(type(value), "an object")


def _prompt(body: dict) -> str | list[int]:
    """A string, a list of token ids, or either wrapped in a list of one (several prompts are refused)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"a batch of {len(prompt)} prompts is not supported: send one prompt per request", "prompt")
    raise bad_request("'prompt' must be a non-empty string or a list of token ids", "prompt")


def _messages(body: dict) -> list[dict[str, str]]:
    """Chat messages with a role and text content (a string or a list of text parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of messages", "messages")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"{where} must be an object with a string 'role'", where)
        if message["role"] not in ROLES:
            raise bad_request(f"{where}.role {message['role']!r} is none of {', '.join(ROLES)}", f"{where}.role")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise bad_request(f"{where}.{sorted(extra)[0]} is not supported", where)
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise bad_request(f"{where}.content: only text parts are supported", where)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or a list of text parts", where)
        parsed.append({"role": message["role"], "content": content})
    return parsed


def _max_tokens(kind: str, body: dict) -> int | None:
    names = ["max_tokens"] + (["max_completion_tokens"] if kind == CHAT else [])
    given = [(name, _field(body, name, int, None)) for name in names]
    given = [(name, value) for name, value in given if value is not None]
    if len(given) > 1 and given[0][1] != given[1][1]:
        raise bad_request("'max_tokens' and 'max_completion_tokens' disagree: give one", "max_completion_tokens")
    if not given:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if kind == COMPLETIONS else None
    name, value = given[0]
    if value < 1:
        raise bad_request(f"'{name}' must be at least 1, got {value}", name)
    return value


def _sampling(body: dict, max_tokens: int | None) -> SamplingParams:
    temperature = _field(body, "temperature", float, 1.0)
    if not 0 <= temperature <= 2:
        raise bad_request(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_p = _field(body, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _field(body, "top_k", int, 0)
    if top_k < -1:
        raise bad_request(f"'top_k' must be >= 0 (0 or -1: off), got {top_k}", "top_k")
    min_p = _field(body, "min_p", float, 0.0)
    if not 0 <= min_p < 1:
        raise bad_request(f"'min_p' must be in [0, 1), got {min_p}", "min_p")
    seed = _field(body, "seed", int, None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad_request(f"'seed' must be in [0, 2^64 - 1], got {seed}", "seed")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or an array of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        longest = max(map(len, stop))
        raise bad_request(f"a 'stop' string may be at most {MAX_STOP_CHARS} characters, got {longest}", "stop")
    ignore_eos = _field(body, "ignore_eos", bool, False)
    try:
        return SamplingParams(
            # A placeholder for chat without a limit: the server sets it once the prompt's length is known.
            max_new_tokens=max_tokens or 1,
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            min_p=min_p,
            seed=seed,
            stop=tuple(stop),
            ignore_eos=ignore_eos,
        )
    except ValueError as error:  # in range for JSON, out of range for the engines (top_k past int64)
        raise bad_request(str(error)) from None


def _speculative(body: dict) -> DraftLength | None:
    speculative = _field(body, "speculative", dict, None)
    if speculative is None:
        return None
    extra = set(speculative) - {"num_draft_tokens"}
    if extra:
        raise bad_request(f"speculative.{sorted(extra)[0]} is not supported", "speculative")
    value = speculative.get("num_draft_tokens")
    if value is None:
        return None
    try:
        value = check_num_draft_tokens(value)
    except ValueError as error:
        raise bad_request(f"speculative.{error}", "speculative.num_draft_tokens") from None
    if value != AUTO and value > MAX_DRAFT_LENGTH:
        raise bad_request(
            f"speculative.num_draft_tokens={value} is more than the {MAX_DRAFT_LENGTH} this server drafts in a round",
            "speculative.num_draft_tokens",
        )
    return value
