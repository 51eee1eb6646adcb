"""What a prefill pass costs, fitted online, and how long a chunk fits in a given time.

A pass over ``rows`` rows padded to ``width`` new tokens computes rows * width tokens (padding included), and
each of them attends to its row's cached tokens and the chunk before it, so its seconds are

    fixed + per_token * tokens + per_attended * sum over rows of width * (cached_r + width)

The attention term is what makes a chunk late in a long prompt slower than the same chunk early on (on
SmolLM2-135M on two CPU cores, a 48-token chunk takes 60% longer after 1,450 cached tokens than after 50): a
cost fitted on tokens alone underestimates those chunks, and the running streams wait longer than their bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

FEATURES = 3  # fixed, per computed token, per attended (token, position) pair


def pass_features(cached: Sequence[int], width: int) -> np.ndarray:
    """[1, tokens, attended] of a pass of ``width`` new tokens over rows holding ``cached`` tokens."""
    rows = len(cached)
    return np.array([1.0, rows * width, width * (float(sum(cached)) + rows * width)])


class PrefillCost:
    """Decayed least squares of a prefill pass's seconds on ``pass_features``, every coefficient >= 0 (a
    coefficient the fit would make negative is dropped and the others refitted). Columns are scaled by
    their size before solving, so that a feature not yet varied takes its share by scale, not by accident."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.gram = np.zeros((FEATURES, FEATURES))  # decayed sums of x x^T
        self.moment = np.zeros(FEATURES)  # decayed sums of x y
        self._solved: np.ndarray | None = None  # the coefficients, until the next observation

    def add(self, cached: Sequence[int], width: int, seconds: float) -> None:
        """A pass of ``width`` new tokens over rows holding ``cached`` tokens took ``seconds``."""
        x = pass_features(cached, width)
        self.gram = self.decay * self.gram + np.outer(x, x)
        self.moment = self.decay * self.moment + x * seconds
        self._solved = None

    def coefficients(self) -> np.ndarray:
        """[fixed, per_token, per_attended] in seconds; zeros before any observation. Solved once per
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

    def seconds(self, cached: Sequence[int], width: int) -> float:
        """The predicted seconds of a pass (0 before any observation)."""
        return float(self.coefficients() @ pass_features(cached, width))

    def longest_chunk(self, cached: int, seconds: float) -> int | None:
        """The most new tokens one row holding ``cached`` tokens can prefill in ``seconds`` (0 if not even
        one); None while nothing says a token costs anything (nothing timed yet)."""
        fixed, per_token, per_attended = self.coefficients()
        # per_attended * w^2 + (per_token + per_attended * cached) * w + fixed <= seconds
        linear = per_token + per_attended * cached
        if linear <= 0:
            return None
        room = seconds - fixed
        if room <= 0:
            return 0
        if per_attended <= 0:
            return int(room / linear)
        return int((math.sqrt(linear * linear + 4 * per_attended * room) - linear) / (2 * per_attended))
