"""Helpers of the server tests: a real uvicorn server on 127.0.0.1 in a thread, and reading its metrics."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdec_trt.decoder import SpeculativeDecoder
from specdec_trt.serve.app import ServerSettings, create_app
from specdec_trt.serve.lifecycle import READY, Lifecycle

MODEL = "tiny"
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served:
    """A running server: its base URL, lifecycle and an httpx client with the API key."""

    def __init__(self, url: str, lifecycle: Lifecycle, server: uvicorn.Server, api_key: str | None) -> None:
        self.url, self.lifecycle, self.server = url, lifecycle, server
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=60)

    @property
    def decoder(self) -> SpeculativeDecoder:
        return self.lifecycle.decoder

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics, by (name, sorted labels without the model's name)."""
        samples = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                samples[(sample.name, labels)] = sample.value
        return samples


@contextmanager
def serve(
    load: Callable[[], SpeculativeDecoder],
    api_key: str | None = API_KEY,
    wait_ready: bool = True,
    max_request_bytes: int | None = None,
) -> Iterator[Served]:
    """Serve ``load``'s decoder on a free port of 127.0.0.1 until the block ends (``max_request_bytes``: the
    server's bound on a body, None: its default)."""
    lifecycle = Lifecycle()
    settings = ServerSettings(MODEL, api_key)
    if max_request_bytes is not None:
        settings = dataclasses.replace(settings, max_request_bytes=max_request_bytes)
    app = create_app(load, settings, lifecycle)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    served = Served(f"http://127.0.0.1:{port}", lifecycle, server, api_key)
    try:
        wait_until(lambda: server.started, "the server did not start")
        if wait_ready:
            wait_until(lambda: lifecycle.state == READY, "the models did not load")
        yield served
    finally:
        server.should_exit = True
        thread.join(30)
        served.http.close()


def wait_until(condition: Callable[[], bool], message: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.01)


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    """The JSON payloads of a server-sent-event stream, then "[DONE]"."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)
