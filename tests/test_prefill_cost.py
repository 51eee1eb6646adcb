"""The online cost model of a prefill pass: fixed, per computed token, and per attended position."""

from __future__ import annotations

import pytest

from specdec_trt.prefill_cost import PrefillCost, pass_features

FIXED, PER_TOKEN, PER_ATTENDED = 0.012, 0.0012, 6e-7  # about SmolLM2-135M on two CPU cores


def true_seconds(cached: list[int], width: int) -> float:
    return float(pass_features(cached, width) @ [FIXED, PER_TOKEN, PER_ATTENDED])


def test_features_count_padding_and_the_context_each_row_attends_to() -> None:
    # two rows padded to 8 tokens, holding 100 and 0: 16 tokens computed, 8 * (100 + 8) + 8 * (0 + 8) attended
    assert pass_features([100, 0], 8).tolist() == [1.0, 16.0, 8 * 108 + 8 * 8]


def test_nothing_timed_predicts_nothing_and_bounds_no_chunk() -> None:
    cost = PrefillCost(decay=0.95)
    assert cost.coefficients().tolist() == [0.0, 0.0, 0.0]
    assert cost.longest_chunk(0, 0.05) is None


def test_the_fit_recovers_fixed_token_and_attention_costs() -> None:
    cost = PrefillCost(decay=0.95)
    for cached, width in [(0, 16), (0, 64), (300, 16), (800, 48), (1450, 16), (1450, 48), (40, 32)]:
        cost.add([cached], width, true_seconds([cached], width))
    assert cost.coefficients() == pytest.approx([FIXED, PER_TOKEN, PER_ATTENDED], rel=1e-6)


def test_a_chunk_late_in_a_long_prompt_is_shorter_for_the_same_time() -> None:
    """The chunk that fits a time bound shrinks as the prompt's context grows, and takes that time; a model
    of tokens alone gives the early chunk's length at every context, which late in the prompt overruns the
    bound by more than a fifth (negative control)."""
    cost = PrefillCost(decay=0.95)
    for cached, width in [(0, 16), (0, 64), (300, 16), (800, 48), (1450, 16), (1450, 48)]:
        cost.add([cached], width, true_seconds([cached], width))
    early, late = cost.longest_chunk(0, 0.06), cost.longest_chunk(1450, 0.06)
    assert late < 0.8 * early
    for cached, width in [(0, early), (1450, late)]:
        assert true_seconds([cached], width) <= 0.06 < true_seconds([cached], width + 1)
    assert true_seconds([1450], early) > 1.2 * 0.06


def test_a_coefficient_the_data_would_make_negative_is_dropped() -> None:
    """Passes that got no slower with more context (noise, or a backend whose attention is cheap) fit no
    attention cost rather than a negative one, and the rest is refitted without it."""
    cost = PrefillCost(decay=1.0)
    for cached, width, seconds in [(0, 16, 0.032), (1000, 16, 0.031), (0, 64, 0.09), (1000, 64, 0.089)]:
        cost.add([cached], width, seconds)
    fixed, per_token, per_attended = cost.coefficients()
    assert per_attended == 0.0 and fixed > 0 and per_token == pytest.approx((0.0895 - 0.0315) / 48, rel=1e-6)


def test_a_single_pass_predicts_itself_and_no_time_fits_no_token() -> None:
    cost = PrefillCost(decay=0.95)
    cost.add([0], 32, 0.05)
    assert cost.seconds([0], 32) == pytest.approx(0.05)
    assert cost.longest_chunk(0, 0.05) in (31, 32)
    assert cost.longest_chunk(0, 0.0) == 0
