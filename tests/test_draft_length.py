"""The "auto" draft length: the controller fed synthetic observations, its calibrated stop rule, and the
draft's stop on its own confidence, on real tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.build_engines.checkpoint import load_checkpoint
from specdec_trt.costs import Costs, DecayedLine, PassContext
from specdec_trt.decoder import AUTO, AUTO_MAX_DRAFT_TOKENS
from specdec_trt.draft_length import (
    CALIBRATION_SHRINK,
    CONFIDENCE_BINS,
    CONFIDENCE_PRIOR,
    FIRST_DRAFT_LENGTH,
    POSITION_SHRINK,
    PRIOR_TRIALS,
    PRIOR_WEIGHTS,
    PROBE_COST,
    PROBE_EVERY,
    AcceptanceEvidence,
    DraftLengthController,
)
from specdec_trt.drafting import (
    LOOKUP,
    MODEL,
    Draft,
    DraftPlan,
    ModelDrafter,
    Part,
    PromptLookupDrafter,
    StopRule,
    confidence_below,
)
from specdec_trt.planner import DraftPlanner
from specdec_trt.request import Request
from specdec_trt.runtime.torch_engine import TorchEngine
from specdec_trt.sampling import BatchSampler

MAX = 8


def evidence(controller: DraftLengthController, batch: int = 1) -> list[AcceptanceEvidence]:
    """Fresh evidence for ``batch`` rows, each kept by its row from round to round."""
    return [controller.evidence() for _ in range(batch)]


def record(
    controller: DraftLengthController,
    num_drafted,
    num_accepted: list[int],
    rows: list[AcceptanceEvidence],
    draft_s: float | None,
    verify_s: float,
    confidence: np.ndarray | None = None,
    pass_rows: int | None = None,
    pass_width: float | None = None,
    chunk: bool = False,
) -> None:
    """One round as the scheduler and the planner record it: its verify pass in the controller's costs, at
    ``pass_rows`` rows computing ``pass_width`` drafts a row (defaults: these rows, the widest row's drafts;
    ``chunk``: with a prefill chunk riding in it), its drafting seconds in the controller's drafting lines
    (None: not these rows' own), and its verdicts."""
    drafted = np.broadcast_to(np.asarray(num_drafted), (len(rows),))
    widest = int(drafted.max(initial=0))
    if widest and draft_s is not None:
        controller.drafting.add(int((drafted > 0).sum()), widest, draft_s)
    width = widest if pass_width is None else pass_width
    controller.costs.lines(chunk).add(pass_rows or len(rows), width, verify_s)
    controller.observe(num_drafted, num_accepted, rows, confidence)


def feed(
    controller: DraftLengthController,
    rows: list[AcceptanceEvidence],
    rounds: int,
    accept: float,
    draft_step_s: float,
    verify_s: tuple[float, float] = (0.10, 0.005),
) -> list[int]:
    """Run ``rounds`` rounds over ``rows``: each asks the controller, then reports drafts accepted as a fixed
    fraction ``accept`` of the drafted ones (1: all; 0: the first is rejected), drafting at ``draft_step_s``
    per token and verifying in a + b * gamma seconds. Returns the chosen draft lengths."""
    chosen = []
    for _ in range(rounds):
        gamma = max(controller.plan(rows, 100))
        chosen.append(gamma)
        accepted = [int(accept * gamma)] * len(rows)
        a, b = verify_s
        record(controller, gamma, accepted, rows, gamma * draft_step_s, a + b * gamma)
    return chosen


def test_first_round_is_the_default_clamped_to_max_and_remaining() -> None:
    def first(max_draft: int, remaining: int) -> int:
        controller = DraftLengthController(max_draft)
        return controller.plan(evidence(controller), remaining)[0]

    assert first(MAX, 100) == FIRST_DRAFT_LENGTH
    assert first(2, 100) == 2
    assert first(MAX, 3) == 3
    assert first(MAX, 0) == 0


def test_high_acceptance_and_a_cheap_draft_draft_long() -> None:
    controller = DraftLengthController(MAX)
    rows = evidence(controller, 2)
    chosen = feed(controller, rows, 12, accept=1.0, draft_step_s=0.005)
    assert chosen[-4:] == [MAX] * 4
    assert controller.acceptance(rows).min() > 0.9


def test_low_acceptance_and_an_expensive_draft_draft_little() -> None:
    controller = DraftLengthController(MAX)
    rows = evidence(controller)
    chosen = feed(controller, rows, 12, accept=0.0, draft_step_s=0.08)
    assert max(chosen[2:]) <= 1
    assert 0 in chosen  # plain steps: drafting does not pay at all
    assert controller.acceptance(rows)[0] < 0.5  # below the prior: its drafts were rejected


def test_clamped_to_the_max_draft_and_the_tokens_still_needed() -> None:
    controller = DraftLengthController(3)
    rows = evidence(controller)
    feed(controller, rows, 6, accept=1.0, draft_step_s=0.001)
    assert controller.plan(rows, 100) == [3]
    assert controller.plan(rows, 2) == [2]
    assert controller.plan(rows, 0) == [0]


def test_never_stuck_at_plain_steps() -> None:
    """Even when drafting never pays, a round drafts now and then (a probe), so acceptance keeps being
    measured; and when acceptance recovers, drafting resumes."""
    controller = DraftLengthController(MAX)
    rows = evidence(controller)
    chosen = feed(controller, rows, 40, accept=0.0, draft_step_s=0.08)
    assert chosen.count(0) > len(chosen) // 2 and any(chosen[PROBE_EVERY:])
    assert max(feed(controller, rows, 40, accept=1.0, draft_step_s=0.02)[-5:]) >= 2


def test_probes_lose_little_where_drafting_does_not_pay() -> None:
    """Probes come every PROBE_EVERY rounds where they cost little, and further apart where they cost much, so
    that they lose a few percent of the time: with drafts never accepted and a verify pass of 0.1 s, cheap
    drafts (2 ms a token) are probed every 4th round, dear ones (80 ms) at least 4 times rarer. A probe of the
    dear draft costs 85% of a round: one every 4th round would lose a fifth of the time."""
    gaps = {}
    for draft_step_s in (0.002, 0.08):
        controller = DraftLengthController(MAX)
        rows = evidence(controller)
        chosen = feed(controller, rows, 120, accept=0.0, draft_step_s=draft_step_s)
        probes = [i for i, gamma in enumerate(chosen) if gamma][-4:]
        gaps[draft_step_s] = min(b - a for a, b in zip(probes, probes[1:]))
        seconds = sum(0.1 + gamma * (0.005 + draft_step_s) for gamma in chosen[-60:])
        lost = 1 - 0.1 * 60 / seconds  # against 60 plain rounds, which would yield as many tokens
        assert lost < 2.5 * PROBE_COST, (chosen, lost)  # the estimate of a faded acceptance errs high
    assert gaps[0.002] == PROBE_EVERY and gaps[0.08] >= 4 * PROBE_EVERY, gaps


def test_adapts_when_acceptance_changes() -> None:
    """Prose then code: long drafts while they are accepted, shorter and shorter ones once they start to
    fail (the evidence of the long accepted rounds fades at ``decay`` per drafted token) down to plain
    rounds with one-draft probes, long again after."""
    controller = DraftLengthController(MAX)
    rows = evidence(controller)
    assert feed(controller, rows, 15, accept=1.0, draft_step_s=0.02)[-1] == MAX
    failing = feed(controller, rows, 25, accept=0.0, draft_step_s=0.02)
    falling = failing[: failing.index(0)]
    assert falling == sorted(falling, reverse=True) and failing[11] <= 3, failing
    assert max(failing[-8:]) <= 1 and 0 in failing[-8:], failing
    assert feed(controller, rows, 25, accept=1.0, draft_step_s=0.02)[-1] == MAX


def test_acceptance_is_a_decayed_geometric_estimate_with_a_prior() -> None:
    """Each row's accepted drafts over the drafts judged, with the acceptance of every row's drafts so far
    worth ``prior_weight`` drafts (PRIOR_TRIALS before any verdict; 0.5 before any draft was judged)."""
    controller = DraftLengthController(MAX, decay=0.5)
    rows = evidence(controller, 3)
    assert controller.prior_weight() == PRIOR_TRIALS
    assert controller.acceptance(rows) == pytest.approx([0.5] * 3)
    record(controller, 4, [2, 4, 0], rows, 0.04, 0.1)
    # row 0: 2 accepted then a rejection (3 judged); row 1: 4 of 4; row 2: rejected at once (1 judged)
    prior = (0.5 + 6) / (1 + 8)  # 6 of the 8 judged drafts accepted, shrunk to 0.5 by one draft
    assert controller.prior_acceptance() == pytest.approx(prior)
    own = [(2, 3), (4, 4), (0, 1)]
    weight = controller.prior_weight()
    expected = [(weight * prior + passed) / (weight + judged) for passed, judged in own]
    assert controller.acceptance(rows) == pytest.approx(expected)
    record(controller, 4, [4, 0], [rows[0], rows[2]], 0.04, 0.1)  # row 1 finished: not updated
    # the evidence decays per drafted token: 0.5 ** 4 after a round of 4 drafts
    fade = 0.5**4
    prior = (0.5 + 6 * fade + 4) / (1 + 8 * fade + 5)
    assert controller.prior_acceptance() == pytest.approx(prior)
    own = [(2 * fade + 4, 3 * fade + 4), (4, 4), (0, fade + 1)]
    weight = controller.prior_weight()
    expected = [(weight * prior + passed) / (weight + judged) for passed, judged in own]
    assert controller.acceptance(rows) == pytest.approx(expected)


def weight_chosen(rates: list[float], rounds: int = 400) -> float:
    """The prior weight chosen after ``rounds`` rounds in which row r's drafts pass with chance ``rates[r]``
    (each row drafts 4 a round; a seeded draw)."""
    generator = np.random.default_rng(0)
    controller = DraftLengthController(MAX)
    rows = evidence(controller, len(rates))
    for _ in range(rounds):
        passed = generator.random((len(rates), 4)) < np.array(rates)[:, None]
        accepted = [int(np.argmin(np.r_[row, False])) for row in passed]  # drafts before the first rejection
        record(controller, 4, accepted, rows, 0.04, 0.1)
    return controller.prior_weight()


def test_the_prior_weighs_most_where_rows_are_accepted_alike() -> None:
    """Rows whose drafts pass alike differ in their evidence by chance only: the kind's prior predicts each
    best, and the heaviest weight wins. Rows that differ for good (one text repeats, another does not) are
    best predicted by their own evidence, and a light weight wins (the control)."""
    assert weight_chosen([0.8, 0.8]) == PRIOR_WEIGHTS.max()
    assert weight_chosen([0.95, 0.3]) <= 2.0


def test_a_new_row_starts_at_the_acceptance_of_the_rows_before_it() -> None:
    """A request joining is expected to be accepted as its kind's drafts have been, not at a fixed 0.5:
    where drafts pass nine times in ten and a draft step costs half a plain round, a new row drafts in its
    first round; at 0.5 it would not (the control)."""
    controller = DraftLengthController(MAX, decay=0.97)
    old = evidence(controller)
    for n in range(30):
        record(controller, 4, [1 if n % 10 == 0 else 4], old, 4 * 0.05, 0.1 + 4 * 0.01)
        record(controller, 2, [2], old, 2 * 0.05, 0.1 + 2 * 0.01)
        record(controller, 0, [0], old, None, 0.1)
    assert controller.prior_acceptance() > 0.85
    new = evidence(controller)
    assert controller.acceptance(new)[0] == pytest.approx(controller.prior_acceptance())
    assert controller.plan(new, 100)[0] > 0
    controller.prior_acceptance = lambda: 0.5
    assert controller.plan(new, 100)[0] == 0


def test_per_position_acceptance_is_shrunk_to_the_pooled_rate() -> None:
    """p_ri counts the rounds that reached draft i and accepted it, with the row's pooled rate worth
    POSITION_SHRINK trials; drafts never reached take the pooled rate."""
    controller = DraftLengthController(4, decay=1.0)
    rows = evidence(controller)
    record(controller, 3, [0], rows, 0.03, 0.1)  # the first draft rejected
    record(controller, 3, [3], rows, 0.03, 0.1)  # all three accepted
    prior = (0.5 + 3) / (1 + 4)  # this row's drafts are all the kind's so far: 3 of 4 accepted
    weight = controller.prior_weight()
    pooled = (weight * prior + 3) / (weight + 4)
    assert controller.acceptance(rows)[0] == pytest.approx(pooled)
    expected = [
        (POSITION_SHRINK * pooled + passed) / (POSITION_SHRINK + reached)
        for passed, reached in [(1, 2), (1, 1), (1, 1)]
    ]
    assert controller.position_acceptance(rows)[0] == pytest.approx(expected + [pooled])


def test_bursty_acceptance_drafts_longer_than_a_single_rate_would() -> None:
    """Half the rounds reject their first draft, the others accept every draft: one pooled per-token rate
    (about 0.8) makes long drafts look wasteful, but a draft that got past its first token is always
    accepted, and the controller sees it."""
    controller = DraftLengthController(MAX, decay=1.0)
    rows = evidence(controller)
    for n in range(20):
        record(controller, 6, [0 if n % 2 else 6], rows, 6 * 0.02, 0.10 + 6 * 0.005)
    record(controller, 2, [0], rows, 2 * 0.02, 0.11)  # a second length, so the verify slope is known
    position = controller.position_acceptance(rows)[0]
    assert position[0] < 0.6 and position[1:6].min() > 0.9
    p = controller.acceptance(rows)[0]
    time = controller.round_time(1)
    single_rate = int(np.argmax([(1 - p ** (g + 1)) / (1 - p) / time[g] for g in range(MAX + 1)]))
    assert controller.plan(rows, 100)[0] > single_rate


def test_short_drafts_do_not_starve_the_estimate() -> None:
    """Evidence decays per drafted token, not per round: rounds of one draft keep as many drafts in view as
    rounds of eight, so the prior does not pull the estimate of a short-drafting row down."""
    short, long = DraftLengthController(MAX), DraftLengthController(MAX)
    short_row, long_row = evidence(short), evidence(long)
    for _ in range(80):
        record(short, 1, [1], short_row, 0.01, 0.1)
    for _ in range(10):
        record(long, 8, [8], long_row, 0.08, 0.1)
    assert short.acceptance(short_row)[0] == pytest.approx(long.acceptance(long_row)[0], abs=0.01)
    assert short.acceptance(short_row)[0] > 0.95


def test_cost_model_is_fitted_from_the_rounds() -> None:
    controller = DraftLengthController(MAX)
    rows = evidence(controller)
    record(controller, 2, [2], rows, 0.02, 0.11)
    record(controller, 2, [1], rows, 0.02, 0.11)
    assert controller.costs.verify.cost(1) == pytest.approx((0.11, 0.0))  # one draft length seen: no slope yet
    assert controller.drafting.at(1) == pytest.approx((0.0, 0.01))  # and drafting all per token
    record(controller, 6, [1], rows, 0.06, 0.13)
    record(controller, 0, [0], rows, 0.0, 0.10)
    assert controller.costs.verify.cost(1) == pytest.approx((0.10, 0.005))
    assert controller.drafting.at(1) == pytest.approx((0.0, 0.01))


def test_costs_are_fitted_per_number_of_rows_and_interpolated_between_them() -> None:
    """A round over more rows costs more: each number of rows has its own lines; a number never observed takes
    the line of the nearest observed ones, interpolated (extrapolated past them); a round whose verify pass
    has more rows than draft pays the draft at its own rows and the verify at the pass's."""
    controller = DraftLengthController(MAX)
    verify, drafting = controller.costs.verify, controller.drafting
    assert verify.cost(3) == (0.0, 0.0) and drafting.at(3) == (0.0, 0.0)  # nothing observed yet
    for rows, (a, b) in {1: (0.10, 0.002), 4: (0.16, 0.008)}.items():
        for gamma in (1, 3):
            verify.add(rows, gamma, a + b * gamma)
            drafting.add(rows, gamma, 0.01 * rows * gamma)
    assert verify.cost(1) == pytest.approx((0.10, 0.002)) and verify.cost(4) == pytest.approx((0.16, 0.008))
    assert verify.cost(2) == pytest.approx((0.12, 0.004))  # a third of the way from 1 row to 4
    assert verify.cost(8) == pytest.approx((0.24, 0.016))  # extrapolated past the largest count
    assert drafting.at(2) == pytest.approx((0.0, 0.02))
    (d, c), (a, b) = drafting.at(1), verify.cost(4)
    assert controller.round_time(1, PassContext(4)) == pytest.approx(
        [a] + [d + g * (c + b) + a for g in range(1, MAX + 1)]
    )


def test_a_fixed_drafting_cost_per_round_is_separated_from_the_per_token_cost() -> None:
    """Feeding the draft what it lacks costs a round the same whatever it drafts: lumping it into the
    per-token cost would make long drafts look dearer than they are. Plain rounds do not pay it."""
    controller = DraftLengthController(MAX)
    rows = evidence(controller)
    for gamma in (1, 2, 4, 1, 2, 4):
        record(controller, gamma, [gamma], rows, 0.004 + 0.01 * gamma, 0.1 + 0.002 * gamma)
    (d, c), (a, b) = controller.drafting.at(1), controller.costs.verify.cost(1)
    assert (d, c, a, b) == pytest.approx((0.004, 0.01, 0.1, 0.002))
    assert controller.round_time(1) == pytest.approx([a] + [d + g * (c + b) + a for g in range(1, MAX + 1)])


def test_choice_maximises_expected_tokens_per_second() -> None:
    """The plan is the argmax over g and over the j rows gaining most of the pass's tokens
    (sum_r 1 + [r drafts] (p_r1 + p_r1 p_r2 + ...)) / time(j, g), written out here."""
    controller = DraftLengthController(MAX)
    rows = evidence(controller, 2)
    feed(controller, rows, 3, accept=0.5, draft_step_s=0.03)
    record(controller, 4, [4, 0], rows, 0.12, 0.12)  # the rows now differ
    p = controller.position_acceptance(rows)

    def tokens(r: int, g: int) -> float:
        return 1 + sum(np.prod(p[r, :i]) for i in range(1, g + 1))

    def best(picked: list[int]) -> list[int]:
        options = {}
        subsets = [picked[:j] for j in range(1, len(picked) + 1)] + [picked[1:2]] * (len(picked) > 1)
        for drafting in subsets:
            time = controller.round_time(len(drafting))
            for g in range(MAX + 1):
                rate = sum(tokens(r, g if r in drafting else 0) for r in picked) / time[g]
                options[(tuple(drafting) if g else (), g)] = rate
        drafting, g = max(options, key=options.__getitem__)
        return [g if r in drafting else 0 for r in picked]

    assert controller.plan(rows, 100) == best([0, 1])
    assert controller.plan(rows[:1], 100) == best([0])


def test_a_full_pass_drafts_less_than_its_rows_alone_would() -> None:
    """What drafting adds is weighed against the whole pass's tokens: three rows that would draft alone draft
    nothing beside five plain rows in a pass where every draft widens an expensive verify."""
    controller = DraftLengthController(MAX, decay=1.0)
    rows = evidence(controller, 3)
    for gamma in (1, 2, 4, 1, 2, 4):
        record(controller, gamma, [gamma // 2] * 3, rows, 0.002 + 0.004 * gamma, 0.03 + 0.004 * gamma, pass_rows=3)
        controller.costs.verify.add(8, gamma, 0.04 + 0.012 * gamma)
    controller.costs.verify.add(8, 0, 0.04)
    assert max(controller.plan(rows, 100)) > 0  # alone
    assert controller.plan(rows, 100, PassContext(8, tokens=5.0)) == [0, 0, 0]


def test_a_fixed_cost_per_round_makes_drafting_pay_sooner() -> None:
    """A row accepting 60% of its drafts beside a cheap pass does best plain; when every round also costs a
    fixed 30 ms (a prefill chunk's weight read follows it), a round that yields more tokens spreads that
    cost thinner, and the same row drafts. With no fixed cost the plan is the plain one (control)."""
    controller = DraftLengthController(MAX, decay=1.0)
    rows = evidence(controller)
    for gamma in (1, 2, 4, 1, 2, 4):
        record(controller, gamma, [0], rows, 0.012 * gamma, 0.02 + 0.002 * gamma)
    rows[0].passed[:], rows[0].reached[:] = 60.0, 100.0
    assert controller.plan(rows, 100, PassContext(1)) == [0]
    assert controller.plan(rows, 100, PassContext(1, fixed_s=0.03))[0] > 0
    rates = controller.rates(rows, PassContext(1, fixed_s=0.03))
    assert rates[1] == pytest.approx(controller.row_tokens(rows)[0] / (controller.round_time(1) + 0.03))


def test_rows_whose_drafts_do_not_pay_draft_none_beside_rows_whose_do() -> None:
    """In one plan, a row whose drafts are always accepted drafts and a row whose drafts are always rejected
    does not: its drafts would cost the draft's steps for it and add nothing."""
    controller = DraftLengthController(MAX, decay=1.0)
    rows = evidence(controller, 2)
    for gamma in (2, 4, 2, 4, 2, 4):
        record(controller, gamma, [gamma, 0], rows, 0.01 + 0.01 * gamma, 0.05 + 0.002 * gamma)
        controller.drafting.add(1, gamma, 0.005 + 0.005 * gamma)  # one row drafts at half the cost
    lengths = controller.plan(rows, 100)
    assert lengths[0] > 0 and lengths[1] == 0
    assert controller.plan(rows[::-1], 100) == lengths[::-1]  # whatever the rows' order


def left_out_row_plans(later_accept: bool, measure_left_out: bool = True) -> list[list[int]]:
    """100 plans over two rows after rounds where row 0's drafts all passed and row 1's were all rejected;
    from then on row 1's drafts pass if ``later_accept``. Drafting costs 5 ms a row and 5 ms a row per token,
    verifying 50 ms and 2 ms per token of the widest row. ``measure_left_out`` False: without ``overdue``."""
    controller = DraftLengthController(MAX)
    if not measure_left_out:
        controller.overdue = lambda *args: set()
    rows = evidence(controller, 2)
    for gamma in (2, 4) * 3:
        record(controller, gamma, [gamma, 0], rows, 0.01 + 0.01 * gamma, 0.05 + 0.002 * gamma)
        controller.drafting.add(1, gamma, 0.005 + 0.005 * gamma)
    plans = []
    for _ in range(100):
        lengths = controller.plan(rows, 100)
        plans.append(lengths)
        drafting = sum(g > 0 for g in lengths)
        draft_s = 0.005 * drafting * (1 + max(lengths)) if drafting else None
        accepted = [lengths[0], lengths[1] if later_accept else 0]
        record(controller, lengths, accepted, rows, draft_s, 0.05 + 0.002 * max(lengths))
    return plans


def test_a_row_left_out_while_others_draft_is_measured_now_and_then() -> None:
    """A row whose drafts were rejected drafts none beside a row whose drafts pass, but not for ever: once it
    has sat out as many rounds as a probe would wait, it drafts beside the other and is judged again. Drafts
    that now pass keep it drafting; drafts still rejected cost a few rounds. Without that, a row left out is
    judged again only once its old evidence has faded into the prior (here after more than 80 rounds)."""
    for later_accept in (False, True):
        plans = left_out_row_plans(later_accept)
        assert all(p[0] > 0 for p in plans[1:])  # row 0 keeps drafting
        row_1 = [p[1] > 0 for p in plans]
        assert not row_1[0] and any(row_1[:30]), (later_accept, plans)
        if later_accept:
            assert all(row_1[-50:]), plans
        else:  # measured at a steady interval, longer than PROBE_EVERY as its drafts would cost much
            gaps = np.diff(np.flatnonzero(row_1))
            assert gaps.min() > 2 * PROBE_EVERY and gaps.max() - gaps.min() <= 1 and sum(row_1) <= 10, plans
    assert not any(p[1] for p in left_out_row_plans(True, measure_left_out=False)[:80])  # the control


def test_drafts_no_wider_than_the_pass_cost_no_verify() -> None:
    """Where other rows make the pass wide anyway, drafting up to that width costs only the draft's steps."""
    controller = DraftLengthController(MAX, decay=1.0)
    controller.prior_weight = lambda: PRIOR_TRIALS  # the acceptance this test's costs were set against
    rows = evidence(controller)
    for gamma in (1, 2, 4, 1, 2, 4):
        record(controller, gamma, [0], rows, 0.0005 * gamma, 0.05 + 0.02 * gamma)
    (d, c), (a, b) = controller.drafting.at(1), controller.costs.verify.cost(1)
    assert controller.round_time(1, PassContext(1, width=4)) == pytest.approx(
        [a + 4 * b] + [d + c * g + a + b * max(g, 4) for g in range(1, MAX + 1)]
    )
    assert controller.plan(rows, 100) == [0]  # a wider pass costs more than the draft adds
    assert controller.plan(rows, 100, PassContext(1, width=4)) in ([1], [2], [3], [4])


def test_a_packed_pass_charges_a_row_its_own_drafts() -> None:
    """Where the engine packs the rows' tokens, j rows drafting g beside other rows' D drafts make the pass
    compute (D + j g) / n drafts per row, not max(g, w): one row drafting 4 in a pass of 4 rows costs a
    quarter of what it costs padded."""
    controller = DraftLengthController(MAX, decay=1.0)
    for gamma in (1, 3):
        controller.costs.verify.add(4, gamma, 0.02 + 0.04 * gamma)
        controller.drafting.add(1, gamma, 0.002 * gamma)
    (d, c), (a, b) = controller.drafting.at(1), controller.costs.verify.cost(4)
    g = np.arange(MAX + 1)
    packed = PassContext(4, drafts=2, width=2, packed=True)
    assert controller.round_time(1, packed) == pytest.approx((g > 0) * (d + c * g) + a + b * (2 + g) / 4)
    padded = PassContext(4, drafts=2, width=2)
    assert controller.round_time(1, padded) == pytest.approx((g > 0) * (d + c * g) + a + b * np.maximum(g, 2))


def one_row_accepting_70_percent_beside_three(
    pass_width: float,
) -> tuple[DraftLengthController, list[AcceptanceEvidence]]:
    """A controller that timed passes of 4 rows and one row's drafting, and that row's evidence: 70% of its
    drafts accepted; its one observed round verified ``pass_width`` drafts a row."""
    controller = DraftLengthController(MAX, decay=1.0)
    rows = evidence(controller)
    for gamma in (1, 4, 1, 4):
        controller.costs.verify.add(4, gamma, 0.03 + 0.006 * gamma)
        controller.drafting.add(1, gamma, 0.001 + 0.001 * gamma)
    record(controller, 4, [4], rows, 0.005, 0.054, pass_rows=4, pass_width=pass_width)
    rows[0].passed[:], rows[0].reached[:] = 70.0, 100.0
    return controller, rows


def test_a_row_drafts_beside_plain_rows_when_the_pass_is_packed() -> None:
    """A row accepting 70% of its drafts, in a pass of 4 rows whose other three decode plainly: padded, each of
    its drafts widens all four rows and drafting does not pay; packed, it pays only for its own tokens and
    drafts (the padded plan is the control)."""
    controller, rows = one_row_accepting_70_percent_beside_three(pass_width=4)
    assert controller.plan(rows, 100, PassContext(4, tokens=3.0)) == [0]
    assert controller.plan(rows, 100, PassContext(4, tokens=3.0, packed=True))[0] > 0


def test_passes_carrying_a_prefill_chunk_are_priced_by_their_own_lines() -> None:
    """A row accepting 70% of its drafts drafts in a pass of 4 packed rows. Passes carrying a chunk take the
    other passes' lines until some were timed at that number of rows; once they show drafts costing five
    times as much there, the row stops drafting beside a chunk and still drafts without one (the control)."""
    controller, rows = one_row_accepting_70_percent_beside_three(pass_width=1.75)
    plain, chunk = PassContext(4, tokens=3.0, packed=True), PassContext(4, tokens=3.0, packed=True, chunk=True)
    assert controller.round_time(1, chunk) == pytest.approx(controller.round_time(1, plain))
    assert controller.plan(rows, 100, chunk)[0] > 0
    lines = controller.costs.verify.cost(4), controller.costs.verify.plain_cost(4)
    for width in (0.25, 1.0, 0.25, 1.0):
        record(
            controller,
            0,
            [0],
            evidence(controller),
            None,
            0.03 + 0.03 * width,
            pass_rows=4,
            chunk=True,
            pass_width=width,
        )
    record(controller, 0, [0], evidence(controller), None, 0.03, pass_rows=4, pass_width=0.0, chunk=True)
    assert controller.costs.verify_beside_chunk.cost(4) == pytest.approx((0.03, 0.03))
    assert controller.costs.verify_beside_chunk.plain_cost(4) == pytest.approx(0.03)
    assert (
        controller.costs.verify.cost(4),
        controller.costs.verify.plain_cost(4),
    ) == lines  # the others' lines are kept
    assert controller.plan(rows, 100, chunk) == [0]
    assert controller.plan(rows, 100, plain)[0] > 0


def test_a_packed_stop_rule_charges_only_the_rows_still_drafting() -> None:
    """Padded, one more draft widens every row of the pass: it costs rate * (c + b) however many rows still
    draft. Packed, the verify part is b per row of the pass, times the rows still drafting: a lone row still
    drafting in a pass of 4 keeps going where the padded rule stops."""
    controller = DraftLengthController(MAX, decay=1.0)
    rows = evidence(controller, 2)
    for gamma in (2, 4, 2, 4):
        confidence = np.tile([0.99, 0.99, 0.6, 0.6], (2, 1))[:, :gamma]
        record(controller, gamma, [min(gamma, 3)] * 2, rows, 0.0002 * gamma, 0.02 + 0.003 * gamma, confidence)
    slots = [0, 1]
    padded = controller.stop_rule(slots, rows, PassContext(4))
    packed = controller.stop_rule(slots, rows, PassContext(4, packed=True))
    assert padded.verify_share is None and packed.verify_share == pytest.approx(1 / 4)
    one_left = np.array([True, False])
    for rule in (padded, packed):
        rule(torch.tensor([0.99, 0.99]), slots, np.array([True, True]))
    padded_stops = padded(torch.tensor([0.6, 0.6]), slots, one_left)
    packed_stops = packed(torch.tensor([0.6, 0.6]), slots, one_left)
    assert padded.gain.sum() < padded.draft_cost + padded.verify_cost and padded_stops
    assert packed.gain.sum() > packed.draft_cost + packed.verify_cost / 4 and not packed_stops


def test_a_pass_without_drafts_costs_its_own_mean() -> None:
    """Where the first draft in a pass costs far more than the next ones (ONNX Runtime's attention takes a
    slower path for several tokens a row), plain passes are their own mean and the line is fitted through
    the passes with drafts only: one draft in a pass of 8 rows is priced at what it costs (control: one
    line through every pass prices a plain pass 6 ms too dear, and a pass with one draft 4 ms too cheap)."""
    controller = DraftLengthController(MAX, decay=1.0)
    measured = {0: 0.032, 1: 0.045, 2: 0.047, 4: 0.050, 8: 0.059}  # a pass of 8 rows after 450 tokens, by x
    for x, seconds in measured.items():
        controller.costs.verify.add(8, x, seconds)
    time = controller.round_time(1, PassContext(8, width=0))  # one row drafting g in a padded pass: x = g
    assert time[0] == pytest.approx(0.032) and time[1] == pytest.approx(0.045, abs=0.002)
    single = DecayedLine(1.0, through_origin=False)
    for x, seconds in measured.items():
        single.add(x, seconds)
    intercept, slope = single.coefficients()
    assert intercept > 0.032 + 0.005 and intercept + slope < 0.045 - 0.003


def test_rounds_are_timed_at_the_pass_width_and_the_drafting_rows() -> None:
    """The verify pass is timed against its widest row's drafts, drafting against the rows that drafted; a
    round whose drafting seconds include other rows' drafting times only the pass."""
    controller = DraftLengthController(MAX, decay=1.0)
    rows = evidence(controller, 3)
    record(controller, [2, 0, 0], [1, 0, 0], rows, 0.02, 0.3, pass_rows=5, pass_width=6)
    record(controller, [0, 0, 0], [0, 0, 0], rows, None, 0.1, pass_rows=5, pass_width=0)
    record(controller, [1, 0, 0], [1, 0, 0], rows, 0.01, 0.25, pass_rows=5, pass_width=1)
    assert controller.costs.verify.cost(5) == pytest.approx((0.24, 0.01))  # passes with drafts: x = 1 and 6
    assert controller.costs.verify.plain_cost(5) == pytest.approx(0.1)  # the pass without: its own
    assert set(controller.drafting.lines) == {1} and controller.drafting.at(1) == pytest.approx((0.0, 0.01))
    record(controller, [4, 4, 0], [0, 0, 0], rows, None, 0.1, pass_rows=5, pass_width=4)
    assert set(controller.drafting.lines) == {1}  # its drafting seconds were not its own


def test_confidence_is_calibrated_per_bin_on_the_drafts_the_verifier_judged() -> None:
    """Only judged drafts count (those after a rejection were never judged), binned by the draft's
    confidence; each bin's acceptance is shrunk to the bin's middle with CALIBRATION_SHRINK trials."""
    controller = DraftLengthController(MAX, decay=1.0)
    confidence = np.array([[0.99, 0.2, 0.8, 0.8], [0.6, 0.95, 0.99, 0.1]])
    record(controller, 4, [1, 4], evidence(controller, 2), 0.04, 0.1, confidence)
    # row 0: 0.99 accepted, 0.2 rejected, the rest never judged; row 1: all four judged and accepted
    bins = np.searchsorted(CONFIDENCE_BINS, [0.99, 0.2, 0.6, 0.95, 0.99, 0.1], side="right")
    judged, accepted = np.zeros(len(CONFIDENCE_BINS) + 1), np.zeros(len(CONFIDENCE_BINS) + 1)
    np.add.at(judged, bins, 1)
    np.add.at(accepted, bins[[0, 2, 3, 4, 5]], 1)
    assert controller.judged == pytest.approx(judged) and controller.judged_accepted == pytest.approx(accepted)
    expected = (CALIBRATION_SHRINK * CONFIDENCE_PRIOR + accepted) / (CALIBRATION_SHRINK + judged)
    assert controller.calibrated_acceptance() == pytest.approx(expected)


def test_a_draft_reporting_confidence_is_asked_for_the_limit_and_prompt_lookup_for_gamma() -> None:
    """Once the draft reports its confidence, a drafting round asks for every draft it may use (the stop
    rule ends it); a draft without confidence gets the chosen length; plain rounds stay plain."""
    with_confidence, without = DraftLengthController(MAX), DraftLengthController(MAX)
    confident_row, row = evidence(with_confidence), evidence(without)
    for _ in range(6):
        record(with_confidence, 2, [1], confident_row, 0.02, 0.1 + 0.002 * 2, np.array([[0.9, 0.5]]))
        record(without, 2, [1], row, 0.02, 0.1 + 0.002 * 2)
    record(without, 1, [1], row, 0.01, 0.1 + 0.002)
    record(with_confidence, 1, [1], confident_row, 0.01, 0.1 + 0.002, np.array([[0.9]]))
    chosen = int(np.argmax(without.rates(row)[1]))
    assert 1 <= chosen < MAX
    assert without.plan(row, 100) == [chosen]
    assert with_confidence.plan(confident_row, 100) == [MAX] and with_confidence.plan(confident_row, 5) == [5]
    hopeless = DraftLengthController(MAX)
    hopeless_row = evidence(hopeless)
    feed(hopeless, hopeless_row, 12, accept=0.0, draft_step_s=0.08)
    record(hopeless, 1, [0], hopeless_row, 0.08, 0.1, np.array([[0.9]]))
    assert [0] in [hopeless.plan(hopeless_row, 100) for _ in range(PROBE_EVERY)]


def test_a_probe_drafts_what_was_planned_for_it_and_its_stop_rule_prices_time_at_the_plain_rate() -> None:
    """A draft that reports its confidence is asked for the limit only where drafting pays: a probe (a round
    that drafts although plain rounds win) drafts the length planned for it, and its stop rule counts a
    second at the plain rate, the best there is, so it stops sooner than one priced at the probe's own rate."""
    controller = DraftLengthController(MAX)
    row = evidence(controller)
    for _ in range(3):
        record(controller, 2, [0], row, 0.16, 0.1 + 0.01 * 2, np.array([[0.9, 0.9]]))
        record(controller, 0, [0], row, None, 0.1)
    record(controller, 4, [0], row, 0.32, 0.1 + 0.01 * 4, np.array([[0.9] * 4]))
    rates = controller.rates(row)
    assert rates[0, 0] == rates.max()  # drafting does not pay
    plans = [controller.plan(row, 100) for _ in range(controller.probe_interval(rates))]
    probes = [p for p in plans if p != [0]]
    assert len(probes) == 1 and probes[0] == [1 + int(np.argmax(rates[1, 1:]))] and probes[0][0] < MAX, plans
    (_, c), (_, b) = controller.drafting.at(1), controller.costs.verify.cost(1)
    rule = controller.stop_rule([0], row)
    assert rule.threshold == pytest.approx(rates[0, 0] * (c + b)) and rates[0, 0] > rates[1, 1:].max()


def test_the_stop_rule_weighs_the_next_draft_against_its_cost() -> None:
    """The rule's threshold is the predicted best rate times the per-token cost c + b; after each draft
    token every row's chance of a fully accepted draft is multiplied by its bin's calibrated acceptance, and
    the round ends when the expected tokens of one more draft, sum_r S_r p_r, fall below the threshold."""
    controller = DraftLengthController(MAX, decay=1.0)
    rows = evidence(controller, 2)
    for gamma in (2, 4, 2, 4):
        confidence = np.tile([0.99, 0.99, 0.1, 0.1], (2, 1))[:, :gamma]
        times = 0.003 + 0.01 * gamma, 0.1 + 0.002 * gamma
        record(controller, gamma, [min(gamma, 2)] * 2, rows, *times, confidence)
    slots, both = [0, 1], np.array([True, True])
    rule = controller.stop_rule(slots, rows)
    (_, c), (_, b) = controller.drafting.at(2), controller.costs.verify.cost(2)
    assert rule.threshold == pytest.approx(controller.rates(rows).max() * (c + b))
    calibrated, pooled = controller.calibrated_acceptance(), controller.acceptance(rows)
    confident, unconfident = calibrated[-1], calibrated[0]
    assert confident > 0.9 > 0.5 > unconfident  # the 0.99 drafts were always accepted, the 0.1 ones never
    assert not rule(torch.tensor([0.99, 0.99]), slots, both)
    assert rule.gain == pytest.approx(pooled * confident)
    assert rule(torch.tensor([0.1, 0.1]), slots, both)  # unconfident in both rows: another draft no longer pays
    one_row = controller.stop_rule([0], rows[:1])  # a finished row adds nothing
    one_row(torch.tensor([0.99, 0.99]), slots, both)
    assert one_row.gain == pytest.approx([pooled[0] * confident, 0.0])
    stopped = controller.stop_rule(slots, rows)  # nor does a row that has stopped drafting
    stopped(torch.tensor([0.99, 0.99]), slots, np.array([True, False]))
    assert stopped.gain == pytest.approx([pooled[0] * confident, 0.0])


def test_no_stop_before_the_first_round_was_timed() -> None:
    controller = DraftLengthController(MAX)
    rule = controller.stop_rule([0], evidence(controller))
    assert rule.threshold == 0 and not rule(torch.tensor([0.01]), [0], np.array([True]))


def test_deterministic_given_its_observations() -> None:
    controllers = [DraftLengthController(MAX) for _ in range(2)]
    runs = [feed(controller, evidence(controller), 30, accept=0.6, draft_step_s=0.02) for controller in controllers]
    assert runs[0] == runs[1]


# --- a fixed cut-off on the draft's confidence ---------------------------------------------------------------


@pytest.fixture(scope="module")
def drafters(make_checkpoint) -> dict[str, ModelDrafter]:
    """Drafts whose distributions are nearly flat (unconfident), sharply peaked, and in between."""
    paths = {
        "flat": make_checkpoint(family="llama", seed=21, logit_scale=0.05),
        "peaked": make_checkpoint(family="llama", seed=22, logit_scale=200.0),
        "medium": make_checkpoint(family="llama", seed=23),
    }
    return {
        name: ModelDrafter(TorchEngine.from_checkpoint(load_checkpoint(path), max_context=64))
        for name, path in paths.items()
    }


def draft_round(
    drafter: ModelDrafter, prompts: list[list[int]], num_tokens: int, stop_rule: StopRule, params: list[SamplingParams]
) -> Draft:
    """One round of drafts after ``prompts`` (the draft prefilled with all but their last token), row i sampled
    with ``params[i]`` and the round ended by ``stop_rule``."""
    slots = list(range(len(prompts)))
    drafter.reserve(len(prompts))
    for slot in slots:
        drafter.admit(slot)
    try:
        drafter.prefill(slots, [p[:-1] for p in prompts])
        sampler = BatchSampler(params, torch.device("cpu"))
        plan = DraftPlan([Part(MODEL)] * len(prompts), {MODEL: stop_rule})
        return drafter.propose(slots, prompts, [num_tokens] * len(prompts), sampler, plan)
    finally:
        for slot in slots:
            drafter.release(slot)


def propose(drafter: ModelDrafter, prompts: list[list[int]], num_tokens: int, threshold: float, params=None) -> int:
    """Drafted tokens of one round after ``prompts`` with a fixed confidence cut-off at ``threshold``."""
    params = params or SamplingParams()
    draft = draft_round(drafter, prompts, num_tokens, confidence_below(threshold), [params] * len(prompts))
    assert draft.token_ids.shape[0] == len(prompts)
    assert draft.num_drafts.tolist() == [draft.num_tokens] * len(prompts)
    if draft.probs is not None:
        assert draft.probs.shape[:2] == draft.token_ids.shape
    return draft.num_tokens


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
def test_early_stop_shortens_an_unconfident_round(drafters, params) -> None:
    prompts = [[4, 5, 6], [7, 8, 9, 10]]
    assert propose(drafters["flat"], prompts, 5, threshold=0.3, params=params) == 1  # the token is kept
    assert propose(drafters["flat"], prompts, 5, threshold=0.0, params=params) == 5
    assert propose(drafters["peaked"], prompts, 5, threshold=0.3, params=params) == 5


def test_a_sampled_draft_token_is_judged_by_the_distribution_it_was_drawn_from(drafters) -> None:
    """A sampled row's confidence in each drafted token is its probability under the warped q the row drew it
    from (acceptance, min(1, p/q), is in q); a greedy row's, beside it, the softmax of the draft's logits at
    the token (control: at temperature 0.5 the sampled row's q is not that softmax)."""
    drafter = drafters["medium"]
    prompts = [[4, 5, 6], [7, 8, 9, 10]]
    with torch.no_grad():
        first = torch.cat([drafter.engine.prefill(torch.tensor([p]), torch.tensor([len(p)])) for p in prompts])
    drafter.engine.release(0)  # the slot the reference logits were computed in
    seen = []

    def never_stop(confidence: torch.Tensor, slots, still: np.ndarray) -> bool:
        seen.append(confidence.clone())
        return False

    draft = draft_round(drafter, prompts, 3, never_stop, [SamplingParams(temperature=0.5, seed=1), SamplingParams()])
    drawn_q = draft.probs[0].gather(1, draft.token_ids[0].unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(draft.confidence[0], drawn_q)
    torch.testing.assert_close(torch.stack(seen, 1), draft.confidence)
    softmax = first.float().softmax(-1)
    greedy_token = int(draft.token_ids[1, 0])
    assert greedy_token == int(softmax[1].argmax())
    torch.testing.assert_close(draft.confidence[1, 0], softmax[1, greedy_token], rtol=1e-4, atol=1e-5)
    sampled_token = int(draft.token_ids[0, 0])
    assert abs(float(draft.confidence[0, 0]) - float(softmax[0, sampled_token])) > 1e-3


def test_early_stop_needs_every_row_to_be_unconfident(drafters) -> None:
    """Greedy drafts: the draft's confidence is its top probability. With a threshold between two rows'
    confidences, the unconfident row alone stops after one token; beside the confident row it does not."""
    drafter = drafters["medium"]
    candidates = [[4, 5, 6], [7, 8, 9, 10], [11, 3], [20, 21, 22, 23, 24], [30, 12, 5]]
    confidence = []
    for prompt in candidates:
        logits = drafter.engine.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]))
        confidence.append(float(logits.softmax(-1).max()))
    drafter.engine.release(0)  # the slot the drafter follows prompts in
    low, high = int(np.argmin(confidence)), int(np.argmax(confidence))
    assert confidence[high] > confidence[low]
    threshold = (confidence[low] + confidence[high]) / 2
    assert confidence[high] - confidence[low] > 0.05, confidence
    assert propose(drafter, [candidates[low]], 4, threshold) == 1
    assert propose(drafter, [candidates[high]], 4, threshold) >= 2
    assert propose(drafter, [candidates[low], candidates[high]], 4, threshold) >= 2


def test_auto_stops_early_and_fixed_gamma_never_does(drafters, make_checkpoint) -> None:
    """Through the decoder: "auto" with the flat draft drafts one token per round (the cut-off), with the
    cut-off disabled it drafts more; a fixed gamma drafts exactly gamma whatever the threshold."""
    target = TorchEngine.from_checkpoint(load_checkpoint(make_checkpoint(family="llama")), max_context=64)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompt = [4, 5, 6, 7]

    def decoder(threshold: float) -> SpeculativeDecoder:
        return SpeculativeDecoder(target, drafters["flat"], draft_confidence_threshold=threshold)

    cut = decoder(1.0).generate(prompt, params, num_draft_tokens=AUTO).stats
    assert cut.drafted_tokens > 0 and len(cut.drafted_per_position) == 1, cut.drafted_per_position
    uncut = decoder(0.0).generate(prompt, params, num_draft_tokens=AUTO).stats
    assert uncut.drafted_per_position[0] > 0 and len(uncut.drafted_per_position) >= FIRST_DRAFT_LENGTH
    fixed = decoder(1.0).generate(prompt, params, num_draft_tokens=3).stats
    assert len(fixed.drafted_per_position) == 3 and fixed.drafted_per_position[2] >= fixed.rounds - 3
    unlimited = decoder(0.0).generate(prompt, params, num_draft_tokens=3).stats
    assert fixed.drafted_per_position == unlimited.drafted_per_position


def test_prompt_lookup_ignores_the_threshold(drafters) -> None:
    """A probability threshold cuts a model draft's rounds; prompt lookup's rounds, which have no probability
    to cut at, get no stop rule and draft the length auto chooses (control: without a threshold they get
    auto's cost-aware stop)."""

    def stop_rules(drafter, threshold: float | None) -> dict[str, StopRule]:
        planner = DraftPlanner(drafter, MAX, 64, Costs(packed=False), threshold)
        row = Request.create(0, [5, 6, 5, 6, 5], SamplingParams(max_new_tokens=16), AUTO, 0.0, None, frozenset(), print)
        row.slot = 0
        plan = planner.plan([row])
        assert plan.limits[0] > 0  # the row drafts in this round
        return plan.draft.stop_rules

    assert stop_rules(PromptLookupDrafter(), 0.5) == {} and LOOKUP in stop_rules(PromptLookupDrafter(), None)
    rule = stop_rules(drafters["medium"], 0.5)[MODEL]
    slots, drafting = [0], np.array([True])
    assert rule(torch.tensor([0.4]), slots, drafting) and not rule(torch.tensor([0.6]), slots, drafting)


def test_auto_reserves_the_engine_limit_in_the_context_check(make_checkpoint) -> None:
    decoder = SpeculativeDecoder.from_pretrained(make_checkpoint(family="llama"), "ngram", max_context=32)
    assert decoder.max_auto_draft == AUTO_MAX_DRAFT_TOKENS  # the PyTorch engine has no verify limit
    fits = SamplingParams(max_new_tokens=32 - 3 - AUTO_MAX_DRAFT_TOKENS, ignore_eos=True)
    assert len(decoder.generate([4, 5, 6], fits, num_draft_tokens=AUTO).token_ids) == fits.max_new_tokens
    with pytest.raises(ValueError, match=r"\+ up to 8 draft tokens need"):
        decoder.generate([4, 5, 6], SamplingParams(max_new_tokens=fits.max_new_tokens + 1), num_draft_tokens=AUTO)


@pytest.mark.parametrize("value", ["Auto", "5", 2.0, -1, True, None])
def test_bad_draft_lengths_are_refused(make_checkpoint, value) -> None:
    decoder = SpeculativeDecoder.from_pretrained(make_checkpoint(family="llama"), "ngram", max_context=48)
    if value is not None:
        with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 0 or 'auto'"):
            decoder.generate("ab", num_draft_tokens=value)
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 0 or 'auto'"):
        SpeculativeDecoder(decoder.target, decoder.drafter, num_draft_tokens=value)


def test_bad_confidence_threshold_is_refused(make_checkpoint) -> None:
    target = TorchEngine.from_checkpoint(load_checkpoint(make_checkpoint(family="llama")), max_context=48)
    with pytest.raises(ValueError, match="draft_confidence_threshold must be in"):
        SpeculativeDecoder(target, PromptLookupDrafter(), draft_confidence_threshold=1.5)
