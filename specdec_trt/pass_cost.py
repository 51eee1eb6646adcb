"""What a target pass costs, fitted online from every pass the scheduler runs, and how long a prefill chunk
fits in a given time.

A pass over rows holding ``cached_r`` tokens, taking ``w_r`` new tokens each, costs

    fixed + per_row * rows + per_token * tokens + per_attended * attended

where ``tokens`` is what the engine computes (sum of w_r where it packs the rows' tokens, rows * max w_r where
it pads them) and ``attended`` sums, over the computed tokens, the positions each attends to (w_r * (cached_r
+ w_r) a row, at the computed width). Verify passes, prefill chunks and passes holding both fit one model: a
token costs the same matrix products whichever it is. The attention term is what makes a chunk late in a long
prompt slower than the same chunk early on (on SmolLM2-135M on two CPU cores, a 48-token chunk takes 60%
longer after 1,450 cached tokens than after 50): a cost fitted on tokens alone underestimates those chunks,
and the running streams wait longer than their bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

FEATURES = 4  # fixed, per row, per computed token, per attended (token, position) pair


def pass_features(cached: Sequence[int], widths: Sequence[int], packed: bool) -> np.ndarray:
    """[1, rows, tokens, attended] of a pass giving row r ``widths[r]`` new tokens after ``cached[r]``."""
    computed = np.asarray(widths, dtype=float) if packed else np.full(len(widths), float(max(widths)))
    attended = float(computed @ (np.asarray(cached, dtype=float) + computed))
    return np.array([1.0, len(widths), computed.sum(), attended])


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
        """[fixed, per_row, per_token, per_attended] in seconds; zeros before any observation. Solved once per
        observation: the scheduler asks every step and every auto round."""
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

    def added_seconds(self, cached: Sequence[int], widths: Sequence[int]) -> float:
        """What these rows add to a pass that runs anyway: all but its fixed cost."""
        return float(self.coefficients()[1:] @ pass_features(cached, widths, self.packed)[1:])

    def longest_chunk(self, cached: int, seconds: float, alone: bool) -> int | None:
        """The most new tokens one row holding ``cached`` tokens can prefill in ``seconds`` (0 if not even
        one), in a pass of its own (``alone``) or added to one that runs anyway; None while nothing says a
        token costs anything (nothing timed yet)."""
        fixed, per_row, per_token, per_attended = self.coefficients()
        # per_attended * w^2 + (per_token + per_attended * cached) * w + per_row [+ fixed] <= seconds
        linear = per_token + per_attended * cached
        if linear <= 0:
            return None
        room = seconds - per_row - (fixed if alone else 0.0)
        if room <= 0:
            return 0
        if per_attended <= 0:
            return int(room / linear)
        return int((math.sqrt(linear * linear + 4 * per_attended * room) - linear) / (2 * per_attended))
