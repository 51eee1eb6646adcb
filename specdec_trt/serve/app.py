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

from specdec_trt.decoder import SpeculativeDecoder
from specdec_trt.request import GenerationError, GenerationOutput, QueueFullError, RequestHandle, SchedulerClosedError
from specdec_trt.runtime.engine import ContextOverflowError
from specdec_trt.serve.lifecycle import Lifecycle
from specdec_trt.serve.metrics import ServerMetrics
from specdec_trt.serve.protocol import CHAT, COMPLETIONS, APIError, ParsedRequest, bad_request, parse_request
from specdec_trt.serve.responses import DONE, ResponseWriter, error_body, sse


@dataclass(frozen=True)
class ServerSettings:
    """What the routes need besides the decoder: the model's name, the API key (None: open) and the
    Retry-After seconds sent with a 429."""

    model_name: str
    api_key: str | None = None
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
        return JSONResponse(error_body(error), status_code=error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(APIError(error.status_code, str(error.detail))), status_code=error.status_code)

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
        decoder = lifecycle.serving()
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "specdec-trt",
            "max_model_len": decoder.max_context,
        }
        return {"object": "list", "data": [card]}

    async def generate(request: Request, kind: str) -> Response:
        parsed = parse_request(kind, await _json_body(request))
        decoder = lifecycle.serving()
        if parsed.model is not None and parsed.model != settings.model_name:
            raise APIError(
                404,
                f"the model '{parsed.model}' does not exist: this server serves '{settings.model_name}'",
                "model",
                "model_not_found",
            )
        handle = _submit(decoder, parsed)
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


async def _json_body(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON ({error})", code="invalid_json") from None


def _submit(decoder: SpeculativeDecoder, parsed: ParsedRequest) -> RequestHandle:
    """Tokenize the prompt (a chat through the template), fill an unbounded chat's token limit to the
    context, and submit; the decoder's refusals become the matching HTTP errors."""
    try:
        prompt = decoder.apply_chat_template(parsed.messages) if parsed.kind == CHAT else parsed.prompt
        ids = decoder.tokenize(prompt)
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
