"""What the target's passes cost, fitted online from every pass the scheduler runs: one record per pass, read
by every consumer (the prefill chunk's length, auto's plans, auto's stop rule).

A pass over rows holding ``cached_r`` tokens, taking ``w_r`` new tokens each, costs

    fixed + per_row * rows + per_wide_row * [some row takes several] * rows + per_token * tokens
          + per_attended * attended

where ``tokens`` is what the engine computes (sum of w_r where it packs the rows' tokens, rows * max w_r where
it pads them) and ``attended`` sums, over the computed tokens, the positions each attends to. Verify passes,
prefill chunks and passes holding both fit this one model (``PassCost``): it sizes prefill chunks, whose
cost grows with the context they attend to, and prices a chunk's share of the pass it rides in.

Auto's plans read lines per number of rows of the same passes (``VerifyLines``): seconds against the drafts
per row a verify pass computes, with a pass without drafts as its own mean (ONNX Runtime's attention takes a
slower path for every row of a pass where some row takes several tokens, so the first draft costs about as
much as the next several), and apart for passes that carry a prefill chunk (drafts cost more beside one).
docs/DECISIONS.md links the measurements behind each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TIME_DECAY = 0.95  # weight of a timing per observation since (timings drift slowly: longer context)
FEATURES = 5  # fixed, per row, per row of a pass with a wide row, per computed token, per attended pair


def pass_features(cached: Sequence[int], widths: Sequence[int], packed: bool) -> np.ndarray:
    """[1, rows, wide rows, tokens, attended] of a pass giving row r ``widths[r]`` new tokens after
    ``cached[r]`` (wide rows: every row where some row takes several tokens, else 0)."""
    computed = np.asarray(widths, dtype=float) if packed else np.full(len(widths), float(max(widths)))
    attended = float(computed @ (np.asarray(cached, dtype=float) + computed))
    rows = len(widths)
    return np.array([1.0, rows, rows * (max(widths) > 1), computed.sum(), attended])


class PassCost:
    """Decayed least squares of a pass's seconds on ``pass_features``, every coefficient >= 0 (a coefficient
    the fit would make negative is dropped and the others refitted). Columns are scaled by their size before
    solving, so that a feature not yet varied takes its share by scale, not by accident. ``packed``: the
    engine computes the rows' real tokens only (see ``Engine.packs_rows``)."""

    def __init__(self, decay: float, packed: bool) -> None:
        self.decay, self.packed = decay, packed
        self.gram = np.zeros((FEATURES, FEATURES))  # decayed sums of x x^T
        self.moment = np.zeros(FEATURES)  # decayed sums of x y
        self._solved: np.ndarray | None = None  # the coefficients, until the next observation

    def add(self, cached: Sequence[int], widths: Sequence[int], seconds: float) -> None:
        """A pass giving row r ``widths[r]`` new tokens after ``cached[r]`` took ``seconds``."""
        x = pass_features(cached, widths, self.packed)
        self.gram = self.decay * self.gram + np.outer(x, x)
        self.moment = self.decay * self.moment + x * seconds
        self._solved = None

    def coefficients(self) -> np.ndarray:
        """[fixed, per_row, per_wide_row, per_token, per_attended] in seconds; zeros before any observation.
        Solved once per observation: the scheduler asks every step and every auto round."""
        if self._solved is None:
            self._solved = self._solve()
        return self._solved.copy()

    def _solve(self) -> np.ndarray:
        scale = np.sqrt(np.diag(self.gram))
        active = [i for i in range(FEATURES) if scale[i] > 0]
        while active:
            s = scale[active]
            gram = self.gram[np.ix_(active, active)] / np.outer(s, s)
            solved = np.linalg.lstsq(gram, self.moment[active] / s, rcond=1e-9)[0] / s
            if (solved >= 0).all():
                coefficients = np.zeros(FEATURES)
                coefficients[active] = solved
                return coefficients
            del active[int(np.argmin(solved))]
        return np.zeros(FEATURES)

    def seconds(self, cached: Sequence[int], widths: Sequence[int]) -> float:
        """The predicted seconds of a pass (0 before any observation)."""
        return float(self.coefficients() @ pass_features(cached, widths, self.packed))

    def added_seconds(self, cached: Sequence[int], widths: Sequence[int], added: int) -> float:
        """What the last ``added`` rows of a pass add to the pass of the others alone."""
        base = self.seconds(cached[:-added], widths[:-added]) if added < len(widths) else 0.0
        return self.seconds(cached, widths) - base

    def longest_chunk(self, cached: int, seconds: float, pass_rows: int = 0) -> int | None:
        """The most new tokens one row holding ``cached`` tokens can prefill in ``seconds`` (0 if not even
        one): in a pass of its own (``pass_rows`` 0), or added to a pass of ``pass_rows`` rows of one token
        each (which it makes a pass with a wide row); None while nothing says a token costs anything
        (nothing timed yet)."""
        fixed, per_row, per_wide_row, per_token, per_attended = self.coefficients()
        # per_attended * w^2 + (per_token + per_attended * cached) * w + what the row adds besides <= seconds
        linear = per_token + per_attended * cached
        if linear <= 0:
            return None
        room = seconds - per_row - per_wide_row * (pass_rows + 1) - (0.0 if pass_rows else fixed)
        if room <= 0:
            return 0
        # the positive root of the quadratic, in the form that stays exact as per_attended goes to 0
        return int(2 * room / (linear + math.sqrt(linear * linear + 4 * per_attended * room)))


class DecayedLine:
    """y = intercept + slope * x by least squares over decayed observations, both coefficients >= 0. Until
    two distinct x were seen the slope is unknown: ``through_origin`` then fits y = slope * x (all of y is
    per-unit cost), otherwise y = intercept (all of it is fixed)."""

    def __init__(self, decay: float, through_origin: bool) -> None:
        self.decay, self.through_origin = decay, through_origin
        self.sums = np.zeros(5)  # decayed sums of 1, x, y, x^2, x*y
        self.seen: set[float] = set()
        self._solved: tuple[float, float] | None = None  # the coefficients, until the next observation

    def add(self, x: float, y: float) -> None:
        self.sums = self.decay * self.sums + np.array([1.0, x, y, x * x, x * y])
        self.seen.add(x)
        self._solved = None

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope); (0, 0) before any observation. Solved once per observation: plans ask every
        round, for every number of rows."""
        if self._solved is None:
            self._solved = self._solve()
        return self._solved

    def _solve(self) -> tuple[float, float]:
        w, sx, sy, sxx, sxy = self.sums.tolist()
        if w == 0:
            return 0.0, 0.0
        spread = w * sxx - sx * sx
        if len(self.seen) < 2 or spread <= 1e-12 * w * w:
            return (0.0, sy / sx) if self.through_origin and sx > 0 else (sy / w, 0.0)
        slope = max((w * sxy - sx * sy) / spread, 0.0)
        intercept = (sy - slope * sx) / w
        if intercept < 0:  # the best line through the origin instead
            return 0.0, sxy / sxx
        return intercept, slope


class RowLines:
    """One ``DecayedLine`` per number of rows (a step over more rows costs more, and its cost grows faster with
    its tokens once the rows make it compute-bound). A number of rows without observations takes the lines of
    the nearest numbers that have some, interpolated (extrapolated past the ends, never below 0)."""

    def __init__(self, decay: float, through_origin: bool) -> None:
        self.decay, self.through_origin = decay, through_origin
        self.lines: dict[int, DecayedLine] = {}

    def add(self, rows: int, x: float, seconds: float) -> None:
        self.lines.setdefault(rows, DecayedLine(self.decay, self.through_origin)).add(x, seconds)

    def at(self, rows: int) -> tuple[float, float]:
        """(intercept, slope) at ``rows`` rows; (0, 0) before any observation."""
        lines = self.lines
        if rows in lines:
            return lines[rows].coefficients()
        if not lines:
            return 0.0, 0.0
        known = sorted(lines)
        below = [n for n in known if n < rows]
        above = [n for n in known if n > rows]
        pair = (below[-1], above[0]) if below and above else tuple(known[-2:] if below else known[:2])
        if len(pair) == 1 or pair[0] == pair[1]:
            return lines[pair[0]].coefficients()
        (n0, n1), (c0, c1) = pair, (np.array(lines[pair[0]].coefficients()), np.array(lines[pair[1]].coefficients()))
        value = c0 + (c1 - c0) * (rows - n0) / (n1 - n0)
        return float(max(value[0], 0.0)), float(max(value[1], 0.0))


class VerifyLines:
    """Seconds of a verify pass against the drafts per row it computes (``PassContext.drafts_per_row``), per
    number of rows: a line through the passes with drafts, and the decayed mean of the passes without. A number
    of rows not timed here takes the ``fallback``'s lines, where there is one."""

    def __init__(self, decay: float, fallback: VerifyLines | None = None) -> None:
        self.drafting = RowLines(decay, through_origin=False)
        self.plain = RowLines(decay, through_origin=False)  # x = 0: their mean
        self.fallback = fallback

    def add(self, rows: int, drafts_per_row: float, seconds: float) -> None:
        (self.drafting if drafts_per_row > 0 else self.plain).add(rows, drafts_per_row, seconds)

    def cost(self, rows: int) -> tuple[float, float]:
        """(a, b) of the verify time a + b * x at ``rows`` rows, of a pass where some row drafts (x > 0)."""
        if self.fallback is not None and rows not in self.drafting.lines:
            return self.fallback.cost(rows)
        return self.drafting.at(rows)

    def plain_cost(self, rows: int) -> float:
        """Seconds of a pass at ``rows`` rows where no row drafts; the drafting line's intercept while no such
        pass was timed."""
        if self.fallback is not None and rows not in self.plain.lines:
            return self.fallback.plain_cost(rows)
        return self.plain.at(rows)[0] if self.plain.lines else self.cost(rows)[0]


@dataclass(frozen=True)
class PassContext:
    """The verify pass a kind of draft plans its rows into: ``rows`` in the pass, and what the pass's other
    rows bring to the round whatever these rows draft: their expected ``tokens`` and the ``width`` of their
    drafts (the pass is as wide as its widest row; ``drafts`` in all, ``packed``: the engine computes only
    real tokens, so the pass costs its drafts, not rows x its widest). ``fixed_s``: seconds the round costs
    beyond its draft and verify passes whatever is drafted (the fixed cost of the prefill chunk that follows
    each round while a prompt is being prefilled): a round that yields more tokens spreads it thinner."""

    rows: int
    tokens: float = 0.0
    width: int = 0
    fixed_s: float = 0.0
    drafts: int = 0  # the other rows' drafts in all
    packed: bool = False  # whether the engine computes the rows' tokens packed (True) or padded to the widest
    chunk: bool = False  # whether a prefill chunk rides in the pass (its own lines: ``Costs.lines``)

    @classmethod
    def of(
        cls, drafts: Sequence[int], packed: bool, tokens: float = 0.0, fixed_s: float = 0.0, chunk: bool = False
    ) -> PassContext:
        """The pass of rows drafting ``drafts``, as the target computes it (packed or padded)."""
        return cls(len(drafts), tokens, max(drafts, default=0), fixed_s, sum(drafts), packed, chunk)

    def drafts_per_row(self, drafting_rows: int | np.ndarray, g: np.ndarray | int) -> np.ndarray:
        """x: the verify pass's drafts per row, as computed, when ``drafting_rows`` more rows draft ``g``."""
        if self.packed:
            return (self.drafts + drafting_rows * np.asarray(g)) / self.rows
        return np.maximum(g, self.width)


class Costs:
    """Every timing of the target's passes, recorded once per pass (``add_pass``) and read by every consumer:
    ``passes`` for any pass's seconds, ``verify`` and ``verify_beside_chunk`` (fitted on passes that carry a
    prefill chunk, less the chunk's predicted share; the others' lines stand in at a number of rows not yet
    timed with one) for auto's plans, and ``round_s``, the decayed mean seconds of a round, against which a
    chunk beside running requests is sized. ``packed``: the target computes a pass's rows packed."""

    def __init__(self, packed: bool, decay: float = TIME_DECAY) -> None:
        self.packed, self.decay = packed, decay
        self.passes = PassCost(decay, packed)
        self.verify = VerifyLines(decay)
        self.verify_beside_chunk = VerifyLines(decay, fallback=self.verify)
        self.round_s: float | None = None

    def add_pass(self, cached: Sequence[int], widths: Sequence[int], seconds: float, verify_rows: int = 0) -> float:
        """Record a target pass giving row r ``widths[r]`` new tokens after ``cached[r]``: its first
        ``verify_rows`` rows verify (their last token and their drafts), the others are prefill chunks. Returns
        the verify rows' share of ``seconds``: all of it, less the chunks' predicted share where chunks rode."""
        self.passes.add(cached, widths, seconds)
        if not verify_rows:
            return seconds
        chunks = len(widths) - verify_rows
        if chunks:
            seconds = max(seconds - self.passes.added_seconds(cached, widths, chunks), 0.0)
        drafts_per_row = PassContext.of([width - 1 for width in widths[:verify_rows]], self.packed).drafts_per_row(0, 0)
        self.lines(chunks > 0).add(verify_rows, float(drafts_per_row), seconds)
        return seconds

    def add_round(self, seconds: float) -> None:
        """A round (drafting and verifying) took ``seconds``."""
        previous = self.round_s
        self.round_s = seconds if previous is None else self.decay * previous + (1 - self.decay) * seconds

    def lines(self, chunk: bool) -> VerifyLines:
        """The verify lines of passes that carry a prefill chunk (``chunk``), or of the others."""
        return self.verify_beside_chunk if chunk else self.verify

    @property
    def fixed_s(self) -> float:
        """A pass's fixed cost, whatever it computes (reading every weight once)."""
        return float(self.passes.coefficients()[0])
