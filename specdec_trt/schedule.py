"""Acceptance-driven draft length ("auto" gamma): whether and how far each round drafts, for the most tokens/s.

A round that drafts g tokens takes time(g) = [g > 0] (d + c g) + a + b g (drafting, then verifying g + 1
tokens; both lines fitted by decayed least squares) and yields tokens(g) = sum over active rows of
1 + p_1 + p_1 p_2 + ... + p_1 ... p_g, where p_i is the row's acceptance of its i-th draft given the ones
before it were accepted (acceptance is bursty, so later drafts pass more often than the first). The evidence
decays per drafted token, so the estimates follow the text. The chosen g maximises tokens(g) / time(g); g = 0
is a plain step, and at least every ``probe_every``-th round drafts so acceptance keeps being measured.

A draft that reports its confidence drafts up to the limit whenever drafting pays, and ``CostAwareStop`` ends
the round once one more token is expected to add fewer tokens than it costs, judged from that confidence as
calibrated against the verifier's verdicts. The controller is deterministic given its observations.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

FIRST_DRAFT_LENGTH = 4  # the first round, before anything was measured
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # a weak prior: acceptance 0.5, worth two drafts
POSITION_SHRINK = 2.0  # a draft position's own evidence against the pooled rate, in trials
ACCEPTANCE_DECAY = 0.97  # weight of the evidence per draft drafted since (about the last 30 drafts count)
TIME_DECAY = 0.95  # the same per round for timings, which drift slowly (longer context)
PROBE_EVERY = 4  # at most PROBE_EVERY - 1 plain rounds in a row
CONFIDENCE_BINS = np.array([0.3, 0.5, 0.7, 0.9, 0.97])  # edges of the draft-confidence bins
CONFIDENCE_PRIOR = np.convolve(np.r_[0.0, CONFIDENCE_BINS, 1.0], [0.5, 0.5], "valid")  # each bin's middle
CALIBRATION_SHRINK = 2.0  # the prior's weight in a bin, in trials


def confidence_bin(confidence: np.ndarray) -> np.ndarray:
    """Each confidence's bin index in ``CONFIDENCE_BINS`` (an edge belongs to the bin above it)."""
    return np.searchsorted(CONFIDENCE_BINS, confidence, side="right")


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
        self.judged = np.zeros(len(CONFIDENCE_BINS) + 1)  # decayed, over all rows: judged drafts per bin
        self.judged_accepted = np.zeros(len(CONFIDENCE_BINS) + 1)
        self.reports_confidence = False  # whether the draft has reported its confidence
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

    def calibrated_acceptance(self) -> np.ndarray:
        """Acceptance of a draft token per confidence bin (``CONFIDENCE_BINS``), shrunk to the bin's middle."""
        return (CALIBRATION_SHRINK * CONFIDENCE_PRIOR + self.judged_accepted) / (CALIBRATION_SHRINK + self.judged)

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

    def rates(self, active: Sequence[bool]) -> np.ndarray:
        """tokens(g) / time(g) for g = 0 .. max_draft: the expected tokens per second."""
        return self.expected_tokens(active) / np.maximum(self.round_time(), 1e-12)

    def choose(self, active: Sequence[bool], remaining: int) -> int:
        """The draft length of the next round, at most: a draft that reports its confidence is asked for up
        to the limit whenever drafting pays, and ``stop_rule`` ends the round. ``remaining``: drafts that
        can still be used (tokens still needed by the longest active row, less the target's own token)."""
        limit = min(self.max_draft, remaining)
        if limit <= 0:
            return 0
        if self.rounds == 0:
            gamma = min(self.first, limit)
        else:
            low = 1 if self.plain_streak >= self.probe_every - 1 else 0
            gamma = low + int(np.argmax(self.rates(active)[low : limit + 1]))
            if gamma and self.reports_confidence:
                gamma = limit
        self.plain_streak = self.plain_streak + 1 if gamma == 0 else 0
        return gamma

    def stop_rule(self, active: Sequence[bool]) -> CostAwareStop:
        """The rule that ends the next round once another draft token is worth less than it costs (never
        before a round was timed)."""
        _, c = self.draft_cost()
        _, b = self.verify_cost()
        threshold = float(self.rates(active).max()) * (c + b) if self.rounds else 0.0
        return CostAwareStop(self.calibrated_acceptance(), self.acceptance(), np.asarray(active, bool), threshold)

    def observe(
        self,
        num_drafted: int,
        num_accepted: Sequence[int],
        active: Sequence[bool],
        draft_s: float,
        verify_s: float,
        confidence: np.ndarray | None = None,
    ) -> None:
        """Record a round: it drafted ``num_drafted`` tokens for every row (maybe fewer than chosen: an early
        stop), row r accepted ``num_accepted[r]``; only ``active`` rows count. Times in seconds.
        ``confidence`` [B, num_drafted]: the draft's probability of each token it drafted, if known."""
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
        self.judged *= fade
        self.judged_accepted *= fade
        if confidence is not None and num_drafted:
            self.reports_confidence = True
            bins = confidence_bin(np.asarray(confidence)[rows])
            judged = reached[:, :num_drafted]
            passed = judged & (position[:, :num_drafted] < accepted[:, None])
            np.add.at(self.judged, bins[judged], 1.0)
            np.add.at(self.judged_accepted, bins[passed], 1.0)
        self.verifying.add(num_drafted, verify_s)


class CostAwareStop:
    """Ends a drafting round once one more draft token is expected to add fewer tokens than it costs.

    Called after each drafted token with the draft's probability of it per row [B]: S_r (the chance that
    row r's drafts so far are all accepted) is multiplied by the calibrated acceptance of that confidence;
    the round stops when sum over active rows of S_r p_r (the expected tokens of one more draft) is below
    ``threshold`` (rate * (c + b): what that draft costs, in tokens at the predicted rate)."""

    def __init__(self, acceptance_by_bin: np.ndarray, pooled: np.ndarray, active: np.ndarray, threshold: float):
        self.acceptance_by_bin, self.threshold = acceptance_by_bin, threshold
        self.gain = np.where(active, pooled, 0.0)  # S_r p_r, with S_r = 1 before the first draft

    def __call__(self, confidence: torch.Tensor) -> bool:
        """Whether the round ends after the token just drafted (one host sync)."""
        bins = confidence_bin(confidence.float().cpu().numpy())
        self.gain = self.gain * self.acceptance_by_bin[bins]
        return float(self.gain.sum()) < self.threshold
