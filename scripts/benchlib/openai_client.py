"""Streamed requests to an OpenAI-compatible server, timed as a client sees them: ``/v1/completions`` (each
arrival stamped) and ``/v1/chat/completions`` (time to first token, end to end, and the usage counts).

Every server-sent event that carries text stamps an arrival. The tokens are counted from the response's
``usage`` (``stream_options.include_usage``); a server that sends no usage when streaming (llama_cpp.server)
has its text counted by ``count_tokens`` instead, with the same tokenizer, so no count comes from the number
of chunks (one chunk may carry several tokens).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx

from benchlib.load import RequestTiming


class ServerResponseError(RuntimeError):
    """A request the server answered with an error status or a malformed stream."""


def stream_chunks(client: httpx.Client, path: str, body: dict) -> Iterator[dict]:
    """POST ``body`` to ``path`` and yield each server-sent event's JSON chunk, up to ``[DONE]``."""
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise ServerResponseError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise ServerResponseError(f"error in the stream: {chunk['error']}")
            yield chunk


def stream_completion(
    client: httpx.Client, body: dict, count_tokens: Callable[[str], int] | None = None
) -> tuple[RequestTiming, str]:
    """POST ``body`` (with ``"stream": true``) to ``/v1/completions``; the timing and the whole text."""
    body = body | {"stream": True}
    timing = RequestTiming(time.perf_counter())
    pieces: list[str] = []
    usage = None
    for chunk in stream_chunks(client, "/v1/completions", body):
        usage = chunk.get("usage") or usage
        text = "".join(choice.get("text") or "" for choice in chunk.get("choices", []))
        if text:
            timing.arrivals.append(time.perf_counter())
            pieces.append(text)
    text = "".join(pieces)
    if usage is not None:
        timing.tokens = usage["completion_tokens"]
    elif count_tokens is not None:
        timing.tokens = count_tokens(text)
    else:
        raise ServerResponseError("the stream carried no usage and no tokenizer was given to count its text")
    timing.ok = bool(timing.arrivals)
    return timing, text


def stream_chat(
    client: httpx.Client, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, float, float, dict]:
    """One streamed chat completion: its text, time to first token, end-to-end time and usage counts."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    sent, first, pieces, usage, timings = time.perf_counter(), None, [], None, None
    for chunk in stream_chunks(client, "/v1/chat/completions", body):
        usage, timings = chunk.get("usage") or usage, chunk.get("timings") or timings
        text = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", []))
        if text:
            first = first or time.perf_counter()
            pieces.append(text)
    if usage is None or first is None:
        raise ServerResponseError("the stream carried no text or no usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and timings is not None:  # llama-server reports its cache hits in its timings
        cached = timings.get("cache_n", 0)
    counts = {"prompt": usage["prompt_tokens"], "cached": cached or 0, "completion": usage["completion_tokens"]}
    return "".join(pieces), first - sent, time.perf_counter() - sent, counts
