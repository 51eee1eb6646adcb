"""A short measured profile of the engines that seeds the cost models before the first round, so that auto's
first plans and the first prefill chunks beside running requests are priced from this machine's timings.

The profile is measured once per engine directory and machine, outside any request (``specdec-build`` after a
build, ``specdec-serve`` before it reports ready), and kept beside the engines (``specdec_trt.profile_cache``);
a decoder without one starts from the planner's prior and learns from its own rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from specdec_trt.drafting import MODEL
from specdec_trt.planner import DraftPlanner
from specdec_trt.runtime.engine import Engine

PROFILE_CONTEXT = 32  # cached tokens behind each step the profile times
PROFILE_REPEATS = 2
PROFILED_ROWS = (1, 2, 4, 8)  # the numbers of rows the profile times, up to the most a batch holds


@dataclass(frozen=True)
class PassTiming:
    """A target pass giving row r ``widths[r]`` new tokens after ``cached[r]``, its first ``verify_rows`` rows
    verifying, took ``seconds``."""

    cached: list[int]
    widths: list[int]
    seconds: float
    verify_rows: int = 0


@dataclass(frozen=True)
class DraftTiming:
    """The model draft drafted ``tokens`` tokens in each of ``rows`` rows in ``seconds``."""

    rows: int
    tokens: int
    seconds: float


@dataclass
class EngineProfile:
    """What a profile measured, replayable into any planner of the same engines (``apply``)."""

    rows: list[int] = field(default_factory=list)
    passes: list[PassTiming] = field(default_factory=list)
    drafts: list[DraftTiming] = field(default_factory=list)

    def apply(self, planner: DraftPlanner) -> None:
        """Record every timing in ``planner``'s costs and its model draft's lines."""
        for timing in self.passes:
            planner.costs.add_pass(timing.cached, timing.widths, timing.seconds, timing.verify_rows)
        for timing in self.drafts:
            planner.controllers[MODEL].drafting.add(timing.rows, timing.tokens, timing.seconds)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> EngineProfile:
        return cls(
            list(data["rows"]),
            [PassTiming(**timing) for timing in data["passes"]],
            [DraftTiming(**timing) for timing in data["drafts"]],
        )


def profiled_rows(max_batch_size: int | None) -> list[int]:
    """The numbers of rows a decoder of ``max_batch_size`` slots runs that the profile times."""
    return [n for n in PROFILED_ROWS if max_batch_size is None or n <= max_batch_size]


def measure_engines(
    target: Engine, planner: DraftPlanner, row_counts: Sequence[int], free_slots: Callable[[int], list[int]]
) -> EngineProfile:
    """Time, at each of ``row_counts`` rows (in slots from ``free_slots``, left free again): the prefill of the
    profile's context on every model, the target's verify pass without drafts, with one and with the longest
    draft auto may choose a row, and the planner's draft model's steps for a draft that long."""
    draft: Engine | None = getattr(planner.drafter, "engine", None)
    max_draft = planner.max_auto_draft
    models = (target,) if draft is None else (target, draft)
    widths = (1, 2, 1 + max_draft)  # no draft, one, the most: the line of passes with drafts
    cached = min(PROFILE_CONTEXT, min(model.max_context for model in models) - widths[-1] - max_draft)
    profile = EngineProfile(list(row_counts))
    if cached < 1:
        return profile
    for rows in row_counts:
        slots = free_slots(rows)
        context = torch.randint(0, target.vocab_size, (rows, cached))
        for model in models:
            for slot in slots:
                model.admit(slot)
            tick = time.perf_counter()
            model.step(slots, context, logits_from=[cached - 1] * rows)
            if model is target:
                profile.passes.append(PassTiming([0] * rows, [cached] * rows, time.perf_counter() - tick))
        for _ in range(PROFILE_REPEATS):
            for width in widths:
                tick = time.perf_counter()
                target.step(slots, torch.randint(0, target.vocab_size, (rows, width)))
                seconds = time.perf_counter() - tick
                target.truncate(slots, [cached] * rows)
                profile.passes.append(PassTiming([cached] * rows, [width] * rows, seconds, verify_rows=rows))
            if draft is not None:  # a draft of the longest length, one step per token
                tick = time.perf_counter()
                for _ in range(max_draft):
                    draft.step(slots, torch.randint(0, draft.vocab_size, (rows, 1)))
                seconds = time.perf_counter() - tick
                draft.truncate(slots, [cached] * rows)
                profile.drafts.append(DraftTiming(rows, max_draft, seconds))
        for model in models:
            for slot in slots:
                model.release(slot)
    return profile
