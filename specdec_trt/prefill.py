"""How much of the prompts being admitted one step prefills: a pure policy of the pass-cost model and the queue.

With no request decoding there is nobody to hold up, and every admitted prompt is prefilled at once. Beside
decoding requests a chunk holds as many prompt tokens as take about ``chunk_rounds`` rounds' time, so that the
running streams' tokens come about ``chunk_rounds + 1`` times further apart than a round while a long prompt
goes in; more while more prompts wait for their first token than requests decode (each chunk holds up every
decoding stream, each round every prompt behind it: a burst of prompts beside one stream is not prefilled a
sliver at a time). The time is priced by ``PassCost`` at the context the oldest prompt being prefilled has
reached: what the chunk adds to the round's pass where the target packs rows, a pass of its own elsewhere.
A chunk is never shorter than ``MIN_PREFILL_CHUNK`` tokens: each pass of its own rereads the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec_trt.costs import PassCost

DEFAULT_PREFILL_CHUNK = 256  # the most prompt tokens prefilled per engine step, over the requests being admitted
MIN_PREFILL_CHUNK = 16  # the fewest, however slow a prefill is next to a round
DEFAULT_PREFILL_CHUNK_ROUNDS = 1.0  # the most rounds' time a prefill chunk beside decoding requests may take


@dataclass(frozen=True)
class PrefillQueue:
    """What the next chunk is sized for: the requests ``decoding``, the ``prompts`` still to be prefilled that
    the next steps will chunk, and the tokens ``cached`` of the oldest prompt being prefilled."""

    decoding: int
    prompts: int
    cached: int


@dataclass(frozen=True)
class PrefillPolicy:
    """``chunk``: the most prompt tokens a step prefills; ``chunk_rounds``: the most rounds' time a chunk beside
    decoding requests may take (None: no bound, chunks of ``chunk`` tokens: fewer passes, so more tokens/s
    under load, and longer stalls of the running streams while a prompt is prefilled)."""

    chunk: int = DEFAULT_PREFILL_CHUNK
    chunk_rounds: float | None = DEFAULT_PREFILL_CHUNK_ROUNDS

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.chunk}")
        if self.chunk_rounds is not None and not self.chunk_rounds > 0:
            raise ValueError(f"prefill_chunk_rounds must be > 0 or None, got {self.chunk_rounds}")

    def budget(self, passes: PassCost, round_s: float | None, queue: PrefillQueue) -> int | None:
        """Prompt tokens of the next chunk (None: no limit, nothing decodes); ``chunk`` itself without a bound
        in rounds, or before a round was timed (``round_s`` None)."""
        if not queue.decoding:
            return None
        if self.chunk_rounds is None or round_s is None:
            return self.chunk
        seconds = self.chunk_rounds * round_s * max(1.0, queue.prompts / queue.decoding)
        fitting = passes.longest_chunk(queue.cached, seconds, queue.decoding if passes.packed else 0)
        return self.chunk if fitting is None else min(self.chunk, max(MIN_PREFILL_CHUNK, fitting))

    def chunk_follows_rounds(self, packed: bool) -> bool:
        """Whether, while a prompt waits to be prefilled, a chunk's pass of its own follows each round: chunks
        sized in rounds, on a target that does not carry them in the round's verify pass (``packed``)."""
        return self.chunk_rounds is not None and not packed


def next_chunk(pending: Sequence[Sequence[int]], budget: int | None, packed: bool) -> list[Sequence[int]]:
    """The chunks of the next pass, for the first rows of ``pending`` (each row's prompt tokens not yet
    prefilled, oldest first): up to ``budget`` tokens in all (None: every token). A pass that pads its rows
    pads every row to the longest chunk, so there rows join it only while padding stays under half the
    work; the others wait for the next step."""
    chunks: list[Sequence[int]] = []
    longest = total = 0  # of the chunks taken so far
    for rest in pending:
        if budget == 0:
            break
        chunk = rest[:budget]
        widest = max(longest, len(chunk))
        if chunks and not packed and (len(chunks) + 1) * widest > 2 * (total + len(chunk)):
            break
        chunks.append(chunk)
        longest, total = widest, total + len(chunk)
        budget = None if budget is None else budget - len(chunk)
    return chunks
