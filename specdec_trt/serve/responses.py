"""OpenAI response bodies: completions and chat completions, whole or as server-sent-event chunks, usage,
errors, and the per-choice speculative-decoding stats."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from specdec_trt.request import GenerationOutput
from specdec_trt.serve.protocol import CHAT, APIError
from specdec_trt.stats import GenerationStats

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
DONE = "data: [DONE]\n\n"


def error_body(error: APIError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": ERROR_TYPES.get(error.status, "invalid_request_error"),
            "param": error.param,
            "code": error.code,
        }
    }


def speculative_stats(stats: GenerationStats) -> dict[str, Any]:
    """vLLM's speculative-decoding counters for one request, and the rates derived from them."""
    num_drafts = stats.drafted_per_position[0] if stats.drafted_per_position else 0
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": stats.drafted_tokens,
        "num_accepted_tokens": stats.accepted_tokens,
        "num_accepted_tokens_per_pos": list(stats.accepted_per_position),
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": 1 + stats.accepted_tokens / num_drafts if num_drafts else 1.0,
        "per_position_acceptance_rate": stats.per_position_acceptance,
    }


def usage(output: GenerationOutput) -> dict[str, int]:
    """Exactly the prompt's tokens and the emitted ones (a stop string ends the count at its last token)."""
    prompt, completion = output.stats.prompt_tokens, len(output.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": output.stats.cached_prompt_tokens},
    }


def finish_reason(output: GenerationOutput) -> str:
    return "abort" if output.finish_reason == "cancelled" else output.finish_reason


class ResponseWriter:
    """Builds one request's response: the whole body, or its stream of chunks."""

    def __init__(self, kind: str, model: str, include_usage: bool = False) -> None:
        self.kind, self.model, self.include_usage = kind, model, include_usage
        prefix = "chatcmpl" if kind == CHAT else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        if self.kind == CHAT:
            object_name = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            object_name = "text_completion"
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, output: GenerationOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": output.text}
        else:
            choice["text"] = output.text
        choice |= {"logprobs": None, "finish_reason": finish_reason(output)}
        choice["speculative"] = speculative_stats(output.stats)
        return self._envelope([choice], chunk=False) | {"usage": usage(output)}

    def _chunk(self, delta: dict[str, Any] | str, reason: str | None = None, **extra: Any) -> str:
        key = "delta" if self.kind == CHAT else "text"
        choice = {"index": 0, key: delta, "logprobs": None, "finish_reason": reason, **extra}
        body = self._envelope([choice], chunk=True)
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def first(self) -> str | None:
        """A chat stream opens with the assistant's role."""
        return self._chunk({"role": "assistant", "content": ""}) if self.kind == CHAT else None

    def piece(self, text: str) -> str:
        return self._chunk({"content": text} if self.kind == CHAT else text)

    def last(self, output: GenerationOutput) -> str:
        """The final chunk (finish reason and speculative stats), the usage chunk if asked for, and [DONE]."""
        empty: dict[str, Any] | str = {} if self.kind == CHAT else ""
        events = self._chunk(empty, finish_reason(output), speculative=speculative_stats(output.stats))
        if self.include_usage:
            events += sse(self._envelope([], chunk=True) | {"usage": usage(output)})
        return events + DONE


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
