"""The FastAPI application: OpenAI's completions, chat completions and models endpoints, /health and /metrics.

The models load in a thread after the server starts listening (it answers 503 meanwhile). Each generation
request is validated, tokenized and submitted to the decoder's scheduler from the event loop, which then
consumes the request's text deltas through its handle's async iteration; a client that goes away cancels its
request, which frees its slot at the engine thread's next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specdec_trt.decoder import SpeculativeDecoder
from specdec_trt.request import GenerationError, GenerationOutput, QueueFullError, RequestHandle, SchedulerClosedError
from specdec_trt.runtime.engine import ContextOverflowError
from specdec_trt.serve.lifecycle import Lifecycle
from specdec_trt.serve.metrics import ServerMetrics
from specdec_trt.serve.protocol import CHAT, COMPLETIONS, APIError, ParsedRequest, bad_request, parse_request
from specdec_trt.serve.request_limits import DEFAULT_MAX_REQUEST_BYTES
from specdec_trt.serve.responses import DONE, ResponseWriter, error_body, sse


@dataclass(frozen=True)
class ServerSettings:
    """What the routes need besides the decoder: the model's name, the API key (None: open), the most bytes a
    request's body may hold and the Retry-After seconds sent with a 429."""

    model_name: str
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    retry_after_s: int = 1


def create_app(
    load: Callable[[], SpeculativeDecoder],
    settings: ServerSettings,
    lifecycle: Lifecycle,
    *,
    background_load: bool = True,
    metrics: ServerMetrics | None = None,
    scrape: Callable[[], Awaitable[bytes]] | None = None,
) -> FastAPI:
    """The application. ``load`` opens the decoder: in a thread once the server is up (answering 503 meanwhile),
    or with ``background_load`` False during the startup itself, so that the app takes no request before it is
    ready (as a Ray Serve replica needs). ``scrape`` answers /metrics in place of ``metrics``' own exposition
    (a Ray replica answers with every replica's)."""
    metrics = metrics or ServerMetrics(settings.model_name)

    def opened() -> SpeculativeDecoder:
        decoder = load()
        decoder.scheduler.on_round = metrics.observe_round
        decoder.scheduler.on_finish = metrics.observe_finished
        metrics.track_queue(lambda: decoder.scheduler.num_running, lambda: decoder.scheduler.num_waiting)
        return decoder

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if background_load:
            threading.Thread(target=lifecycle.load, args=(opened,), name="specdec-load", daemon=True).start()
        else:
            await asyncio.to_thread(lifecycle.load, opened)
        yield
        if lifecycle.decoder is not None:
            lifecycle.decoder.scheduler.close(cancel=True)
            lifecycle.decoder.close()

    app = FastAPI(title="specdec-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    async def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {settings.api_key}":
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        headers = {"Retry-After": str(settings.retry_after_s)} if error.status in (429, 503) else None
        return ErrorResponse(error, headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return ErrorResponse(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        """A bug answers in OpenAI's error JSON too (the traceback goes to the log), never in plain text."""
        return ErrorResponse(APIError(500, f"internal error ({type(error).__name__})", code="internal_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        ready, why = lifecycle.health()
        return JSONResponse({"status": why}, status_code=200 if ready else 503)

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def prometheus() -> Response:
        text = metrics.exposition() if scrape is None else await scrape()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str) -> dict:
        if model_id != settings.model_name:
            raise model_not_found(model_id)
        return model_card()

    def model_card() -> dict:
        decoder = lifecycle.serving()
        return {
            "id": settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "specdec-trt",
            "max_model_len": decoder.max_context,
        }

    def model_not_found(name: str) -> APIError:
        message = f"the model '{name}' does not exist: this server serves '{settings.model_name}'"
        return APIError(404, message, "model", "model_not_found")

    async def generate(request: Request, kind: str) -> Response:
        parsed = parse_request(kind, await _json_body(request, settings.max_request_bytes))
        decoder = lifecycle.serving()
        if parsed.model is not None and parsed.model != settings.model_name:
            raise model_not_found(parsed.model)
        handle = await asyncio.to_thread(_submit, decoder, parsed)  # tokenizing a long prompt holds no other request
        lifecycle.in_flight += 1

        def close() -> None:
            if not handle.done:  # the client went away: free the slot
                handle.cancel()
            lifecycle.in_flight -= 1

        writer = ResponseWriter(kind, settings.model_name, parsed.include_usage)
        if parsed.stream:
            return EventStream(_events(handle, writer), close)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
        try:
            output = await _collect(handle)
        finally:
            watcher.cancel()
            close()
        return JSONResponse(writer.whole(output))

    async def _collect(handle: RequestHandle) -> GenerationOutput:
        try:
            async for _ in _timed(handle):
                pass
        except GenerationError as error:
            raise APIError(500, f"the engine failed: {error}", code="engine_error") from None
        return handle.output

    async def _events(handle: RequestHandle, writer: ResponseWriter) -> AsyncIterator[str]:
        try:
            if (opening := writer.first()) is not None:
                yield opening
            async for piece in _timed(handle):
                yield writer.piece(piece)
            yield writer.last(handle.output)
        except GenerationError as error:
            yield sse(error_body(APIError(500, f"the engine failed: {error}", code="engine_error"))) + DONE

    async def _timed(handle: RequestHandle) -> AsyncIterator[str]:
        """The handle's pieces, observing the gaps between them."""
        last = None
        async for piece in handle:
            now = time.perf_counter()
            if last is not None:
                metrics.observe_gap(now - last)
            last = now
            yield piece

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT)

    return app


async def _json_body(request: Request, max_bytes: int) -> object:
    """The request's JSON, read up to ``max_bytes`` (past them: 413, the rest unread)."""
    message = f"the request body is larger than this server takes ({max_bytes} bytes): see --max-request-bytes"
    too_large = APIError(413, message, code="too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
        return json.loads(b"".join(chunks))
    except ClientDisconnect:  # gone mid-body: nobody to answer, nothing to log
        raise APIError(400, "the client disconnected before its request's body ended") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply to parse", code="invalid_json") from None
    except ValueError as error:  # not JSON, not UTF-8, or a number of more digits than Python converts
        raise bad_request(f"the request body is not valid JSON ({error})", code="invalid_json") from None


class ErrorResponse(JSONResponse):
    """OpenAI's error JSON, ASCII only: a message that quotes the client's input (a lone surrogate in a field's
    name) still encodes."""

    def __init__(self, error: APIError, headers: dict[str, str] | None = None) -> None:
        super().__init__(error_body(error), status_code=error.status, headers=headers)

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _submit(decoder: SpeculativeDecoder, parsed: ParsedRequest) -> RequestHandle:
    """Tokenize the prompt (a chat through the template), fill an unbounded chat's token limit to the
    context, and submit; the decoder's refusals become the matching HTTP errors."""
    try:
        ids = decoder.tokenize_chat(parsed.messages) if parsed.kind == CHAT else decoder.tokenize(parsed.prompt)
        params, gamma = parsed.params, parsed.num_draft_tokens
        if parsed.max_tokens is None:
            reserve = decoder.draft_reserve(gamma)
            room = decoder.max_context - len(ids) - reserve
            if room < 1:
                raise ContextOverflowError(
                    f"the prompt's {len(ids)} tokens leave no room in the max context {decoder.max_context} "
                    f"(with {reserve} draft tokens): shorten the prompt"
                )
            params = replace(params, max_new_tokens=room)
        return decoder.submit(ids, params, gamma)
    except QueueFullError as error:
        raise APIError(429, str(error), code="queue_full") from None
    except SchedulerClosedError as error:
        raise APIError(503, str(error), code="unavailable") from None
    except ContextOverflowError as error:
        raise bad_request(
            str(error), "messages" if parsed.kind == CHAT else "prompt", "context_length_exceeded"
        ) from None
    except ValueError as error:
        raise bad_request(str(error)) from None


class EventStream(StreamingResponse):
    """Server-sent events that run ``on_close`` however the response ends, even when the client went away
    before the stream started."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    """Cancel the request when its client disconnects before the answer is ready."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()
