"""Load generation for serving benchmarks: closed-loop clients, Poisson arrivals, and the latency figures of
what they saw.

A closed-loop client sends a request, reads its stream to the end, and sends the next; ``concurrency``
clients do so at once until the requests run out. Open-loop arrivals come at a Poisson rate instead, whatever
the server's backlog, as a service's users do. Each request records when it was sent, when each streamed
piece arrived and how many tokens it produced, so time to first token, inter-token latency (the gap between
successive pieces, as vLLM's serving benchmark counts it) and end-to-end latency come from the client's side.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTiming:
    """What one client saw of one request."""

    sent: float
    arrivals: list[float] = field(default_factory=list)  # when each streamed piece arrived
    tokens: int = 0  # tokens the request produced (from its usage or stats, not from the pieces)
    ok: bool = True

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return list(np.diff(self.arrivals))

    @property
    def latency(self) -> float:
        return self.arrivals[-1] - self.sent


def timed(pieces: Iterable[object]) -> tuple[RequestTiming, list[object]]:
    """Read a stream to its end, stamping each piece's arrival; the timing starts now."""
    timing = RequestTiming(time.perf_counter())
    received = []
    for piece in pieces:
        timing.arrivals.append(time.perf_counter())
        received.append(piece)
    return timing, received


class _Outcomes:
    """The timings of a load's requests, in request order, and the errors their sends raised."""

    def __init__(self, count: int) -> None:
        self.timings: list[RequestTiming | None] = [None] * count
        self.errors: list[BaseException] = []

    def send(self, send: Callable[[object], RequestTiming], requests: Sequence[object], index: int) -> bool:
        """Send request ``index``; whether it succeeded (a failure is reported once every thread ends)."""
        try:
            self.timings[index] = send(requests[index])
            return True
        except BaseException as error:  # noqa: BLE001 - raised by ``gathered``
            self.errors.append(error)
            return False

    def gathered(self, threads: list[threading.Thread], start: float) -> tuple[list[RequestTiming], float]:
        """Wait for ``threads``; the timings and the seconds since ``start``, or the first error."""
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
        if self.errors:
            raise self.errors[0]
        return [t for t in self.timings if t is not None], wall


def closed_loop(
    send: Callable[[object], RequestTiming], requests: Sequence[object], concurrency: int
) -> tuple[list[RequestTiming], float]:
    """Serve ``requests`` with ``concurrency`` closed-loop clients calling ``send``; the timings (in request
    order) and the wall-clock seconds from the first send to the last answer."""
    outcomes = _Outcomes(len(requests))
    pending: Iterator[int] = iter(range(len(requests)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                index = next(pending, None)
            if index is None or not outcomes.send(send, requests, index):
                return

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    return outcomes.gathered(threads, start)


def open_loop(
    send: Callable[[object], RequestTiming], requests: Sequence[object], rate: float, seed: int = 0
) -> tuple[list[RequestTiming], float]:
    """Send ``requests`` as Poisson arrivals at ``rate`` per second (exponential gaps, seeded), each in its own
    thread whatever the server's backlog; the timings (in request order) and the wall-clock seconds from the
    first send to the last answer."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, len(requests))
    outcomes = _Outcomes(len(requests))
    start = time.perf_counter()
    threads = []
    for index, gap in enumerate(gaps):
        if index:
            time.sleep(float(gap))
        threads.append(threading.Thread(target=outcomes.send, args=(send, requests, index)))
        threads[-1].start()
    return outcomes.gathered(threads, start)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50 and p99 in milliseconds (None without values)."""
    if not len(values):
        return {"p50_ms": None, "p99_ms": None}
    p50, p99 = np.percentile(np.asarray(values, dtype=float), [50, 99])
    return {"p50_ms": round(1e3 * float(p50), 2), "p99_ms": round(1e3 * float(p99), 2)}


def load_summary(timings: Sequence[RequestTiming], wall: float) -> dict:
    """Total output tokens per second over the wall time, and time to first token, inter-token and
    end-to-end latency percentiles over the requests that completed."""
    done = [t for t in timings if t.ok and t.arrivals]
    tokens = sum(t.tokens for t in done)
    return {
        "requests": len(timings),
        "completed": len(done),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
        "ttft": percentiles([t.ttft for t in done]),
        "itl": percentiles([gap for t in done for gap in t.gaps]),
        "e2e": percentiles([t.latency for t in done]),
    }


def median_run(repeats: Sequence[dict]) -> dict:
    """Of one method's ``load_summary`` repeats, the one with the median tokens/s (of an even count, the upper
    middle one), with the median itself under "tokens_per_s_median" and every repeat under "repeats": one
    figure per method that a noisy repeat cannot move alone."""
    median = sorted(repeats, key=lambda r: r["tokens_per_s"])[len(repeats) // 2]
    rates = [r["tokens_per_s"] for r in repeats]
    return {**median, "tokens_per_s_median": statistics.median(rates), "repeats": list(repeats)}


def against_best(methods: dict[str, dict], method: str, others: Sequence[str]) -> dict:
    """``method`` against the best of ``others`` by median tokens/s (each a ``median_run`` result): the
    ratio of their medians, and the ratio within each turn with its median, lowest, highest, and geometric
    mean with that mean's standard error (from the spread of the turns' log ratios). The methods take turns,
    so a turn's ratio cancels the machine's drift between turns, and the standard error says how far the
    difference stands out from the noise."""
    rate = {name: methods[name]["tokens_per_s_median"] for name in (method, *others)}
    best = max(others, key=rate.__getitem__)
    pairs = zip(methods[method]["repeats"], methods[best]["repeats"])
    turns = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs]
    return {
        "best": best,
        "ratio_of_medians": round(rate[method] / rate[best], 3),
        "turn_ratios": [round(r, 3) for r in turns],
        "median_turn_ratio": round(statistics.median(turns), 3),
        "lowest_turn_ratio": round(min(turns), 3),
        "highest_turn_ratio": round(max(turns), 3),
        **geometric_mean_ratio(turns),
    }


def geometric_mean_ratio(ratios: Sequence[float]) -> dict:
    """The geometric mean of ``ratios`` and its standard error (the mean's, propagated from the standard error of
    the mean log ratio; 0 with one ratio)."""
    logs = np.log(ratios)
    mean = float(np.exp(logs.mean()))
    error = mean * float(logs.std(ddof=1) / np.sqrt(len(logs))) if len(logs) > 1 else 0.0
    return {"geometric_mean_turn_ratio": round(mean, 3), "geometric_mean_standard_error": round(error, 3)}
