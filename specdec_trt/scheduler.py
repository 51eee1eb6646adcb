"""Continuous batching: requests join and leave a running batch, served by one engine thread.

``Scheduler.submit`` is safe from any thread and returns a ``RequestHandle``. One engine thread owns the
engines (they are not thread-safe). Each step it takes in messages, admits waiting requests (FIFO) into
slots, where ``specdec_trt.prefix_cache`` finds the longest cached prefix of each prompt, takes one prefill
chunk (``specdec_trt.prefill`` sizes it) and runs one speculative round over every decoding request with the
draft lengths ``specdec_trt.planner`` plans; where the target packs a pass's tokens (ONNX Runtime) the chunk
rides in the round's verify pass. An ended request's slot keeps its cache, idle, until a slot is needed.
Every pass's time goes into one ``Costs`` that the prefill policy and the planner read. A request's greedy
output never depends on what it shares the batch with; sampled output keeps the target's exact
distribution, and a seeded request's depends on the request alone (``specdec_trt.seeded_noise``).
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
from transformers import PreTrainedTokenizerBase

from specdec_trt.costs import Costs
from specdec_trt.draft_spec import DraftLength
from specdec_trt.draft_store import STORE_MAX_NGRAM
from specdec_trt.drafting import STORE, Drafter, pad_right
from specdec_trt.planner import DraftPlanner
from specdec_trt.prefill import PrefillPolicy, PrefillQueue, next_chunk
from specdec_trt.prefix_cache import EmptySlot, PrefixCache
from specdec_trt.profile import EngineProfile, measure_engines
from specdec_trt.request import (
    Cancel,
    CancelAll,
    EngineWork,
    GenerationOutput,
    QueueFullError,
    Request,
    RequestHandle,
    RequestState,
    SchedulerClosedError,
    StepEvent,
    Submit,
)
from specdec_trt.runtime.engine import Engine
from specdec_trt.sampling import BatchSampler, SamplingParams, seeded_noise
from specdec_trt.slots import SlotSupply, free_slots
from specdec_trt.speculation import speculative_round

Message = Submit | Cancel | CancelAll | EngineWork
_running: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # schedulers whose engine thread may be running


@atexit.register
def _cancel_at_exit() -> None:
    """At interpreter exit, end every request still in flight, so that no engine thread is cut off mid-step."""
    for scheduler in list(_running):
        scheduler.close(cancel=True)


class Scheduler:
    """Serves requests on a target engine and a drafter with continuous batching (see the module docstring).

    ``max_batch_size``: slots, the most requests decoding at once (None: as many as arrive; the engines' caches
    grow to hold them). ``max_queue``: the most requests waiting for a slot (None: no limit); past it,
    ``submit`` raises ``QueueFullError``. ``prefill``: see ``PrefillPolicy``; ``max_auto_draft`` and
    ``draft_confidence_threshold``: see ``DraftPlanner``; ``prefix_cache``: keep an ended request's keys and
    values for the next request that shares their prefix (``PrefixCache``); ``draft_store``: give an ended
    request's text to the drafter's store of earlier requests' text (``specdec_trt.draft_store``). Requests are
    validated by the caller (``SpeculativeDecoder``) before they are submitted."""

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
        prefill: PrefillPolicy | None = None,
        draft_confidence_threshold: float | None = None,
        prefix_cache: bool = True,
        draft_store: bool = True,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 or None, got {max_queue}")
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.prefill = PrefillPolicy() if prefill is None else prefill
        self.max_context = min(m for m in (target.max_context, drafter and drafter.max_context) if m)
        self.costs = Costs(target.packs_rows)
        self.planner = DraftPlanner(drafter, max_auto_draft, self.max_context, self.costs, draft_confidence_threshold)
        self.prefix_cache = PrefixCache(prefix_cache)
        self.draft_store = draft_store
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._waiting_count = 0  # submitted, not yet admitted nor cancelled (under the lock)
        self._thread: threading.Thread | None = None  # the engine thread, while there is work
        self._closed = False
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did
        # The engine thread's own state:
        self._waiting: deque[Request] = deque()
        self._active: dict[int, Request] = {}  # admitted, by id, in admission order
        self.events: list[StepEvent] | None = None  # when a list, the engine thread records every step in it
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
            if self.error is not None:
                why = f"{type(self.error).__name__}: {self.error}"
                raise SchedulerClosedError(f"the engine stopped after an error ({why}); restart it")
            if self._closed:
                raise SchedulerClosedError("the scheduler is closed")
            if self.max_queue is not None and self._waiting_count + len(requests) > self.max_queue:
                raise QueueFullError(
                    f"{self._waiting_count} requests are waiting for a slot, the most this server queues is "
                    f"{self.max_queue}: retry later"
                )
            handles = []
            for prompt, params, gamma in requests:
                request = Request.create(
                    next(self._ids), prompt, params, gamma, now, self.tokenizer, self.eos_token_ids, self.cancel
                )
                request.noise = seeded_noise(params, self.target.device)
                self._inbox.put(Submit(request))
                handles.append(request.handle)
            self._waiting_count += len(requests)
            self._wake()
        return handles

    def cancel(self, request_id: int) -> None:
        self._inbox.put(Cancel(request_id))

    def reset_prefix_cache(self) -> None:
        """Release the cache of every idle slot and forget the text of ended requests (the draft store), as
        vLLM's ``reset_prefix_cache``: later requests start as on a fresh scheduler. Requests in flight keep
        their slots. Returns once done."""
        self._on_engine_thread(self._reset_prefix_cache)

    def profile(self, row_counts: Sequence[int]) -> EngineProfile:
        """Measure the engines at ``row_counts`` rows (``specdec_trt.profile``) and seed the cost models with the
        timings, which are returned to be kept; only while no request is in flight."""

        def measure() -> EngineProfile:
            if self._active or self._waiting:
                raise RuntimeError("requests are in flight: profile the engines before serving them")
            profile = measure_engines(self.target, self.planner, row_counts, self._slots)
            profile.apply(self.planner)
            return profile

        return self._on_engine_thread(measure)

    def seed(self, profile: EngineProfile) -> None:
        """Seed the cost models with a profile measured earlier on these engines."""
        self._on_engine_thread(lambda: profile.apply(self.planner))

    def _on_engine_thread(self, work: Callable[[], object]):
        """Run ``work`` on the engine thread between steps and return its result (or raise its error)."""
        message = EngineWork(work)
        with self._lock:
            if self.error is not None:
                raise SchedulerClosedError(f"the engine stopped after an error ({type(self.error).__name__})")
            if self._closed:
                raise SchedulerClosedError("the scheduler is closed")
            self._inbox.put(message)
            self._wake()
        message.done.wait()
        if message.error is not None:
            raise message.error
        return message.result

    def _wake(self) -> None:
        """Start the engine thread if none runs (under the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="specdec-engine", daemon=True)
            self._thread.start()
            _running.add(self)

    def close(self, cancel: bool = False) -> None:
        """Stop taking requests, and wait until the requests in flight are finished (``cancel``: cancelled)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if cancel:
                self._inbox.put(CancelAll())
        if thread is not None:
            thread.join()

    # --- the engine thread --------------------------------------------------------------------------------

    def _serve(self) -> None:
        """The engine thread: steps while there is work, and ends when there is none (``submit`` starts it
        again), so an idle decoder holds no thread."""
        try:
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

    def _messages(self) -> Iterator[Message]:
        """Empty the inbox, message by message."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _take_in(self) -> None:
        """Move submissions and cancellations out of the inbox, and run the work sent to this thread."""
        for message in self._messages():
            if isinstance(message, Submit):
                self._waiting.append(message.request)
                continue
            if isinstance(message, EngineWork):
                message.run()
                continue
            held = [*self._active.values(), *self._waiting]
            for request in [r for r in held if isinstance(message, CancelAll) or r.request_id == message.request_id]:
                self._cancel(request)

    def _reset_prefix_cache(self) -> None:
        for slot in self.prefix_cache.clear():
            self.target.release(slot)
            if self.drafter is not None and self.drafter.occupied(slot):
                self.drafter.release(slot)
        if self.drafter is not None:
            self.drafter.forget()

    def _cancel(self, request: Request) -> None:
        """End a request that has not finished: a waiting one leaves the queue at once."""
        if request.state is RequestState.WAITING:
            self._waiting.remove(request)
            with self._lock:
                self._waiting_count -= 1
        request.finish("cancelled")
        self._retire(request)

    def _step(self) -> None:
        decoding = [r for r in self._active.values() if r.decoding]
        cached = next((r.prefilled for r in self._active.values() if r.prefilling), 0)
        waiting = PrefillQueue(len(decoding), self._prompts_to_prefill(), cached)
        budget = self.prefill.budget(self.costs.passes, self.costs.round_s, waiting)
        self._admit(budget)
        prefilling = [r for r in self._active.values() if r.prefilling]
        chunks = next_chunk([r.prompt[r.prefilled :] for r in prefilling], budget, self.target.packs_rows)
        chunk = (prefilling[: len(chunks)], chunks) if chunks else None
        if chunk is not None and decoding and self.target.packs_rows:
            self._round(decoding, chunk)  # the chunk rides in the round's verify pass
            return
        if chunk is not None:
            self._prefill(*chunk)
        decoding = [r for r in self._active.values() if r.decoding]
        if decoding:
            self._round(decoding)

    def _prompts_to_prefill(self) -> int:
        """Prompts still to be prefilled that the next steps will chunk: those admitted and not yet decoding,
        and those waiting that the free slots will admit."""
        admitted = sum(r.prefilling for r in self._active.values())
        free = len(self._waiting) if self.max_batch_size is None else self.max_batch_size - len(self._active)
        return admitted + min(len(self._waiting), max(free, 0))

    def _admit(self, budget: int | None) -> None:
        """Waiting requests into free slots, in order, while the next prefill chunk (``budget`` tokens, None:
        no limit) has room for them."""
        pending = sum(len(r.prompt) - r.prefilled for r in self._active.values() if r.prefilling)
        admitted: list[Request] = []
        while self._waiting and (budget is None or pending < budget):
            if self.max_batch_size is not None and len(self._active) + len(admitted) >= self.max_batch_size:
                break
            admitted.append(self._waiting.popleft())
            pending += len(admitted[-1].prompt)
        if not admitted:
            return
        with self._lock:
            self._waiting_count -= len(admitted)
        for request in admitted:  # before anything that can fail: an error must reach them
            self._active[request.request_id] = request
        now = time.perf_counter()
        self.prefix_cache.forget_unless(lambda slot, n: self.target.occupied(slot) and self.target.length(slot) == n)
        supply = SlotSupply(self.target, self.drafter, self.max_batch_size)
        held: dict[int, list[int]] | None = None  # the busy slots' tokens, read once an admission needs them

        def busy() -> dict[int, list[int]]:
            nonlocal held
            held = self._held_tokens() if held is None else held
            return held

        for i, request in enumerate(admitted):
            cached = self._place(request, now, busy, partial(supply.take, still_to_place=len(admitted) - i))
            if cached and held is not None:
                held[request.slot] = request.prompt[:cached]

    def _place(self, request: Request, now: float, busy: Callable[[], dict], empty_slot: EmptySlot) -> int:
        """Into the slot the prefix cache chooses, with the cached prefix it finds there or copies in; returns
        that prefix's length."""
        place = self.prefix_cache.place(request.prompt, busy, empty_slot)
        slot, cached = place.slot, place.cached
        if not self.target.occupied(slot):
            self.target.admit(slot)
        self.target.truncate([slot], [cached if place.source is None else 0])
        if place.source is not None:
            self.target.copy_from(self.target, slot, cached, place.source)
        if request.drafts and self.drafter is not None:
            self.drafter.admit(slot, request.prompt[:cached], place.source)
        elif self.drafter is not None and self.drafter.occupied(slot):
            self.drafter.release(slot)  # what it followed there is gone from the target
        request.admit(slot, now, cached)
        return cached

    def _held_tokens(self) -> dict[int, list[int]]:
        """The tokens each admitted request's slot holds in the target's cache, for those that hold any."""
        held = {}
        for request in self._active.values():
            if request.slot is not None and (length := self._cached_length(request)):
                held[request.slot] = request.sequence[:length]
        return held

    def _cached_length(self, request: Request) -> int:
        """Tokens of ``request``'s sequence in the target's cache: all but the newest, and none of the drafts of
        its last round that the next round rolls back."""
        return min(self.target.length(request.slot), len(request.sequence) - 1)

    def _slots(self, count: int) -> list[int]:
        return free_slots(self.target, self.drafter, count, self.max_batch_size)

    def _prefill(self, rows: list[Request], chunks: list[Sequence[int]]) -> None:
        """A chunk in a pass of its own."""
        sizes = [len(c) for c in chunks]
        cached = [r.prefilled for r in rows]
        block = torch.tensor(pad_right(chunks))
        start = time.perf_counter()
        logits = self.target.step([r.slot for r in rows], block, sizes, [n - 1 for n in sizes])
        self.costs.add_pass(cached, sizes, time.perf_counter() - start)
        self._prefilled(rows, chunks, logits[:, 0])

    def _prefilled(self, rows: list[Request], chunks: list[Sequence[int]], logits: torch.Tensor) -> None:
        """After the target's pass over a chunk (``logits`` [rows, V] after each row's last token): the
        drafter's share of it, and the first token of each prompt the chunk completes."""
        drafting = [(r.slot, c) for r, c in zip(rows, chunks) if r.drafts and self.drafter is not None]
        tick = time.perf_counter()
        if drafting:
            self.drafter.prefill(*zip(*drafting))
        draft_s = time.perf_counter() - tick
        complete = []
        for i, (request, chunk) in enumerate(zip(rows, chunks)):
            request.stats.draft_prefill_s += draft_s / max(len(drafting), 1) if request.drafts else 0.0
            if request.prefilled_chunk(len(chunk)):
                complete.append(i)
        self._record("prefill", rows, [len(c) for c in chunks])
        if complete:
            done = [rows[i] for i in complete]
            sampler = self._sampler(done)
            first = sampler.draw(logits[complete].to(self.target.device))[0].tolist()
            now = time.perf_counter()
            for request, token in zip(done, first):
                request.stats.prefill_s = now - request.admitted
                self._commit(request, [token])

    def _sampler(self, rows: list[Request]) -> BatchSampler:
        """The rows' sampling parameters and seeded noise, at the position of each row's next token."""
        return BatchSampler(
            [r.params for r in rows], self.target.device, [r.noise for r in rows], [len(r.sequence) for r in rows]
        )

    def _round(self, rows: list[Request], chunk: tuple[list[Request], list[Sequence[int]]] | None = None) -> None:
        """One speculative round over every decoding request, with ``chunk`` riding in its verify pass."""
        slots, sequences = [r.slot for r in rows], [r.sequence for r in rows]
        follows = self.prefill.chunk_follows_rounds(self.target.packs_rows) and self._prompts_to_prefill() > 0
        plan = self.planner.plan(rows, chunk is not None, follows)
        sampler = self._sampler(rows)
        riders = [] if chunk is None else [(r.slot, c) for r, c in zip(*chunk)]
        result = speculative_round(
            self.target, self.drafter, slots, sequences, plan.limits, sampler, plan.draft, riders
        )
        cached = [len(s) - 1 for s in sequences] + [r.prefilled for r in (chunk[0] if chunk else [])]
        widths = [n + 1 for n in result.num_drafted] + [len(c) for _, c in riders]
        result.verify_s = self.costs.add_pass(cached, widths, result.verify_s, verify_rows=len(rows))
        self._record("round", rows, result.num_drafted)
        seconds = result.draft_s + result.verify_s
        self.costs.add_round(seconds)
        if self.on_round is not None:
            self.on_round(seconds, list(result.num_drafted))
        self.planner.observe(rows, plan, result)
        outcomes = zip(rows, plan.draft.parts, result.tokens, result.num_drafted, result.num_accepted)
        for request, part, tokens, drafted, accepted in outcomes:
            request.stats.record_round(drafted, accepted, part is not None and part.kind == STORE)
            request.stats.draft_s += result.draft_s
            request.stats.verify_s += result.verify_s
            self._commit(request, tokens)
        if chunk is not None:
            self._prefilled(*chunk, result.rider_logits)

    def _record(self, kind: str, rows: list[Request], tokens: Sequence[int]) -> None:
        if self.events is not None:
            self.events += [StepEvent(kind, r.request_id, n) for r, n in zip(rows, tokens)]

    def _commit(self, request: Request, tokens: Sequence[int]) -> None:
        """Commit the request's new tokens and push its new text. An error in its own text (decoding its tokens,
        matching its stop strings) ends this request alone, with that error: the batch goes on."""
        try:
            request.extend(tokens)
            request.emit()
        except Exception as error:  # noqa: BLE001 - one request's text must not stop the others
            request.fail(f"{type(error).__name__}: {error}")
        if request.finished:
            self._retire(request)

    def _retire(self, request: Request) -> None:
        """Free the ended request's slot (if it has one) and hand its output to its handle."""
        if self._active.pop(request.request_id, None) is not None and request.slot is not None:
            if self.drafter is not None and self.draft_store:  # what the prefix cache did not hold is new to it
                self.drafter.remember(request.sequence[max(0, request.stats.cached_prompt_tokens - STORE_MAX_NGRAM) :])
            if self.prefix_cache.enabled:
                kept = self._cached_length(request)
                self.target.truncate([request.slot], [kept])
                self.prefix_cache.park(request.slot, request.sequence[:kept])
            else:
                self.target.release(request.slot)
                if request.drafts and self.drafter is not None:
                    self.drafter.release(request.slot)
        request.complete(time.perf_counter(), self.on_finish)

    def _fail_all(self, message: str) -> None:
        """After an engine error: every request still waiting or running ends with it."""
        for pending in self._messages():
            if isinstance(pending, Submit):
                self._waiting.append(pending.request)
            elif isinstance(pending, EngineWork):
                pending.error = SchedulerClosedError(f"the engine stopped after an error ({message})")
                pending.done.set()
        for request in list(self._active.values()) + list(self._waiting):
            if not request.finished:
                request.finish("error", message)
            request.complete(time.perf_counter(), self.on_finish)
        self._active.clear()
        self._waiting.clear()
