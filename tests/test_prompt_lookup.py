"""Prompt lookup's matching rules, and which part of lookup-first drafts, on plain token sequences."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_trt.drafting import LOOKUP, MODEL, PromptLookupDrafter
from specdec_trt.loading import load_engines


def lookup(drafter: PromptLookupDrafter, sequence: list[int], num_tokens: int) -> list[int]:
    return drafter.lookup(np.asarray(sequence), num_tokens).tolist()


def test_the_longest_recurring_suffix_wins_over_a_later_shorter_one() -> None:
    # The suffix 1 2 3 4 occurs once (followed by 5 6); its tail 3 4 occurs later (followed by 9).
    sequence = [1, 2, 3, 4, 5, 6, 3, 4, 9, 1, 2, 3, 4]
    assert lookup(PromptLookupDrafter(), sequence, 2) == [5, 6]
    assert lookup(PromptLookupDrafter(max_ngram=2), sequence, 2) == [9, 1]


def test_among_equal_matches_the_latest_is_copied() -> None:
    sequence = [7, 8, 1, 7, 8, 2, 7, 8]
    assert lookup(PromptLookupDrafter(), sequence, 3) == [2, 7, 8]


def test_a_single_token_match_drafts_by_default_and_not_when_two_are_needed() -> None:
    sequence = [5, 6, 7, 1, 5]  # only the last token, 5, occurred before
    assert lookup(PromptLookupDrafter(), sequence, 3) == [6, 7, 1]
    assert lookup(PromptLookupDrafter(min_ngram=2), sequence, 3) == []


def test_a_draft_stops_at_the_end_of_the_sequence_and_empty_without_a_match() -> None:
    drafter = PromptLookupDrafter()
    assert lookup(drafter, [4, 5, 4], 5) == [5, 4]  # the match's continuation runs to the sequence's end
    assert lookup(drafter, [1, 2, 3], 4) == []
    assert lookup(drafter, [1, 1], 0) == []


@pytest.mark.parametrize(("max_ngram", "min_ngram"), [(2, 3), (2, 0)])
def test_bad_ngram_bounds_are_refused(max_ngram: int, min_ngram: int) -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)


def test_lookup_first_drafts_by_lookup_only_after_a_match_of_two_tokens(make_checkpoint) -> None:
    checkpoint = make_checkpoint(family="llama")
    _, _, drafter = load_engines(checkpoint, f"ngram+{checkpoint}")
    assert drafter.part([[5, 6, 7, 1, 5]]) == MODEL  # one token matches: the model drafts
    assert drafter.part([[5, 6, 7, 5, 6]]) == LOOKUP
    assert drafter.part([[5, 6, 7, 5, 6], [5, 6, 7, 1, 5]]) == MODEL  # lookup drafts only for a whole batch
