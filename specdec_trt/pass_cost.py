"""What a target pass costs, fitted online from every pass the scheduler runs, and how long a prefill chunk
fits in a given time.

A pass over rows holding ``cached_r`` tokens, taking ``w_r`` new tokens each, costs

    fixed + per_row * rows + per_wide_row * [some row takes several] * rows + per_token * tokens
          + per_attended * attended

where ``tokens`` is what the engine computes (sum of w_r where it packs the rows' tokens, rows * max w_r where
it pads them) and ``attended`` sums, over the computed tokens, the positions each attends to (w_r * (cached_r
+ w_r) a row, at the computed width). Verify passes, prefill chunks and passes holding both fit one model: a
token costs the same matrix products whichever it is. ONNX Runtime's attention takes a slower path for every
row of a pass where some row takes several new tokens, hence the wide-row term. The attention term is what
makes a chunk late in a long prompt slower than the same chunk early on: a cost fitted on tokens alone
underestimates those chunks, and the running streams wait longer than their bound (docs/MEASUREMENTS.md has
the figures).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

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
