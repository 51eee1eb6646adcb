"""Timing single engine steps in isolation: what a pass of a given width costs after a given context."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from specdec_trt.runtime.engine import Engine


def step_seconds(engine: Engine, context: int, new_tokens: int, repeats: int = 20, rows: int = 1) -> float:
    """Median seconds of one forward of ``new_tokens`` random tokens per row after ``context`` cached random
    tokens, for a batch of ``rows``; the cache is truncated back to ``context`` after each."""
    return step_seconds_by_width(engine, context, [new_tokens], repeats, rows)[new_tokens]


def step_seconds_by_width(
    engine: Engine, context: int, widths: Sequence[int], repeats: int = 20, rows: int = 1
) -> dict[int, float]:
    """``step_seconds`` for each of ``widths``, timed in turn within every repeat so that a burst of load on a
    shared machine hits every width alike."""
    engine.prefill(torch.randint(0, engine.vocab_size, (rows, context)), torch.full((rows,), context))
    samples: dict[int, list[float]] = {width: [] for width in widths}
    for _ in range(repeats):
        for width in widths:
            tokens = torch.randint(0, engine.vocab_size, (rows, width))
            start = time.perf_counter()
            engine.forward(tokens)
            samples[width].append(time.perf_counter() - start)
            engine.truncate_all(context)
    return {width: statistics.median(times) for width, times in samples.items()}
