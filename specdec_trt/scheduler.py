"""Continuous batching: requests join and leave a running batch, served by one engine thread.

``Scheduler.submit`` is safe from any thread and returns a ``RequestHandle`` to iterate for text deltas
(``for``, or ``async for`` on an event loop), cancel, or wait on. One engine thread owns the engines (they are
not thread-safe, and ONNX Runtime's thread pool is process-wide). Each step of it:

1. takes in submissions and cancellations, and admits waiting requests into free slots (FIFO);
2. takes one chunk over the requests being admitted: up to ``prefill_chunk`` prompt tokens, fewer where a
   chunk that long would take longer than ``prefill_chunk_rounds`` rounds (timed as they run, never under
   ``MIN_PREFILL_CHUNK``), so that while a long prompt is prefilled the running requests' tokens come about
   ``prefill_chunk_rounds + 1`` times further apart than a round (more while more prompts wait for their
   first token than requests decode), never after its whole prefill (with no request decoding there is
   nobody to delay, and every admitted prompt is prefilled at once);
3. runs one speculative round over every decoding request, each with its own draft length: a fixed
   ``num_draft_tokens``, 0, or "auto", planned row by row for the most tokens per second of the whole batch
   from each request's own acceptance and a cost model fitted per number of rows (a request whose drafts do
   not pay for themselves beside the others' tokens drafts none, and now and then some to be measured again).
   Where the target packs a pass's tokens (ONNX Runtime) the chunk rides in the round's verify pass;
   elsewhere it is a pass of its own before it;
4. emits text deltas, and releases finished requests' slots at once.

A request's greedy output never depends on what it shares the batch with, and sampled output keeps the
target's exact distribution with each request's own generator.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedTokenizerBase

from specdec_trt.drafting import LOOKUP, MODEL, Drafter, StopRule, confidence_below, pad_right
from specdec_trt.pass_cost import PassCost
from specdec_trt.runtime.engine import Engine
from specdec_trt.sampling import BatchSampler, SamplingParams, new_generator
from specdec_trt.schedule import TIME_DECAY, AcceptanceEvidence, DraftLengthController, PassContext
from specdec_trt.speculation import speculative_round
from specdec_trt.stats import GenerationStats
from specdec_trt.text import TextTracker

AUTO = "auto"
DraftLength = int | str  # a number of drafts per round, or AUTO
DEFAULT_PREFILL_CHUNK = 256  # the most prompt tokens prefilled per engine step, over the requests being admitted
MIN_PREFILL_CHUNK = 16  # the fewest, however slow a prefill is next to a round
DEFAULT_PREFILL_CHUNK_ROUNDS = 1.0  # the most rounds' time a prefill chunk beside decoding requests may take
FIRST_SLOTS = 8  # slots reserved at first when the number of slots is not bounded (it doubles as needed)
PROFILE_CONTEXT = 32  # cached tokens behind each step the start-up profile times
PROFILE_REPEATS = 2
FINISH_REASONS = ("stop", "length", "cancelled", "error")


_running: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # schedulers whose engine thread may be running


@atexit.register
def _cancel_at_exit() -> None:
    """At interpreter exit, end every request still in flight, so that no engine thread is cut off mid-step."""
    for scheduler in list(_running):
        scheduler.close(cancel=True)


class QueueFullError(RuntimeError):
    """The waiting queue is full: try again later (HTTP 429)."""


class SchedulerClosedError(RuntimeError):
    """The scheduler was closed, or stopped after an engine error, and takes no more requests."""


class GenerationError(RuntimeError):
    """A request ended with an engine error."""


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

    def __init__(self, request_id: int, scheduler: Scheduler) -> None:
        self.request_id = request_id
        self._scheduler = scheduler
        self._pieces: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # None: the request has ended
        self._done = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.output: GenerationOutput | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating: the request ends with finish reason "cancelled" and frees its slot."""
        self._scheduler.cancel(self.request_id)

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

    def _push(self, piece: str | None) -> None:
        """From the engine thread: a text piece, or None once the request has ended."""
        self._pieces.put(piece)
        if piece is None:
            self._done.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)


@dataclass
class _Request:
    """The engine thread's state of one request."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    num_draft_tokens: DraftLength
    tracker: TextTracker
    eos: frozenset[int]
    handle: RequestHandle
    submitted: float
    generator: torch.Generator | None = None
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

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt) and self.finish_reason is None

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.generated)

    @property
    def drafts(self) -> bool:
        """Whether the request ever drafts (its drafter follows its slot)."""
        return self.num_draft_tokens != 0

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit tokens in order until one ends the request (EOS, a stop string, max_new_tokens)."""
        for token in tokens:
            if self.finish_reason is not None:
                return
            self.generated.append(token)
            self.sequence.append(token)
            if token in self.eos or self.tracker.add(token):
                self.finish_reason = "stop"
            elif self.remaining == 0:
                self.finish_reason = "length"

    def output(self) -> GenerationOutput:
        self.stats.generated_tokens = len(self.generated)
        return GenerationOutput(self.tracker.text, list(self.generated), self.finish_reason, self.stats, self.error)


class Scheduler:
    """Serves requests on a target engine and a drafter with continuous batching (see the module docstring).

    ``max_batch_size``: slots, the most requests decoding at once (None: as many as arrive; the engines' caches
    grow to hold them). ``max_queue``: the most requests waiting for a slot (None: no limit); past it,
    ``submit`` raises ``QueueFullError``. ``prefill_chunk_rounds``: the most rounds' time a prefill chunk
    beside decoding requests may take (None: no bound, chunks of ``prefill_chunk`` tokens: fewer passes, so
    more tokens/s under load, and longer stalls of the running streams while a prompt is prefilled).
    ``max_auto_draft``: the longest draft "auto" may choose. ``draft_confidence_threshold``: a fixed cut-off
    for auto's model drafts instead of its cost-aware stop.
    Requests are validated by the caller (``SpeculativeDecoder``) before they are submitted."""

    def __init__(
        self,
        target: Engine,
        drafter: Drafter | None,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: frozenset[int],
        max_auto_draft: int,
        *,
        max_batch_size: int | None = None,
        max_queue: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefill_chunk_rounds: float | None = DEFAULT_PREFILL_CHUNK_ROUNDS,
        draft_confidence_threshold: float | None = None,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 or None, got {max_queue}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_chunk_rounds is not None and not prefill_chunk_rounds > 0:
            raise ValueError(f"prefill_chunk_rounds must be > 0 or None, got {prefill_chunk_rounds}")
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_batch_size, self.max_queue, self.prefill_chunk = max_batch_size, max_queue, prefill_chunk
        self.prefill_chunk_rounds = prefill_chunk_rounds
        self.max_auto_draft = max_auto_draft
        self.draft_confidence_threshold = draft_confidence_threshold
        self.max_context = min(m for m in (target.max_context, drafter and drafter.max_context) if m)
        self.controllers = {part: DraftLengthController(max_auto_draft) for part in (MODEL, LOOKUP)}
        self._pass_cost = PassCost(TIME_DECAY, target.packs_rows)  # the target's passes, every one
        self._round_s: float | None = None  # decayed mean seconds of a round
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._waiting_count = 0  # submitted, not yet admitted (under the lock)
        self._thread: threading.Thread | None = None  # the engine thread, while there is work
        self._profiled = False
        self._closed = False
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did
        # The engine thread's own state:
        self._waiting: deque[_Request] = deque()
        self._active: dict[int, _Request] = {}  # admitted, by id, in admission order
        self._by_id: dict[int, _Request] = {}
        self.events: list[tuple[str, int]] | None = None  # when a list: ("prefill" | "round", id) per step
        # Called from the engine thread after each round: its seconds, and the drafts of each row.
        self.on_round: Callable[[float, list[int]], None] | None = None
        # Called from the engine thread as each request ends, before its handle hears of it.
        self.on_finish: Callable[[GenerationOutput], None] | None = None

    # --- any thread ---------------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._waiting_count

    @property
    def num_running(self) -> int:
        return len(self._active)

    def submit(self, requests: Sequence[tuple[list[int], SamplingParams, DraftLength]]) -> list[RequestHandle]:
        """Queue requests (prompt token ids, sampling parameters, draft length), all at once or none: past
        ``max_queue`` waiting requests this raises ``QueueFullError``."""
        now = time.perf_counter()
        with self._lock:
            if self._closed or self.error is not None:
                raise SchedulerClosedError(self._closed_message())
            if self.max_queue is not None and self._waiting_count + len(requests) > self.max_queue:
                raise QueueFullError(
                    f"{self._waiting_count} requests are waiting for a slot, the most this server queues is "
                    f"{self.max_queue}: retry later"
                )
            handles = []
            for prompt, params, gamma in requests:
                request_id = next(self._ids)
                handle = RequestHandle(request_id, self)
                tracker = TextTracker(self.tokenizer, params.stop)
                eos = frozenset() if params.ignore_eos else self.eos_token_ids
                request = _Request(request_id, list(prompt), params, gamma, tracker, eos, handle, now)
                request.generator = new_generator(params, self.target.device)
                self._inbox.put(("submit", request))
                handles.append(handle)
            self._waiting_count += len(requests)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="specdec-engine", daemon=True)
                self._thread.start()
                _running.add(self)
        return handles

    def cancel(self, request_id: int) -> None:
        self._inbox.put(("cancel", request_id))

    def close(self, cancel: bool = False) -> None:
        """Stop taking requests, and wait until the requests in flight are finished (``cancel``: cancelled)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if cancel:
                self._inbox.put(("cancel all",))
        if thread is not None:
            thread.join()

    def _closed_message(self) -> str:
        if self.error is not None:
            return f"the engine stopped after an error ({type(self.error).__name__}: {self.error}); restart it"
        return "the scheduler is closed"

    # --- the engine thread --------------------------------------------------------------------------------

    def _serve(self) -> None:
        """The engine thread: steps while there is work, and ends when there is none (``submit`` starts it
        again), so an idle decoder holds no thread."""
        try:
            if self.drafter is not None and not self._profiled:
                self._profile()
                self._profiled = True
            while True:
                self._take_in()
                if not self._waiting and not self._active:
                    with self._lock:  # submit starts a new thread only after this one is gone
                        if self._inbox.empty():
                            self._thread = None
                            return
                    continue
                self._step()
        except BaseException as error:  # noqa: BLE001 - every request must hear of it, whatever it is
            with self._lock:
                self.error = error
                self._thread = None
            self._fail_all(f"{type(error).__name__}: {error}")

    def _take_in(self) -> None:
        """Move submissions and cancellations out of the inbox."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "submit":
                self._waiting.append(message[1])
                self._by_id[message[1].request_id] = message[1]
            else:
                ids = [message[1]] if message[0] == "cancel" else list(self._by_id)
                for request in [self._by_id[i] for i in ids if i in self._by_id]:
                    if request.finish_reason is None:
                        request.finish_reason = "cancelled"
                        self._finish(request)

    def _step(self) -> None:
        budget = self._chunk_budget() if any(r.decoding for r in self._active.values()) else None
        self._admit(budget)
        prefilling = [r for r in self._active.values() if not r.decoding and r.finish_reason is None]
        chunk = self._chunk(prefilling, budget) if prefilling else None
        decoding = [r for r in self._active.values() if r.decoding]
        if chunk is not None and decoding and self.target.packs_rows:
            self._round(decoding, chunk)  # the chunk rides in the round's verify pass
            return
        if chunk is not None:
            self._prefill(*chunk)
        decoding = [r for r in self._active.values() if r.decoding]
        if decoding:
            self._round(decoding)

    def _chunk_budget(self) -> int:
        """Prompt tokens of the next prefill chunk beside decoding requests: as many as take about
        ``prefill_chunk_rounds`` rounds' time, times the prompts waiting for their first token per decoding
        request where they are more (each chunk holds up every decoding stream, each round every prompt behind
        it: a burst of prompts beside one stream is not prefilled a sliver at a time). Timed from the passes
        and rounds so far, at the context the oldest prompt being prefilled has reached, in the round's own
        pass where the target packs rows (what the chunk adds to it) or in a pass of its own; between
        ``MIN_PREFILL_CHUNK`` and ``prefill_chunk``. Each pass of its own rereads the weights, so a chunk much
        shorter than that would spend most of its time on the pass's fixed cost."""
        if self.prefill_chunk_rounds is None or self._round_s is None:
            return self.prefill_chunk
        decoding = sum(r.decoding for r in self._active.values())
        share = max(1.0, self._prompts_to_prefill() / max(decoding, 1))
        cached = next((r.prefilled for r in self._active.values() if not r.decoding), 0)
        seconds = self.prefill_chunk_rounds * self._round_s * share
        fitting = self._pass_cost.longest_chunk(cached, seconds, max(decoding, 1) if self.target.packs_rows else 0)
        return self.prefill_chunk if fitting is None else min(self.prefill_chunk, max(MIN_PREFILL_CHUNK, fitting))

    def _prompts_to_prefill(self) -> int:
        """Prompts still to be prefilled that the next steps will chunk: those admitted and not yet decoding,
        and those waiting that the free slots will admit."""
        admitted = sum(not r.decoding for r in self._active.values())
        free = len(self._waiting) if self.max_batch_size is None else self.max_batch_size - len(self._active)
        return admitted + min(len(self._waiting), max(free, 0))

    def _admit(self, budget: int | None) -> None:
        """Waiting requests into free slots, in order, while the next prefill chunk (``budget`` tokens, None:
        no limit) has room for them."""
        pending = sum(len(r.prompt) - r.prefilled for r in self._active.values() if not r.decoding)
        admitted: list[_Request] = []
        while self._waiting and (budget is None or pending < budget):
            if self.max_batch_size is not None and len(self._active) + len(admitted) >= self.max_batch_size:
                break
            request = self._waiting.popleft()
            with self._lock:
                self._waiting_count -= 1
            if request.finish_reason is not None:  # cancelled while waiting
                continue
            admitted.append(request)
            pending += len(request.prompt)
        if not admitted:
            return
        for request in admitted:  # before anything that can fail: an error must reach them
            self._active[request.request_id] = request
        now = time.perf_counter()
        for request, slot in zip(admitted, self._free_slots(len(admitted))):  # one search for the whole batch
            request.slot = slot
            self.target.admit(slot)
            if request.drafts and self.drafter is not None:
                self.drafter.admit(slot)
            request.admitted = now
            request.stats.prompt_tokens = len(request.prompt)
            request.stats.queue_s = now - request.submitted

    def _free_slots(self, count: int) -> list[int]:
        """The lowest ``count`` slots free in the target and the drafter (a slot that a direct use of the engines
        left occupied is skipped); the engines' caches grow, up to ``max_batch_size`` where they can, when
        too few are free. The drafter is grown to the target's slots first: another scheduler sharing the
        target may have grown it alone."""
        if self.drafter is not None:
            self.drafter.reserve(self.target.num_slots)
        while True:
            free = [
                slot
                for slot in range(self.target.num_slots)
                if not self.target.occupied(slot) and not (self.drafter and self.drafter.occupied(slot))
            ]
            if len(free) >= count:
                return free[:count]
            wanted = max(FIRST_SLOTS, 2 * self.target.num_slots)
            limit = self.max_batch_size or wanted
            self._reserve(max(self.target.num_slots + count - len(free), min(wanted, limit)))

    def _reserve(self, size: int) -> None:
        self.target.reserve(size)
        if self.drafter is not None:
            self.drafter.reserve(size)

    def _chunk(self, prefilling: list[_Request], budget: int | None) -> tuple[list[_Request], list[list[int]]]:
        """The next chunk: up to ``budget`` prompt tokens (None: all) over the requests being admitted, for one
        pass. A pass that pads its rows pads every row to the longest chunk, so there rows join it only while
        padding stays under half the work; the others wait for the next step."""
        rows, chunks = [], []
        longest = total = 0  # of the chunks taken so far
        for request in prefilling:
            if budget == 0:
                break
            chunk = request.prompt[request.prefilled :][:budget]
            widest = max(longest, len(chunk))
            if chunks and not self.target.packs_rows and (len(chunks) + 1) * widest > 2 * (total + len(chunk)):
                break
            rows.append(request)
            chunks.append(chunk)
            longest, total = widest, total + len(chunk)
            budget = None if budget is None else budget - len(chunk)
        return rows, chunks

    def _prefill(self, rows: list[_Request], chunks: list[list[int]]) -> None:
        """A chunk in a pass of its own."""
        sizes = [len(c) for c in chunks]
        cached = [r.prefilled for r in rows]
        block = torch.tensor(pad_right(chunks))
        start = time.perf_counter()
        logits = self.target.step([r.slot for r in rows], block, sizes, [n - 1 for n in sizes])
        self._pass_cost.add(cached, sizes, time.perf_counter() - start)
        self._prefilled(rows, chunks, logits[:, 0])

    def _prefilled(self, rows: list[_Request], chunks: list[list[int]], logits: torch.Tensor) -> None:
        """After the target's pass over a chunk (``logits`` [rows, V] after each row's last token): the
        drafter's share of it, and the first token of each prompt the chunk completes."""
        drafting = [(r.slot, c) for r, c in zip(rows, chunks) if r.drafts and self.drafter is not None]
        tick = time.perf_counter()
        if drafting:
            self.drafter.prefill(*zip(*drafting))
        draft_s = time.perf_counter() - tick
        complete = []
        for i, (request, chunk) in enumerate(zip(rows, chunks)):
            request.prefilled += len(chunk)
            request.stats.draft_prefill_s += draft_s / max(len(drafting), 1) if request.drafts else 0.0
            if request.prefilled == len(request.prompt):
                complete.append(i)
        if self.events is not None:
            self.events += [("prefill", r.request_id) for r in rows]
        if complete:
            done = [rows[i] for i in complete]
            sampler = BatchSampler([r.params for r in done], self.target.device, [r.generator for r in done])
            first = sampler.draw(logits[complete].to(self.target.device))[0].tolist()
            now = time.perf_counter()
            for request, token in zip(done, first):
                request.stats.prefill_s = now - request.admitted
                request.extend([token])
                self._emit(request)

    def _round(self, rows: list[_Request], chunk: tuple[list[_Request], list[list[int]]] | None = None) -> None:
        """One speculative round over every decoding request, with ``chunk`` riding in its verify pass."""
        slots, sequences = [r.slot for r in rows], [r.sequence for r in rows]
        # A pass pads every row to the widest: the row with the least room left bounds the drafts.
        room = min(self.max_context - len(s) for s in sequences)
        limits = [0 if r.num_draft_tokens == AUTO else min(r.num_draft_tokens, r.remaining - 1, room) for r in rows]
        auto = [i for i, r in enumerate(rows) if r.num_draft_tokens == AUTO]
        parts = dict(zip(auto, self.drafter.parts([sequences[i] for i in auto]))) if auto else {}
        stop_rules = self._plan_auto(rows, auto, parts, limits, room, chunk is not None) if auto else {}
        sampler = BatchSampler([r.params for r in rows], self.target.device, [r.generator for r in rows])
        riders = [] if chunk is None else [(r.slot, c) for r, c in zip(*chunk)]
        cached = [len(s) - 1 for s in sequences] + [r.prefilled for r in (chunk[0] if chunk else [])]
        result = speculative_round(
            self.target, self.drafter, slots, sequences, limits, sampler, stop_rules or None, riders
        )
        widths = [n + 1 for n in result.num_drafted] + [len(c) for _, c in riders]
        self._pass_cost.add(cached, widths, result.verify_s)
        if chunk is not None:  # the round's own share of the pass: what the chunk added is the prefill's
            added = self._pass_cost.added_seconds(cached, widths, len(riders))
            result.verify_s = max(result.verify_s - added, 0.0)
        if self.events is not None:
            self.events += [("round", r.request_id) for r in rows]
        seconds = result.draft_s + result.verify_s
        self._round_s = seconds if self._round_s is None else TIME_DECAY * self._round_s + (1 - TIME_DECAY) * seconds
        if self.on_round is not None:
            self.on_round(seconds, list(result.num_drafted))
        self._observe(rows, auto, parts, result, chunk is not None)
        for request, tokens, drafted, accepted in zip(rows, result.tokens, result.num_drafted, result.num_accepted):
            request.stats.record_round(drafted, accepted)
            request.stats.draft_s += result.draft_s
            request.stats.verify_s += result.verify_s
            request.extend(tokens)
            self._emit(request)
        if chunk is not None:
            self._prefilled(*chunk, result.rider_logits)

    def _round_fixed_s(self) -> float:
        """Seconds each round costs beyond its draft and verify passes, whatever it drafts: where chunks run in
        passes of their own, while a prompt is being prefilled in chunks of a round's time (or waits for a free
        slot), the fixed cost of the chunk's pass that follows it. Fewer, fuller rounds pay it fewer times."""
        chunked = self.prefill_chunk_rounds is not None and self._prompts_to_prefill() > 0
        return float(self._pass_cost.coefficients()[0]) if chunked and not self.target.packs_rows else 0.0

    def _plan_auto(
        self,
        rows: list[_Request],
        auto: list[int],
        parts: dict[int, str],
        limits: list[int],
        room: int,
        chunk: bool,
    ) -> dict[str, StopRule]:
        """Fill in ``limits`` for the auto rows, kind of draft by kind of draft, each planned into the pass as
        the others leave it: prompt lookup first (its drafts cost nearly nothing to make), then the model's
        rows around the width lookup's take (``chunk``: a prefill chunk rides in the pass). The stop rules of
        the kinds that draft."""
        fixed_slots = [r.slot for r, k in zip(rows, limits) if k > 0]
        members = {part: [i for i in auto if parts[i] == part] for part in (LOOKUP, MODEL)}
        planned_tokens = float(len(rows) - len(auto))  # the other rows' own tokens, at least
        unplanned = len(auto)
        fixed_s = self._round_fixed_s()
        stop_rules: dict[str, StopRule] = {}
        for part, indices in members.items():
            if not indices:
                continue
            controller = self.controllers[part]
            evidence = [rows[i].evidence.setdefault(part, controller.evidence()) for i in indices]
            unplanned -= len(indices)  # the rows of kinds planned later count their own token
            context = self._pass(limits, planned_tokens + unplanned, fixed_s, chunk)
            needed = max(rows[i].remaining - 1 for i in indices)
            tokens = controller.row_tokens(evidence)
            lengths = controller.plan(evidence, min(needed, room), context, tokens)
            for i, length in zip(indices, lengths):
                limits[i] = min(length, rows[i].remaining - 1, room)
            drafting = [n for n, i in enumerate(indices) if limits[i] > 0]
            planned_tokens += float(sum(tokens[n, limits[i]] for n, i in enumerate(indices)))
            if drafting:
                slots = [rows[indices[n]].slot for n in drafting]
                stop_context = replace(context, tokens=context.tokens + len(indices) - len(drafting))
                rule = self._stop_rule(
                    controller, part, slots, [evidence[n] for n in drafting], stop_context, fixed_slots
                )
                if rule is not None:
                    stop_rules[part] = rule
        return stop_rules

    def _pass(
        self, drafts: Sequence[int], tokens: float = 0.0, fixed_s: float = 0.0, chunk: bool = False
    ) -> PassContext:
        """The verify pass of rows drafting ``drafts``, as the target computes it (packed or padded)."""
        packed = self.target.packs_rows
        return PassContext(len(drafts), tokens, max(drafts, default=0), fixed_s, sum(drafts), packed, chunk)

    def _stop_rule(
        self,
        controller: DraftLengthController,
        part: str,
        slots: list[int],
        evidence: list[AcceptanceEvidence],
        context: PassContext,
        fixed_slots: list[int],
    ) -> StopRule | None:
        """Auto's cost-aware stop, or the fixed confidence cut-off for a model draft (a probability threshold
        means nothing for prompt lookup's rounds, which then draft the chosen length); rows with a fixed draft
        length keep a round going while they draft."""
        if self.draft_confidence_threshold is None:
            return controller.stop_rule(slots, evidence, context, fixed_slots, controller.best_rate)
        return None if part == LOOKUP else confidence_below(self.draft_confidence_threshold, fixed_slots)

    def _observe(self, rows: list[_Request], auto: list[int], parts: dict[int, str], result, chunk: bool) -> None:
        """Feed each kind of draft's controller its rows' drafts, acceptances, confidences and the round's
        times (``chunk``: a prefill chunk rode in its verify pass). The round's drafting seconds are a kind's
        when no other row drafted, except that the model's rows take them beside prompt lookup's, whose search
        on the host is small next to a model step."""
        confidence = None if result.confidence is None else result.confidence.get().numpy()
        width = float(self._pass(result.num_drafted).drafts_per_row(0, 0))
        for part, controller in self.controllers.items():
            members = [i for i in auto if parts[i] == part]
            if not members:
                continue
            besides = {i for i in auto if part == MODEL and parts[i] == LOOKUP} | set(members)
            alone = not any(n and i not in besides for i, n in enumerate(result.num_drafted))
            controller.observe(
                [result.num_drafted[i] for i in members],
                [result.num_accepted[i] for i in members],
                [rows[i].evidence[part] for i in members],
                result.draft_s if alone else None,
                result.verify_s,
                None if confidence is None else confidence[members],
                pass_rows=len(rows),
                pass_width=width,
                chunk=chunk,
            )

    def _emit(self, request: _Request) -> None:
        """Push the request's new stable text; release and complete it if it has ended."""
        text = request.tracker.stable_text(request.finish_reason is not None)
        if len(text) > request.shown:
            request.handle._push(text[request.shown :])
            request.shown = len(text)
        if request.finish_reason is not None:
            self._finish(request)

    def _finish(self, request: _Request) -> None:
        """Free the request's slot (if it has one) and hand its output to its handle."""
        if self._active.pop(request.request_id, None) is not None and request.slot is not None:
            self.target.release(request.slot)
            if request.drafts and self.drafter is not None:
                self.drafter.release(request.slot)
        self._by_id.pop(request.request_id, None)
        self._complete(request)

    def _complete(self, request: _Request) -> None:
        """Hand the ended request's output to ``on_finish`` and to its handle."""
        request.stats.total_s = time.perf_counter() - request.submitted
        request.handle.output = request.output()
        if self.on_finish is not None:
            self.on_finish(request.handle.output)
        request.handle._push(None)

    def _fail_all(self, message: str) -> None:
        """After an engine error: every request still waiting or running ends with it."""
        while True:
            try:
                message_ = self._inbox.get_nowait()
            except queue.Empty:
                break
            if message_[0] == "submit":
                self._waiting.append(message_[1])
        for request in list(self._active.values()) + list(self._waiting):
            if request.finish_reason is None:
                request.finish_reason, request.error = "error", message
            self._complete(request)
        self._active.clear()
        self._waiting.clear()

    def _profile(self) -> None:
        """Seed the cost models with a short measured profile at a few numbers of rows: the target's verify
        pass without drafts, with one and with the most a row, and the draft's steps (auto's lines); every target
        pass, the prefill of the profile's context too (the pass cost that sizes prefill chunks)."""
        engine = getattr(self.drafter, "engine", None)
        models = (self.target,) if engine is None else (self.target, engine)
        sizes = [n for n in (1, 2, 4, 8) if self.max_batch_size is None or n <= self.max_batch_size]
        widths = (1, 2, 1 + self.max_auto_draft)  # no draft, one, the most: the line of passes with drafts
        cached = min(PROFILE_CONTEXT, self.max_context - widths[-1] - self.max_auto_draft)
        if cached < 1:
            return
        for rows in sizes:
            slots = self._free_slots(rows)
            context = torch.randint(0, self.target.vocab_size, (rows, cached))
            for model in models:
                for slot in slots:
                    model.admit(slot)
                tick = time.perf_counter()
                model.step(slots, context, logits_from=[cached - 1] * rows)
                if model is self.target:
                    self._pass_cost.add([0] * rows, [cached] * rows, time.perf_counter() - tick)
            for _ in range(PROFILE_REPEATS):
                for width in widths:
                    tick = time.perf_counter()
                    self.target.step(slots, torch.randint(0, self.target.vocab_size, (rows, width)))
                    seconds = time.perf_counter() - tick
                    self.target.truncate(slots, [cached] * rows)
                    self._pass_cost.add([cached] * rows, [width] * rows, seconds)
                    self.controllers[MODEL].costs.add_verify(rows, width - 1, seconds)
                    self.controllers[LOOKUP].costs.add_verify(rows, width - 1, seconds)
                if engine is not None:  # a draft of the longest length, one step per token
                    tick = time.perf_counter()
                    for _ in range(self.max_auto_draft):
                        engine.step(slots, torch.randint(0, engine.vocab_size, (rows, 1)))
                    seconds = time.perf_counter() - tick
                    engine.truncate(slots, [cached] * rows)
                    self.controllers[MODEL].costs.add_draft(rows, self.max_auto_draft, seconds)
            for model in models:
                for slot in slots:
                    model.release(slot)
