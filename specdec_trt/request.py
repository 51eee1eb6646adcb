"""One request's life in the scheduler: its state, the handle its caller holds, and its output.

A request moves WAITING (queued for a slot) -> PREFILLING (in a slot, its prompt going in chunk by chunk) ->
DECODING (in rounds) -> FINISHED, and may finish from any state (cancelled, or an engine error). The moves
happen in ``Request``'s methods only, on the engine thread; the handle is the caller's side, safe from any
thread and from an event loop.
"""

from __future__ import annotations

import asyncio
import enum
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from specdec_trt.draft_length import AcceptanceEvidence
from specdec_trt.draft_spec import AUTO, DraftLength
from specdec_trt.sampling import SamplingParams
from specdec_trt.seeded_noise import SeededNoise
from specdec_trt.stats import GenerationStats
from specdec_trt.text import TextTracker

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


_MOVES = {
    RequestState.WAITING: {RequestState.PREFILLING, RequestState.FINISHED},
    RequestState.PREFILLING: {RequestState.DECODING, RequestState.FINISHED},
    RequestState.DECODING: {RequestState.FINISHED},
    RequestState.FINISHED: set(),
}


class GenerationError(RuntimeError):
    """A request ended with an engine error."""


class QueueFullError(RuntimeError):
    """The waiting queue is full: try again later (HTTP 429)."""


class SchedulerClosedError(RuntimeError):
    """The scheduler was closed, or stopped after an engine error, and takes no more requests."""


@dataclass
class GenerationOutput:
    """One request's result. ``finish_reason`` is "stop" (EOS or a stop string), "length", "cancelled" or
    "error"."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    error: str | None = None


class RequestHandle:
    """A submitted request: iterate it for text pieces as tokens are accepted (``for`` blocks, ``async for``
    awaits), ``cancel`` it, or wait for its ``result``. Pieces are buffered, so a paused consumer holds
    nothing up."""

    def __init__(self, request_id: int, cancel: Callable[[int], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._pieces: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # None: the request has ended
        self._done = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.output: GenerationOutput | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating: the request ends with finish reason "cancelled" and frees its slot (or its place
        in the queue)."""
        self._cancel(self.request_id)

    def result(self, timeout: float | None = None) -> GenerationOutput:
        """Wait for the request to end; a request that failed raises ``GenerationError``."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.output.finish_reason == "error":
            raise GenerationError(self.output.error)
        return self.output

    def __iter__(self) -> Iterator[str]:
        while (piece := self._pieces.get()) is not None:
            yield piece
        self.result()

    async def __aiter__(self) -> AsyncIterator[str]:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            try:
                piece = self._pieces.get_nowait()
            except queue.Empty:
                await self._wake.wait()
                self._wake.clear()
                continue
            if piece is None:
                self.result()
                return
            yield piece

    def push(self, piece: str | None) -> None:
        """From the engine thread: a text piece, or None once the request has ended."""
        self._pieces.put(piece)
        if piece is None:
            self._done.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)


@dataclass
class Request:
    """The engine thread's state of one request."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    num_draft_tokens: DraftLength
    tracker: TextTracker
    eos: frozenset[int]
    handle: RequestHandle
    submitted: float
    noise: SeededNoise | None = None  # a seeded request's own randomness
    state: RequestState = RequestState.WAITING
    slot: int | None = None
    prefilled: int = 0
    admitted: float = 0.0
    generated: list[int] = field(default_factory=list)
    sequence: list[int] = field(default_factory=list)  # the prompt and the generated tokens
    finish_reason: str | None = None
    error: str | None = None
    shown: int = 0  # characters of text emitted so far
    evidence: dict[str, AcceptanceEvidence] = field(default_factory=dict)  # per kind of draft, with "auto"
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __post_init__(self) -> None:
        self.sequence = list(self.prompt)

    @classmethod
    def create(
        cls,
        request_id: int,
        prompt: Sequence[int],
        params: SamplingParams,
        num_draft_tokens: DraftLength,
        now: float,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: frozenset[int],
        cancel: Callable[[int], None],
    ) -> Request:
        """A request submitted ``now``, with its handle (cancelling through ``cancel``), its text tracker and
        the tokens that end it."""
        eos = frozenset() if params.ignore_eos else eos_token_ids
        tracker, handle = TextTracker(tokenizer, params.stop), RequestHandle(request_id, cancel)
        return cls(request_id, list(prompt), params, num_draft_tokens, tracker, eos, handle, now)

    @property
    def decoding(self) -> bool:
        return self.state is RequestState.DECODING

    @property
    def prefilling(self) -> bool:
        return self.state is RequestState.PREFILLING

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.generated)

    @property
    def drafts(self) -> bool:
        """Whether the request ever drafts (its drafter follows its slot)."""
        return self.num_draft_tokens != 0

    @property
    def auto(self) -> bool:
        """Whether "auto" chooses its draft length."""
        return self.num_draft_tokens == AUTO

    def admit(self, slot: int, now: float, cached: int = 0) -> None:
        """Into ``slot``, to be prefilled after the first ``cached`` prompt tokens, which the slot already holds."""
        self._move(RequestState.PREFILLING)
        self.slot, self.admitted, self.prefilled = slot, now, cached
        self.stats.prompt_tokens = len(self.prompt)
        self.stats.cached_prompt_tokens = cached
        self.stats.queue_s = now - self.submitted

    def prefilled_chunk(self, tokens: int) -> bool:
        """``tokens`` more of the prompt are in the caches; True once the whole prompt is (now decoding)."""
        self.prefilled += tokens
        if self.prefilled < len(self.prompt):
            return False
        self._move(RequestState.DECODING)
        return True

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit tokens in order until one ends the request (EOS, a stop string, max_new_tokens)."""
        for token in tokens:
            if self.finished:
                return
            self.generated.append(token)
            self.sequence.append(token)
            if token in self.eos or self.tracker.add(token):
                self.finish("stop")
            elif self.remaining == 0:
                self.finish("length")

    def finish(self, reason: str, error: str | None = None) -> None:
        self._move(RequestState.FINISHED)
        self.finish_reason, self.error = reason, error

    def fail(self, error: str) -> None:
        """End with ``error``, also after a finish (its text could not be handed over)."""
        if not self.finished:
            self._move(RequestState.FINISHED)
        self.finish_reason, self.error = "error", error

    def emit(self) -> None:
        """Push the text that became stable since the last push (all of it once the request has finished)."""
        text = self.tracker.stable_text(self.finished)
        if len(text) > self.shown:
            self.handle.push(text[self.shown :])
            self.shown = len(text)

    def complete(self, now: float, on_finish: Callable[[GenerationOutput], None] | None) -> None:
        """Hand the ended request's output to ``on_finish``, then to its handle."""
        self.stats.total_s = now - self.submitted
        self.stats.generated_tokens = len(self.generated)
        output = GenerationOutput(self.tracker.text, list(self.generated), self.finish_reason, self.stats, self.error)
        self.handle.output = output
        if on_finish is not None:
            on_finish(output)
        self.handle.push(None)

    def _move(self, to: RequestState) -> None:
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"request {self.request_id} cannot go from {self.state.value} to {to.value}")
        self.state = to


@dataclass(frozen=True)
class Submit:
    """To the engine thread: queue a request."""

    request: Request


@dataclass(frozen=True)
class Cancel:
    """To the engine thread: end a request (if it has not ended)."""

    request_id: int


@dataclass(frozen=True)
class CancelAll:
    """To the engine thread: end every request."""


@dataclass
class EngineWork:
    """To the engine thread: run ``work`` between steps (where nothing else touches the engines); ``done`` is set
    once it ran, with its ``result`` or its ``error``."""

    work: Callable[[], object]
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.work()
        except Exception as error:  # noqa: BLE001 - the caller's to raise, on its own thread
            self.error = error
        self.done.set()


class StepEvent(NamedTuple):
    """From the engine thread, when recording: what a step did to one request, prefilled ``tokens`` of its
    prompt or took it through a round that drafted ``tokens``."""

    kind: str  # "prefill" or "round"
    request_id: int
    tokens: int
