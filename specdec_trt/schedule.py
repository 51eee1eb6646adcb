"""Acceptance-driven draft length ("auto" gamma): each round, the gamma that maximises tokens per second.

Cost model of one round of a batch that drafts g tokens:

    time(g)   = g * c + a + b * g                     c: drafting seconds per drafted token (measured);
                                                      a + b g: the verify pass of g + 1 tokens, fitted by
                                                      least squares over observed rounds (b = 0 until two
                                                      distinct draft lengths were verified)
    tokens(g) = sum over active rows r of E_r(g),     E_r(g) = (1 - p_r^(g+1)) / (1 - p_r) = 1 + p_r + ... + p_r^g

where p_r is row r's per-token acceptance, a geometric maximum-likelihood estimate: successes are accepted
drafts, trials are accepted drafts plus one when the round rejected a draft, both decayed by ``decay``
each round (so the estimate follows the text, prose then code) on top of a weak fixed prior. The chosen
gamma maximises tokens(g) / time(g) over 0 .. min(max_draft, tokens still needed). Gamma 0 (a plain
target step) is allowed, but at least every ``probe_every``-th round drafts, so acceptance keeps being
measured. The controller is deterministic given its observations.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FIRST_DRAFT_LENGTH = 4  # the first round, before anything was measured
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # a weak prior: acceptance 0.5, worth two drafts
ACCEPTANCE_DECAY = 0.9  # weight of the evidence per round that passed since
TIME_DECAY = 0.95  # the same for timings, which drift slowly (longer context)
PROBE_EVERY = 4  # at most PROBE_EVERY - 1 plain rounds in a row


class DraftLengthController:
    """Chooses the draft length of each round of one batch from its observed acceptance and costs."""

    def __init__(
        self,
        max_draft: int,
        batch_size: int,
        first: int = FIRST_DRAFT_LENGTH,
        decay: float = ACCEPTANCE_DECAY,
        time_decay: float = TIME_DECAY,
        probe_every: int = PROBE_EVERY,
    ) -> None:
        if max_draft < 1 or batch_size < 1 or probe_every < 1:
            raise ValueError("max_draft, batch_size and probe_every must be >= 1")
        self.max_draft, self.first, self.probe_every = max_draft, first, probe_every
        self.decay, self.time_decay = decay, time_decay
        self.accepted = np.zeros(batch_size)  # decayed evidence per row
        self.trials = np.zeros(batch_size)
        self.draft_seconds = self.drafted = 0.0  # decayed sums for c
        self.verify_sums = np.zeros(5)  # decayed sums of 1, x, y, x^2, x*y: y verify seconds, x drafts verified
        self.verified_sizes: set[int] = set()
        self.rounds = 0
        self.plain_streak = 0

    def acceptance(self) -> np.ndarray:
        """Per-row acceptance estimates p_r in (0, 1)."""
        return (PRIOR_ACCEPTED + self.accepted) / (PRIOR_TRIALS + self.trials)

    def draft_cost(self) -> float:
        """Seconds per drafted token (0 until a token was drafted)."""
        return self.draft_seconds / self.drafted if self.drafted else 0.0

    def verify_cost(self) -> tuple[float, float]:
        """(a, b) of the verify time a + b * g; b >= 0, and 0 until two draft lengths were verified."""
        w, sx, sy, sxx, sxy = self.verify_sums
        if w == 0:
            return 0.0, 0.0
        spread = w * sxx - sx * sx
        slope = (w * sxy - sx * sy) / spread if len(self.verified_sizes) > 1 and spread > 1e-12 * w * w else 0.0
        slope = max(slope, 0.0)
        return max((sy - slope * sx) / w, 0.0), slope

    def expected_tokens(self, active: Sequence[bool]) -> np.ndarray:
        """tokens(g) for g = 0 .. max_draft: the expected tokens of a round, summed over active rows."""
        p = self.acceptance()[np.asarray(active, dtype=bool)]
        return np.cumsum(p[:, None] ** np.arange(self.max_draft + 1), axis=1).sum(0)

    def round_time(self) -> np.ndarray:
        """time(g) for g = 0 .. max_draft."""
        a, b = self.verify_cost()
        return np.arange(self.max_draft + 1) * (self.draft_cost() + b) + a

    def choose(self, active: Sequence[bool], remaining: int) -> int:
        """The draft length of the next round; ``remaining``: drafts that can still be used (tokens still
        needed by the longest active row, less the target's own token)."""
        limit = min(self.max_draft, remaining)
        if limit <= 0:
            return 0
        if self.rounds == 0:
            gamma = min(self.first, limit)
        else:
            low = 1 if self.plain_streak >= self.probe_every - 1 else 0
            rate = self.expected_tokens(active) / np.maximum(self.round_time(), 1e-12)
            gamma = low + int(np.argmax(rate[low : limit + 1]))
        self.plain_streak = self.plain_streak + 1 if gamma == 0 else 0
        return gamma

    def observe(
        self, num_drafted: int, num_accepted: Sequence[int], active: Sequence[bool], draft_s: float, verify_s: float
    ) -> None:
        """Record a round: it drafted ``num_drafted`` tokens for every row (maybe fewer than chosen: an early
        stop), row r accepted ``num_accepted[r]``; only ``active`` rows count. Times in seconds."""
        self.rounds += 1
        if num_drafted:
            rows = np.asarray(active, dtype=bool)
            accepted = np.asarray(num_accepted, dtype=float)[rows]
            self.accepted[rows] = self.decay * self.accepted[rows] + accepted
            self.trials[rows] = self.decay * self.trials[rows] + accepted + (accepted < num_drafted)
            self.draft_seconds = self.time_decay * self.draft_seconds + draft_s
            self.drafted = self.time_decay * self.drafted + num_drafted
        x = float(num_drafted)
        self.verify_sums = self.time_decay * self.verify_sums + np.array([1.0, x, verify_s, x * x, x * verify_s])
        self.verified_sizes.add(num_drafted)
