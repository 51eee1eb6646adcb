"""The draft length of one kind of draft ("auto"): which rows draft in a round, and how far, for the most
tokens per second of the whole pass.

A round in which j rows draft g tokens takes time(j, g) = [g > 0] (d_j + c_j g) + verify_n(x): drafting over
those j rows (the kind's own lines per number of drafting rows), then the verify pass of n rows computing x
drafts per row (``specdec_trt.costs``: packed, x = (D + j g) / n; padded, x = max(g, w)). It yields the pass's
tokens: the other rows' own, plus for each row here 1 + p_1 + p_1 p_2 + ... + p_1 ... p_g if it drafts, 1 if
not, p_i being the row's acceptance of its i-th draft given the ones before it were accepted. The plan
maximises tokens / time over g and over j, the rows expected to gain most drafting; g = 0 is a plain round.

Acceptance is each row's own decayed evidence per draft position, shrunk to a prior: the recent acceptance of
the kind's drafts over every row, weighted by whichever of a few weights has predicted the verdicts best
(a model draft's rows tend to be accepted alike; prompt lookup's differ for good). Where plain rounds win, a
round drafts now and then anyway (a probe), and a row left out while others draft joins them once it sat out
as long (``overdue``), so acceptance keeps being measured. A draft that reports its confidence drafts up to
the limit whenever drafting pays, and ``CostAwareStop`` ends the round once one more token is expected to
add fewer tokens than it costs, judged from that confidence as calibrated against the verifier's verdicts.
The controller is deterministic given its observations. docs/DECISIONS.md links the measurements behind
each of these choices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from specdec_trt.costs import Costs, PassContext, RowLines

FIRST_DRAFT_LENGTH = 4  # the first round, before anything was measured
PRIOR_TRIALS = 2.0  # a row's prior, in drafts, before any verdict: the acceptance of the kind's rows so far
PRIOR_WEIGHTS = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])  # the prior's weights tried against the verdicts
SELECTION_DECAY = 0.998  # weight of a weight's prediction error per draft judged since (about the last 500)
POSITION_SHRINK = 2.0  # a draft position's own evidence against the pooled rate, in trials
ACCEPTANCE_DECAY = 0.97  # weight of the evidence per draft drafted since (about the last 30 drafts count)
PROBE_EVERY = 4  # at least PROBE_EVERY - 1 plain rounds before a probe
PROBE_COST = 0.02  # the share of the time probes may lose, on average, where drafting does not pay
CONFIDENCE_BINS = np.array([0.3, 0.5, 0.7, 0.9, 0.97])  # edges of the draft-confidence bins
CONFIDENCE_PRIOR = np.convolve(np.r_[0.0, CONFIDENCE_BINS, 1.0], [0.5, 0.5], "valid")  # each bin's middle
CALIBRATION_SHRINK = 2.0  # the prior's weight in a bin, in trials


def confidence_bin(confidence: np.ndarray) -> np.ndarray:
    """Each confidence's bin index in ``CONFIDENCE_BINS`` (an edge belongs to the bin above it)."""
    return np.searchsorted(CONFIDENCE_BINS, confidence, side="right")


class AcceptanceEvidence:
    """One request's decayed acceptance evidence for one kind of draft, per draft position: how often a round
    reached draft i (the drafts before it were accepted) and accepted it. It moves with its request from
    round to round, whatever else shares the batch."""

    def __init__(self, max_draft: int) -> None:
        self.reached = np.zeros(max_draft)
        self.passed = np.zeros(max_draft)
        self.idle = 0  # rounds since the row last drafted


class DraftLengthController:
    """Chooses the draft length of each round of one kind of draft, for the rows drafting with it, from each
    row's own acceptance evidence, the target's ``costs`` (shared by every kind; its own when not given) and
    the kind's own ``drafting`` lines: seconds of drafting against the tokens drafted, per number of rows."""

    def __init__(
        self,
        max_draft: int,
        costs: Costs | None = None,
        first: int = FIRST_DRAFT_LENGTH,
        decay: float = ACCEPTANCE_DECAY,
        probe_every: int = PROBE_EVERY,
    ) -> None:
        if max_draft < 1 or probe_every < 1:
            raise ValueError("max_draft and probe_every must be >= 1")
        self.max_draft, self.first, self.probe_every, self.decay = max_draft, first, probe_every, decay
        self.population = np.zeros(2)  # decayed, over all rows: drafts judged and accepted
        self.weight_errors = np.zeros(len(PRIOR_WEIGHTS))  # decayed squared error of each weight's predictions
        self.judged = np.zeros(len(CONFIDENCE_BINS) + 1)  # decayed, over all rows: judged drafts per bin
        self.judged_accepted = np.zeros(len(CONFIDENCE_BINS) + 1)
        self.reports_confidence = False  # whether the draft has reported its confidence
        self.costs = Costs(packed=False) if costs is None else costs
        self.drafting = RowLines(self.costs.decay, through_origin=True)
        self.rounds = 0
        self.plain_streak = 0
        self.best_rate = 0.0  # the best tokens/s the last plan predicted for its pass (0 before a round was timed)

    def evidence(self) -> AcceptanceEvidence:
        """Fresh evidence for a new row."""
        return AcceptanceEvidence(self.max_draft)

    def prior_acceptance(self) -> float:
        """The acceptance a row without evidence of its own is given: that of the drafts of every row so far,
        shrunk to 0.5 by one draft (a request joining drafts as its kind's rows do, and a row whose evidence
        fades in plain rounds returns to it)."""
        judged, accepted = self.population
        return (0.5 + accepted) / (1.0 + judged)

    def prior_weight(self) -> float:
        """The weight of the prior in a row's estimate, in drafts: of ``PRIOR_WEIGHTS``, the one whose estimates
        would have predicted the verdicts so far with the least squared error (``PRIOR_TRIALS`` before any)."""
        if not self.weight_errors.any():
            return PRIOR_TRIALS
        return float(PRIOR_WEIGHTS[int(np.argmin(self.weight_errors))])

    def acceptance(self, rows: Sequence[AcceptanceEvidence], weight: float | np.ndarray | None = None) -> np.ndarray:
        """Per-row pooled acceptance estimates p_r in (0, 1), with the prior worth ``weight`` drafts (default:
        ``prior_weight``; an array [w]: the estimates [rows, w] under each)."""
        passed = np.array([row.passed.sum() for row in rows])
        reached = np.array([row.reached.sum() for row in rows])
        weight = np.asarray(self.prior_weight() if weight is None else weight)
        if weight.ndim:
            passed, reached = passed[:, None], reached[:, None]
        return (weight * self.prior_acceptance() + passed) / (weight + reached)

    def position_acceptance(self, rows: Sequence[AcceptanceEvidence]) -> np.ndarray:
        """[rows, max_draft] p_ri: acceptance of draft i given the drafts before it were accepted."""
        pooled = self.acceptance(rows)[:, None]
        passed = np.stack([row.passed for row in rows])
        reached = np.stack([row.reached for row in rows])
        return (POSITION_SHRINK * pooled + passed) / (POSITION_SHRINK + reached)

    def calibrated_acceptance(self) -> np.ndarray:
        """Acceptance of a draft token per confidence bin (``CONFIDENCE_BINS``), shrunk to the bin's middle."""
        return (CALIBRATION_SHRINK * CONFIDENCE_PRIOR + self.judged_accepted) / (CALIBRATION_SHRINK + self.judged)

    def row_tokens(self, rows: Sequence[AcceptanceEvidence]) -> np.ndarray:
        """[rows, max_draft + 1]: each row's expected tokens of a round drafting g = 0 .. max_draft."""
        p = self.position_acceptance(rows)
        reach = np.cumprod(np.concatenate([np.ones((len(p), 1)), p], axis=1), axis=1)
        return np.cumsum(reach, axis=1)

    def round_time(self, rows: int, context: PassContext | None = None) -> np.ndarray:
        """time(g) for g = 0 .. max_draft, for ``rows`` drafting rows verified in the pass ``context``
        (default: these rows alone)."""
        return self.round_times([rows], context or PassContext(rows))[0]

    def round_times(self, drafting_rows: Sequence[int], context: PassContext) -> np.ndarray:
        """[len(drafting_rows), max_draft + 1]: ``round_time`` for each number of drafting rows, at once (the
        plan asks for every number each round)."""
        lines = self.costs.lines(context.chunk)
        (a, b), plain = lines.cost(context.rows), lines.plain_cost(context.rows)
        d, c = np.array([self.drafting.at(j) for j in drafting_rows]).T[:, :, None]
        g = np.arange(self.max_draft + 1)
        x = context.drafts_per_row(np.asarray(drafting_rows)[:, None], g)
        verify = np.where(x > 0, a + b * x, plain)
        return (g > 0) * (d + c * g) + verify

    def rates(self, rows: Sequence[AcceptanceEvidence], context: PassContext | None = None) -> np.ndarray:
        """[len(rows) + 1, max_draft + 1]: the pass's expected tokens per second when the j rows that gain most
        from it draft g tokens (row j = 0 and column g = 0: a plain round for these rows)."""
        return self._rates(self.row_tokens(rows), context or PassContext(len(rows)))

    def _rates(self, row_tokens: np.ndarray, context: PassContext) -> np.ndarray:
        """``rates`` from the rows' ``row_tokens``."""
        gain = -np.sort(-(row_tokens - 1.0), axis=0)  # per g, the rows gaining most first
        tokens = context.tokens + len(gain) + np.vstack([np.zeros(self.max_draft + 1), np.cumsum(gain, axis=0)])
        times = self.round_times(range(1, len(gain) + 1), context)
        plain = np.full((1, self.max_draft + 1), times[0, 0])  # j = 0: a plain round for these rows
        return tokens / np.maximum(np.vstack([plain, times]) + context.fixed_s, 1e-12)

    def plan(
        self,
        rows: Sequence[AcceptanceEvidence],
        remaining: int,
        context: PassContext | None = None,
        tokens: np.ndarray | None = None,
    ) -> list[int]:
        """The draft length of each row in the next round, at most: the rows expected to gain most draft
        alike and the others none (a draft that reports its confidence is asked for up to the limit whenever
        drafting pays, and ``stop_rule`` ends the round; a probe drafts the length planned for it, so that it
        costs what it was predicted to). ``remaining``: drafts that can still be used (tokens still needed by
        the longest row, less the target's own token). ``context``: the pass these rows join (default: just
        these rows); ``tokens``: the rows' ``row_tokens``, where the caller has them already."""
        limit = min(self.max_draft, remaining)
        if limit <= 0 or not rows:
            return [0] * len(rows)
        if self.rounds == 0:
            lengths = [min(self.first, limit)] * len(rows)
        else:
            tokens = self.row_tokens(rows) if tokens is None else tokens
            rates = self._rates(tokens, context or PassContext(len(rows)))[:, : limit + 1]
            self.best_rate = float(rates.max())
            probe = rates[0, 0] >= rates.max() and self.plain_streak >= self.probe_interval(rates) - 1
            low = int(probe)
            options = rates[low:, low:]
            j, gamma = (int(n) + low for n in np.unravel_index(int(np.argmax(options)), options.shape))
            order = np.argsort(-tokens[:, gamma], kind="stable")
            drafting = set(order[:j].tolist()) if gamma else set()
            if gamma and not probe:
                drafting |= self.overdue(rows, order[j:], rates[j, gamma], rates[-1, gamma])
            gamma = limit if gamma and self.reports_confidence and not probe else gamma
            lengths = [gamma if r in drafting else 0 for r in range(len(rows))]
        self.plain_streak = 0 if any(lengths) else self.plain_streak + 1
        return lengths

    def probe_interval(self, rates: np.ndarray) -> int:
        """Rounds from one probe to the next where plain rounds win (``rates``: as ``rates`` returns them):
        ``probe_every``, or as many as make the best probe's predicted loss, against a plain round's tokens/s,
        about ``PROBE_COST`` of their time."""
        return self._interval(1.0 - float(rates[1:, 1:].max()) / max(float(rates[0, 0]), 1e-12))

    def overdue(
        self, rows: Sequence[AcceptanceEvidence], left_out: np.ndarray, planned_rate: float, all_rate: float
    ) -> set[int]:
        """The rows of ``left_out`` that draft anyway in a round where others draft, to be measured: those that
        have not drafted for as many rounds as a probe would wait were its loss that of every row drafting
        (``all_rate`` against the plan's ``planned_rate``). A row left out is never judged, so it would keep
        its estimate for as long as others draft beside it."""
        interval = self._interval(1.0 - all_rate / max(planned_rate, 1e-12))
        return {int(r) for r in left_out if rows[r].idle >= interval - 1}

    def _interval(self, loss: float) -> int:
        """``probe_every``, or as many rounds as make one that loses ``loss`` of the best tokens/s cost about
        ``PROBE_COST`` of their time."""
        return max(self.probe_every, math.ceil(loss / PROBE_COST))

    def stop_rule(
        self,
        slots: Sequence[int],
        rows: Sequence[AcceptanceEvidence],
        context: PassContext | None = None,
        exempt: Sequence[int] = (),
        rate: float | None = None,
    ) -> CostAwareStop:
        """The rule that ends the next round of the drafting rows in ``slots`` (with evidence ``rows``, in the
        pass ``context``) once another draft token is worth less than it costs, its time counted in tokens at
        ``rate``, the best rate predicted for the pass, plain included (never before a round was timed; by
        default computed here, the plan of the round has it in ``best_rate``); a row of an ``exempt`` slot (one
        that drafts a fixed number) keeps the round going while it drafts."""
        context = context or PassContext(len(rows))
        _, c = self.drafting.at(len(rows))
        _, b = self.costs.lines(context.chunk).cost(context.rows)
        if rate is None:
            rate = float(self.rates(rows, context).max()) if self.rounds else 0.0  # a second's worth, in tokens
        # one more draft widens a padded pass by a token per row; a packed one by a token per drafting row
        verify_share = 1.0 / context.rows if context.packed else None
        pooled = dict(zip(slots, self.acceptance(rows)))
        return CostAwareStop(self.calibrated_acceptance(), pooled, rate * c, rate * b, exempt, verify_share)

    def observe(
        self,
        num_drafted: Sequence[int] | int,
        num_accepted: Sequence[int],
        rows: Sequence[AcceptanceEvidence],
        confidence: np.ndarray | None = None,
    ) -> None:
        """Record a round's verdicts: row r drafted ``num_drafted[r]`` tokens (one number: all rows alike; maybe
        fewer than chosen: an early stop) and accepted ``num_accepted[r]``; ``confidence`` [rows, k]: the
        draft's probability of each token it drafted, if known. Timings go to ``costs`` and ``drafting``."""
        self.rounds += 1
        drafted = np.broadcast_to(np.asarray(num_drafted, dtype=np.int64), (len(rows),))
        accepted = np.asarray(num_accepted, dtype=float)
        widest = int(drafted.max(initial=0))
        position = np.arange(self.max_draft)[None]
        reached = (position <= accepted[:, None]) & (position < drafted[:, None])  # drafts the verifier judged
        passed = position < accepted[:, None]
        self._score_weights(rows, reached.sum(1), passed.sum(1))
        for row, r_reached, r_passed, count in zip(rows, reached, passed, drafted):
            fade = self.decay ** max(int(count), 1)  # a plain round fades the evidence as one draft would
            row.reached = fade * row.reached + r_reached
            row.passed = fade * row.passed + r_passed
            row.idle = 0 if count else row.idle + 1
        fade = self.decay ** max(widest, 1)
        self.population = fade * self.population + [reached.sum(), passed.sum()]
        self.judged *= fade
        self.judged_accepted *= fade
        if confidence is not None and widest:
            self.reports_confidence = True
            bins = confidence_bin(np.asarray(confidence)[:, :widest])
            judged = reached[:, :widest]
            np.add.at(self.judged, bins[judged], 1.0)
            np.add.at(self.judged_accepted, bins[judged & passed[:, :widest]], 1.0)

    def _score_weights(self, rows: Sequence[AcceptanceEvidence], judged: np.ndarray, accepted: np.ndarray) -> None:
        """Add the squared error with which each of ``PRIOR_WEIGHTS`` predicted this round's verdicts (row r:
        ``judged[r]`` drafts judged, the first ``accepted[r]`` of them accepted), from the evidence before it."""
        if not judged.any():
            return
        estimate = self.acceptance(rows, PRIOR_WEIGHTS)  # [rows, weights]
        rejected = judged - accepted
        error = (accepted[:, None] * (1.0 - estimate) ** 2 + rejected[:, None] * estimate**2).sum(0)
        self.weight_errors = SELECTION_DECAY ** float(judged.sum()) * self.weight_errors + error


class CostAwareStop:
    """Ends a drafting round once one more draft token is expected to add fewer tokens than it costs.

    Called after each drafted token with the draft's probability of it per row [n] and which rows are still
    drafting: S_r (the chance that row r's drafts so far are all accepted) is multiplied by the calibrated
    acceptance of that confidence; the round stops when sum over the rows still drafting of S_r p_r (the
    expected tokens of one more draft) is below what that draft costs, in tokens at the predicted rate:
    ``draft_cost`` (rate * c) for the draft's step, and ``verify_cost`` (rate * b) for the wider verify pass,
    all of it where the pass is padded (``verify_share`` None), and ``verify_share`` of it per row still
    drafting where the pass is packed. ``threshold``: the cost when every row of the pass drafts on."""

    def __init__(
        self,
        acceptance_by_bin: np.ndarray,
        pooled: dict[int, float],
        draft_cost: float,
        verify_cost: float,
        exempt: Sequence[int] = (),
        verify_share: float | None = None,
    ) -> None:
        self.acceptance_by_bin, self.pooled = acceptance_by_bin, pooled
        self.draft_cost, self.verify_cost, self.verify_share = draft_cost, verify_cost, verify_share
        self.threshold = draft_cost + verify_cost
        self.exempt = set(exempt)
        self.gain: np.ndarray | None = None  # per row, S_r p_r, with S_r = 1 before the first draft

    def __call__(self, confidence: torch.Tensor, slots: Sequence[int], drafting: np.ndarray) -> bool:
        """Whether the round ends after the token just drafted (one host sync)."""
        if self.gain is None:
            self.gain = np.array([self.pooled.get(slot, 0.0) for slot in slots])
        bins = confidence_bin(confidence.float().cpu().numpy())
        self.gain = np.where(drafting, self.gain * self.acceptance_by_bin[bins], 0.0)
        if any(slot in self.exempt for slot, still in zip(slots, drafting) if still):
            return False
        share = 1.0 if self.verify_share is None else self.verify_share * int(np.count_nonzero(drafting))
        return float(self.gain.sum()) < self.draft_cost + self.verify_cost * share
