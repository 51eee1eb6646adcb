"""Acceptance-driven draft length ("auto" gamma): each round, the gamma that maximises tokens per second.

Cost model of one round of a batch that drafts g tokens:

    time(g)   = [g > 0] (d + c g) + a + b g               drafting: d per round (feeding the committed tokens
                                                          the draft lacks) and c per drafted token; verifying
                                                          g + 1 tokens: a + b g. Both lines are fitted by
                                                          decayed least squares over observed rounds (until two
                                                          distinct lengths were seen: d = 0 and b = 0)
    tokens(g) = sum over active rows r of E_r(g),         E_r(g) = 1 + p_r1 + p_r1 p_r2 + ... + p_r1 ... p_rg

where p_ri is row r's acceptance of its i-th draft given the ones before it were accepted. Acceptance is
bursty (a rejection often follows a rejection; a run of easy text accepts whole drafts), so later drafts are
accepted more often than the first, and a single per-token rate undervalues long drafts. Each p_ri is
estimated from the rounds that reached draft i, shrunk towards the row's pooled rate p_r, a geometric
maximum-likelihood estimate on top of a weak fixed prior (successes: accepted drafts; trials: accepted drafts
plus one when the round rejected a draft); drafts never reached yet take p_r. All evidence decays by
``decay`` per drafted token, so the estimates follow the text, prose then code, over the same number of
drafts whatever gamma is (a decay per round would let short drafts starve the estimate, pulling it to the
prior and keeping drafts short); a plain round fades it as one draft would, so that evidence from a stretch
of rejected drafts does not outlive the text it came from. The chosen gamma maximises tokens(g) / time(g) over
0 .. min(max_draft, tokens still needed). Gamma 0 (a plain target step) is allowed, but at least every
``probe_every``-th round drafts, so acceptance keeps being measured.

The early stop inside a round (after a token the draft itself was unconfident about) is calibrated the same
way: the controller counts how often such unconfident tokens were accepted, among those the verifier
reached, and allows the stop only while they are rejected more often than not. A self-draft that is nearly
the target (int4) is accepted even where it hesitates, so it keeps drafting; a small distilled draft's
hesitations are mostly rejections, so it stops. The controller is deterministic given its observations.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FIRST_DRAFT_LENGTH = 4  # the first round, before anything was measured
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # a weak prior: acceptance 0.5, worth two drafts
POSITION_SHRINK = 2.0  # a draft position's own evidence against the pooled rate, in trials
ACCEPTANCE_DECAY = 0.97  # weight of the evidence per draft drafted since (about the last 30 drafts count)
TIME_DECAY = 0.95  # the same per round for timings, which drift slowly (longer context)
PROBE_EVERY = 4  # at most PROBE_EVERY - 1 plain rounds in a row
PRIOR_UNCONFIDENT_ACCEPTED, PRIOR_UNCONFIDENT_TRIALS = 0.5, 2.0  # a weak prior: unconfident drafts mostly fail
EARLY_STOP_BELOW = 0.5  # stop early while unconfident drafts are accepted less often than this


class DecayedLine:
    """y = intercept + slope * x by least squares over decayed observations, both coefficients >= 0. Until
    two distinct x were seen the slope is unknown: ``through_origin`` then fits y = slope * x (all of y is
    per-unit cost), otherwise y = intercept (all of it is fixed)."""

    def __init__(self, decay: float, through_origin: bool) -> None:
        self.decay, self.through_origin = decay, through_origin
        self.sums = np.zeros(5)  # decayed sums of 1, x, y, x^2, x*y
        self.seen: set[float] = set()

    def add(self, x: float, y: float) -> None:
        self.sums = self.decay * self.sums + np.array([1.0, x, y, x * x, x * y])
        self.seen.add(x)

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope); (0, 0) before any observation."""
        w, sx, sy, sxx, sxy = self.sums
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
        self.max_draft, self.first, self.probe_every, self.decay = max_draft, first, probe_every, decay
        self.reached = np.zeros((batch_size, max_draft))  # decayed evidence per row and draft position
        self.passed = np.zeros((batch_size, max_draft))
        self.unconfident_accepted = self.unconfident_trials = 0.0  # decayed, over all rows
        self.drafting = DecayedLine(time_decay, through_origin=True)  # seconds against tokens drafted
        self.verifying = DecayedLine(time_decay, through_origin=False)  # seconds against drafts verified
        self.rounds = 0
        self.plain_streak = 0

    def acceptance(self) -> np.ndarray:
        """Per-row pooled acceptance estimates p_r in (0, 1)."""
        return (PRIOR_ACCEPTED + self.passed.sum(1)) / (PRIOR_TRIALS + self.reached.sum(1))

    def position_acceptance(self) -> np.ndarray:
        """[B, max_draft] p_ri: acceptance of draft i given the drafts before it were accepted."""
        pooled = self.acceptance()[:, None]
        return (POSITION_SHRINK * pooled + self.passed) / (POSITION_SHRINK + self.reached)

    def unconfident_acceptance(self) -> float:
        """Estimated acceptance of a draft token the draft was unconfident about."""
        return (PRIOR_UNCONFIDENT_ACCEPTED + self.unconfident_accepted) / (
            PRIOR_UNCONFIDENT_TRIALS + self.unconfident_trials
        )

    def stops_early(self) -> bool:
        """Whether the next round should stop after an unconfident draft token."""
        return self.unconfident_acceptance() < EARLY_STOP_BELOW

    def draft_cost(self) -> tuple[float, float]:
        """(d, c): drafting seconds per drafting round and per drafted token."""
        return self.drafting.coefficients()

    def verify_cost(self) -> tuple[float, float]:
        """(a, b) of the verify time a + b * g."""
        return self.verifying.coefficients()

    def expected_tokens(self, active: Sequence[bool]) -> np.ndarray:
        """tokens(g) for g = 0 .. max_draft: the expected tokens of a round, summed over active rows."""
        p = self.position_acceptance()[np.asarray(active, dtype=bool)]
        reach = np.cumprod(np.concatenate([np.ones((len(p), 1)), p], axis=1), axis=1)
        return np.cumsum(reach, axis=1).sum(0)

    def round_time(self) -> np.ndarray:
        """time(g) for g = 0 .. max_draft."""
        (d, c), (a, b) = self.draft_cost(), self.verify_cost()
        g = np.arange(self.max_draft + 1)
        return (g > 0) * d + g * (c + b) + a

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
        self,
        num_drafted: int,
        num_accepted: Sequence[int],
        active: Sequence[bool],
        draft_s: float,
        verify_s: float,
        unconfident: np.ndarray | None = None,
    ) -> None:
        """Record a round: it drafted ``num_drafted`` tokens for every row (maybe fewer than chosen: an early
        stop), row r accepted ``num_accepted[r]``; only ``active`` rows count. Times in seconds.
        ``unconfident`` [B, num_drafted]: which drafted tokens the draft was unconfident about, if known."""
        self.rounds += 1
        rows = np.asarray(active, dtype=bool)
        accepted = np.asarray(num_accepted, dtype=float)[rows]
        fade = self.decay ** max(num_drafted, 1)  # a plain round fades the evidence as one draft would
        position = np.arange(self.max_draft)[None]
        reached = (position <= accepted[:, None]) & (position < num_drafted)  # drafts the verifier judged
        self.reached[rows] = fade * self.reached[rows] + reached
        self.passed[rows] = fade * self.passed[rows] + (position < accepted[:, None])
        if num_drafted:
            self.drafting.add(num_drafted, draft_s)
        if unconfident is not None and num_drafted:
            judged = np.asarray(unconfident, dtype=bool)[rows] & reached[:, :num_drafted]
            passed = judged & (position[:, :num_drafted] < accepted[:, None])
            self.unconfident_trials = fade * self.unconfident_trials + judged.sum()
            self.unconfident_accepted = fade * self.unconfident_accepted + passed.sum()
        self.verifying.add(num_drafted, verify_s)
