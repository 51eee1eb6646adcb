"""Prompt lookup's matching rules, its confidence and stop rule, and which part of lookup-first drafts, on plain
token sequences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_trt import SamplingParams
from specdec_trt.drafting import LOOKUP, MODEL, DraftPlan, PromptLookupDrafter, lookup_confidence
from specdec_trt.loading import load_engines
from specdec_trt.sampling import BatchSampler


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


def test_the_match_length_comes_with_the_tokens() -> None:
    drafter = PromptLookupDrafter()
    sequence = np.asarray([1, 2, 3, 4, 5, 6, 3, 4, 9, 1, 2, 3, 4])
    length, tokens = drafter.match(sequence, 2)
    assert (length, tokens.tolist()) == (4, [5, 6])
    assert drafter.match(np.asarray([1, 2, 3]), 2)[0] == 0


def test_the_match_is_the_longest_earlier_suffix_at_its_latest_occurrence() -> None:
    """Against the definition, written out by brute force, on random short sequences over small vocabularies
    (many repeats) and every n-gram range: the longest suffix of max_ngram down to min_ngram tokens that
    occurred earlier (not as the suffix itself), and the tokens after its latest occurrence."""

    def expected(sequence: list[int], max_ngram: int, min_ngram: int, num_tokens: int) -> tuple[int, list[int]]:
        for n in range(max_ngram, min_ngram - 1, -1):
            starts = [i for i in range(len(sequence) - n) if sequence[i : i + n] == sequence[-n:]] if num_tokens else []
            if len(sequence) > n and starts:
                return n, sequence[starts[-1] + n :][:num_tokens]
        return 0, []

    rng = np.random.default_rng(0)
    found = 0
    for _ in range(3000):
        min_ngram = int(rng.integers(1, 4))
        max_ngram = int(rng.integers(min_ngram, 6))
        sequence = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(0, 25))).tolist()
        num_tokens = int(rng.integers(0, 5))
        length, tokens = PromptLookupDrafter(max_ngram, min_ngram).match(np.asarray(sequence), num_tokens)
        assert (length, tokens.tolist()) == expected(sequence, max_ngram, min_ngram, num_tokens), sequence
        found += length > 0
    assert 1000 < found < 2900  # both outcomes are well exercised


def test_confidence_grows_with_the_repeat_a_token_continues() -> None:
    np.testing.assert_allclose(lookup_confidence(1, 3), [1 / 2, 2 / 3, 3 / 4])
    np.testing.assert_allclose(lookup_confidence(4, 2), [4 / 5, 5 / 6])
    assert lookup_confidence(2, 0).shape == (0,)


def test_a_stop_rule_sees_each_position_and_cuts_the_round() -> None:
    """With a stop rule, every drafted position is shown to it with each row's confidence (0 where a row's
    shorter match was padded), the rows' slots and which rows still draft there; the round ends after the
    position it stops at. Without one, nothing is cut and no confidence is reported."""
    drafter = PromptLookupDrafter()
    sequences = [[1, 2, 3, 4, 5, 6, 7, 1, 2], [8, 9, 8]]  # a 2-token match (5 tokens follow), a 1-token one (2)
    slots, limits = [3, 7], [5, 5]
    seen: list[list[float]] = []
    drafting: list[list[bool]] = []

    def stop_after_third(confidence: torch.Tensor, rule_slots, still: np.ndarray) -> bool:
        assert list(rule_slots) == slots
        seen.append(confidence.tolist())
        drafting.append(still.tolist())
        return len(seen) == 3

    parts = drafter.parts(sequences)
    draft = drafter.propose(slots, sequences, limits, None, DraftPlan(parts, {LOOKUP: stop_after_third}))
    assert draft.token_ids.tolist() == [[3, 4, 5], [9, 8, 8]]
    assert draft.num_drafts.tolist() == [3, 2]  # the second row's third token is padding
    expected = [[2 / 3, 3 / 4, 4 / 5], [1 / 2, 2 / 3, 0.0]]
    torch.testing.assert_close(draft.confidence, torch.tensor(expected))
    np.testing.assert_allclose(seen, np.transpose(expected), rtol=1e-6)
    assert drafting == [[True, True], [True, True], [True, False]]
    never = drafter.propose(slots, sequences, limits, None, DraftPlan(parts, {LOOKUP: lambda *_: False}))
    assert never.num_tokens == 5 and never.confidence.shape == (2, 5)
    assert never.num_drafts.tolist() == [5, 2]
    plain = drafter.propose(slots, sequences, limits, None)
    assert plain.token_ids.tolist() == never.token_ids.tolist() and plain.confidence is None
    assert plain.num_drafts.tolist() == [5, 2]


@pytest.mark.parametrize(("max_ngram", "min_ngram"), [(2, 3), (2, 0)])
def test_bad_ngram_bounds_are_refused(max_ngram: int, min_ngram: int) -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)


def test_lookup_first_drafts_by_lookup_only_after_a_match_of_two_tokens(make_checkpoint) -> None:
    checkpoint = make_checkpoint(family="llama")
    _, _, drafter = load_engines(checkpoint, f"ngram+{checkpoint}")

    def kinds(sequences: list[list[int]]) -> list[str]:
        return [part.kind for part in drafter.parts(sequences)]

    assert kinds([[5, 6, 7, 1, 5]]) == [MODEL]  # one token matches: the model drafts
    assert kinds([[5, 6, 7, 5, 6]]) == [LOOKUP]
    sequences = [[5, 6, 7, 5, 6], [5, 6, 7, 1, 5]]
    assert kinds(sequences) == [LOOKUP, MODEL]  # each row by its own match, whatever shares the batch
    lookup = drafter.parts(sequences)[0].match
    assert lookup[0] == 2 and lookup[1].tolist() == [7, 5, 6]  # the match, and what followed it
    # In one round: the first row drafts by lookup, the second with the model, as it would alone.
    slots = [0, 1]
    drafter.reserve(len(slots))
    for slot in slots:
        drafter.admit(slot)
    drafter.prefill(slots, [s[:-1] for s in sequences])
    sampler = BatchSampler([SamplingParams()] * len(slots))
    draft = drafter.propose(slots, sequences, [3, 3], sampler)
    assert draft.token_ids[0].tolist() == [7, 5, 6] and draft.num_drafts.tolist() == [3, 3]
    alone = drafter.model.propose(slots[1:], sequences[1:], [3], sampler.subset([1]))
    assert draft.token_ids[1].tolist() == alone.token_ids[0].tolist()
