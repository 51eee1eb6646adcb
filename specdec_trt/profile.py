"""A short measured profile of the engines that seeds the cost models before the first round, so that auto's
first plans and the first prefill chunks beside running requests are priced from this machine's timings."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specdec_trt.drafting import MODEL
from specdec_trt.planner import DraftPlanner
from specdec_trt.runtime.engine import Engine

PROFILE_CONTEXT = 32  # cached tokens behind each step the profile times
PROFILE_REPEATS = 2
PROFILED_ROWS = (1, 2, 4, 8)  # the numbers of rows the profile times, up to the most a batch holds


def profile_engines(
    target: Engine, planner: DraftPlanner, max_batch_size: int | None, free_slots: Callable[[int], list[int]]
) -> None:
    """Time, at each of ``PROFILED_ROWS`` rows up to ``max_batch_size`` (in slots from ``free_slots``, left free
    again): the prefill of the profile's context on every model, the target's verify pass without drafts,
    with one and with the longest draft auto may choose a row (recorded in the planner's costs), and the
    planner's draft model's steps for a draft that long (in the model draft's lines)."""
    row_counts = [n for n in PROFILED_ROWS if max_batch_size is None or n <= max_batch_size]
    draft: Engine | None = getattr(planner.drafter, "engine", None)
    costs, draft_lines, max_draft = planner.costs, planner.controllers[MODEL].drafting, planner.max_auto_draft
    models = (target,) if draft is None else (target, draft)
    widths = (1, 2, 1 + max_draft)  # no draft, one, the most: the line of passes with drafts
    cached = min(PROFILE_CONTEXT, min(model.max_context for model in models) - widths[-1] - max_draft)
    if cached < 1:
        return
    for rows in row_counts:
        slots = free_slots(rows)
        context = torch.randint(0, target.vocab_size, (rows, cached))
        for model in models:
            for slot in slots:
                model.admit(slot)
            tick = time.perf_counter()
            model.step(slots, context, logits_from=[cached - 1] * rows)
            if model is target:
                costs.add_pass([0] * rows, [cached] * rows, time.perf_counter() - tick)
        for _ in range(PROFILE_REPEATS):
            for width in widths:
                tick = time.perf_counter()
                target.step(slots, torch.randint(0, target.vocab_size, (rows, width)))
                seconds = time.perf_counter() - tick
                target.truncate(slots, [cached] * rows)
                costs.add_pass([cached] * rows, [width] * rows, seconds, verify_rows=rows)
            if draft is not None:  # a draft of the longest length, one step per token
                tick = time.perf_counter()
                for _ in range(max_draft):
                    draft.step(slots, torch.randint(0, draft.vocab_size, (rows, 1)))
                seconds = time.perf_counter() - tick
                draft.truncate(slots, [cached] * rows)
                draft_lines.add(rows, max_draft, seconds)
        for model in models:
            for slot in slots:
                model.release(slot)
