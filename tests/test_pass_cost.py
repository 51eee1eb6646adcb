"""The online cost model of a target pass: fixed, per row, per row of a pass with a wide row, per computed
token, and per attended position."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_trt.costs import PassCost, pass_features

FIXED, PER_ROW, PER_WIDE_ROW, PER_TOKEN, PER_ATTENDED = 0.012, 0.002, 0.0015, 0.0012, 6e-7  # about SmolLM2-135M
TRUE = [FIXED, PER_ROW, PER_WIDE_ROW, PER_TOKEN, PER_ATTENDED]


def true_seconds(cached: list[int], widths: list[int], packed: bool = True) -> float:
    return float(pass_features(cached, widths, packed) @ TRUE)


def test_features_count_the_computed_tokens_and_the_context_each_row_attends_to() -> None:
    # rows holding 100 and 0 taking 8 and 2 new tokens: packed, 10 tokens computed, 8 * 108 + 2 * 2 attended
    assert pass_features([100, 0], [8, 2], packed=True).tolist() == [1.0, 2.0, 2.0, 10.0, 8 * 108 + 2 * 2]
    # padded, both rows compute 8: 16 tokens, 8 * 108 + 8 * 8 attended
    assert pass_features([100, 0], [8, 2], packed=False).tolist() == [1.0, 2.0, 2.0, 16.0, 8 * 108 + 8 * 8]
    # one token a row: no wide rows
    assert pass_features([100, 0], [1, 1], packed=True).tolist() == [1.0, 2.0, 0.0, 2.0, 101 + 1]


def test_nothing_timed_predicts_nothing_and_bounds_no_chunk() -> None:
    cost = PassCost(decay=0.95, packed=True)
    assert cost.coefficients().tolist() == [0.0] * 5
    assert cost.longest_chunk(0, 0.05) is None


def test_the_fit_recovers_every_cost_from_verify_passes_and_chunks() -> None:
    cost = PassCost(decay=0.95, packed=True)
    passes = [([0], [16]), ([0], [64]), ([300], [16]), ([800], [48]), ([1450], [16]), ([1450], [48])]
    passes += [([200, 200, 200], [5, 1, 1]), ([40, 90], [3, 3]), ([500] * 4, [1] * 4), ([60, 300], [1, 1])]
    for cached, widths in passes:
        cost.add(cached, widths, true_seconds(cached, widths))
    assert cost.coefficients() == pytest.approx(TRUE, rel=1e-6)
    # a chunk riding in a pass of two rows decoding one token each makes all three rows wide
    cached, widths = [300, 400, 1000], [1, 1, 32]
    added = true_seconds(cached, widths) - true_seconds(cached[:2], widths[:2])
    assert cost.added_seconds(cached, widths, 1) == pytest.approx(added)
    assert added == pytest.approx(PER_ROW + 3 * PER_WIDE_ROW + 32 * PER_TOKEN + 32 * 1032 * PER_ATTENDED)


def test_a_chunk_late_in_a_long_prompt_is_shorter_for_the_same_time() -> None:
    """The chunk that fits a time bound shrinks as the prompt's context grows, and takes that time; a model
    of tokens alone gives the early chunk's length at every context, which late in the prompt overruns the
    bound by more than a fifth (negative control). Added to a pass that runs anyway, the fixed cost is not
    the chunk's, and it holds more tokens."""
    cost = PassCost(decay=0.95, packed=True)
    for cached, width in [(0, 16), (0, 64), (300, 16), (800, 48), (1450, 16), (1450, 48), (0, 8)]:
        cost.add([cached], [width], true_seconds([cached], [width]))
        cost.add([cached, 0], [width, 1], true_seconds([cached, 0], [width, 1]))
        cost.add([cached, 0], [1, 1], true_seconds([cached, 0], [1, 1]))
    early, late = cost.longest_chunk(0, 0.06), cost.longest_chunk(1450, 0.06)
    assert late < 0.8 * early
    for cached, width in [(0, early), (1450, late)]:
        assert true_seconds([cached], [width]) <= 0.06 < true_seconds([cached], [width + 1])
    assert true_seconds([1450], [early]) > 1.2 * 0.06
    riding = cost.longest_chunk(1450, 0.06, pass_rows=1)  # beside one row decoding one token
    assert riding > late

    def added(width: int) -> float:
        return cost.added_seconds([0, 1450], [1, width], 1)

    assert added(riding) <= 0.06 < added(riding + 1)


def test_a_coefficient_the_data_would_make_negative_is_dropped() -> None:
    """Passes that got no slower with more context (noise, or a backend whose attention is cheap) fit no
    attention cost rather than a negative one, and the rest is refitted without it."""
    cost = PassCost(decay=1.0, packed=True)
    for cached, width, seconds in [(0, 16, 0.032), (1000, 16, 0.031), (0, 64, 0.09), (1000, 64, 0.089)]:
        cost.add([cached], [width], seconds)
    fixed, per_row, per_wide_row, per_token, per_attended = cost.coefficients()
    assert per_attended == 0.0 and fixed + per_row + per_wide_row > 0
    assert per_token == pytest.approx((0.0895 - 0.0315) / 48, rel=1e-6)


def test_a_single_pass_predicts_itself_and_no_time_fits_no_token() -> None:
    cost = PassCost(decay=0.95, packed=True)
    cost.add([0], [32], 0.05)
    assert cost.seconds([0], [32]) == pytest.approx(0.05)
    assert cost.longest_chunk(0, 0.05) in (31, 32)
    assert cost.longest_chunk(0, 0.0) == 0


def test_a_vanishing_attention_cost_gives_the_linear_answer() -> None:
    """A fitted attention cost of 1e-19 s (zero, but for rounding: seen when fitting passes over no context)
    must give what no attention cost gives: the textbook root (sqrt(b^2 + 4ac) - b) / 2a cancels to nonsense
    there (20 tokens where 18 fit, in the case seen)."""
    cost = PassCost(decay=1.0, packed=True)
    cost._solved = np.array([0.013, 0.002, 0.001, 0.0014, 7e-20])
    assert cost.longest_chunk(0, 0.0425) == int((0.0425 - 0.013 - 0.002 - 0.001) / 0.0014) == 18
