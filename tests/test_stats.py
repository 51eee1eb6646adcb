"""The cost model and the per-round counters."""

from __future__ import annotations

import pytest

from specdec_trt.stats import GenerationStats, ideal_speedup


@pytest.mark.parametrize(
    "tau, gamma, cost_ratio, expected",
    [(1.0, 0, 0.5, 1.0), (3.0, 2, 0.5, 1.5), (4.2, 4, 0.05, 3.5), (5.0, 4, 1.0, 1.0)],
)
def test_ideal_speedup_by_hand(tau: float, gamma: int, cost_ratio: float, expected: float) -> None:
    assert ideal_speedup(tau, gamma, cost_ratio) == pytest.approx(expected)


def test_record_round_counts_positions() -> None:
    stats = GenerationStats()
    stats.record_round(3, 2)  # drafts 0 and 1 accepted, 2 rejected
    stats.record_round(3, 3)  # all accepted
    stats.record_round(1, 0)  # a short round near max_new_tokens
    assert stats.drafted_per_position == [3, 2, 2]
    assert stats.accepted_per_position == [2, 2, 1]
    assert stats.per_position_acceptance == pytest.approx([2 / 3, 1.0, 0.5])
    assert stats.acceptance_rate == pytest.approx(5 / 7)
    assert stats.mean_accepted_tokens == pytest.approx((5 + 3) / 3)
    assert stats.drafts_per_round == pytest.approx(7 / 3)
    assert stats.to_dict()["drafts_per_round"] == pytest.approx(7 / 3)


def test_time_to_first_token_counts_the_queue() -> None:
    stats = GenerationStats(queue_s=0.25, prefill_s=0.5, total_s=2.0, generated_tokens=4)
    assert stats.time_to_first_token_s == pytest.approx(0.75)
    assert stats.to_dict()["time_to_first_token_s"] == pytest.approx(0.75) and stats.to_dict()["queue_s"] == 0.25
    assert stats.tokens_per_s == pytest.approx(2.0)  # queueing and prefill included
