"""The server's life: loading, ready, draining, failed; and a uvicorn server that drains on SIGTERM/SIGINT.

While loading, draining or after a fatal engine error the server answers 503 (``/health`` too), so a load
balancer sends traffic elsewhere. A first SIGTERM or SIGINT starts draining: new requests get 503 while the
ones in flight finish, up to the drain timeout; then the process exits with status 0. A second signal exits
at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from specdec_trt.decoder import SpeculativeDecoder
from specdec_trt.serve.protocol import APIError

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"


class Lifecycle:
    """Where the server is in its life, and how many generation requests it has in flight."""

    def __init__(self) -> None:
        self.state = LOADING
        self.decoder: SpeculativeDecoder | None = None
        self.error: str | None = None
        self.in_flight = 0
        self._deadline: float | None = None
        self._lock = threading.Lock()

    def load(self, load: Callable[[], SpeculativeDecoder]) -> None:
        """Open the models (in a thread of the caller's choosing); a failure is fatal."""
        try:
            decoder = load()
        except Exception as error:  # noqa: BLE001 - reported as the server's state, then by the command
            self.fail(f"{type(error).__name__}: {error}" if not str(error) else str(error))
            return
        with self._lock:
            self.decoder = decoder
            if self.state == LOADING:
                self.state = READY

    def fail(self, message: str) -> None:
        self.state, self.error = FAILED, message

    def drain(self, timeout: float) -> None:
        """Stop taking requests; those in flight have ``timeout`` seconds to finish."""
        with self._lock:
            if self.state != FAILED:
                self.state = DRAINING
            self._deadline = time.monotonic() + timeout

    @property
    def drained(self) -> bool:
        """Whether a drain has ended: nothing in flight, or its time is up."""
        return self._deadline is not None and (self.in_flight == 0 or time.monotonic() > self._deadline)

    def health(self) -> tuple[bool, str]:
        """(ready, the state or what went wrong)."""
        engine_error = self.decoder is not None and self.decoder.scheduler.error is not None
        if engine_error and self.state == READY:
            self.fail(f"the engine stopped after an error: {self.decoder.scheduler.error}")
        return self.state == READY, self.error or self.state

    def serving(self) -> SpeculativeDecoder:
        """The decoder, or a 503 saying why there is none to serve with."""
        ready, why = self.health()
        if not ready:
            raise APIError(503, f"the server is not ready ({why}): retry later or elsewhere", code="unavailable")
        return self.decoder


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM and SIGINT draining the lifecycle before the server stops, and a clean exit
    status (uvicorn itself re-raises the signal after shutting down)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout: float) -> None:
        super().__init__(config)
        self.lifecycle, self.drain_timeout = lifecycle, drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.state in (DRAINING, FAILED) or self.should_exit:
            self.should_exit = self.force_exit = True
            return
        self.lifecycle.drain(self.drain_timeout)

    async def on_tick(self, counter: int) -> bool:
        if self.lifecycle.drained or (self.lifecycle.state == FAILED and self.lifecycle.decoder is None):
            self.should_exit = True
        return await super().on_tick(counter)
