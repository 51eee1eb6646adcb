"""Replayed generations (``benchlib.replay``): rounds, prices and auto's early stop, on made-up
drafters whose every round is known in advance; and prompt lookup replayed on the decoder's own sampled output,
at fixed lengths and with auto.
The self-draft's replay against the decoder's own rounds on real engines is in test_onnx_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_losslessness import steady_clock  # noqa: F401 - a fixture

import specdec_trt.rejection
from benchlib.replay import (
    Proposal,
    Proposer,
    Round,
    StepPrices,
    fixed_length_rounds,
    generation_seconds,
    lookup_proposer,
    position_counts,
    replay_rounds,
    stopped,
)
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.decoder import AUTO
from specdec_trt.drafting import LOOKUP, MODEL, PromptLookupDrafter, StopRule
from specdec_trt.loading import load_engines

PROMPT = [1, 2, 3]
OUTPUT = list(range(10, 40))  # 30 tokens: the first from the prefill, 29 from rounds
PRICES = StepPrices((0, 100), {w: [0.010 * (1 + 0.05 * (w - 1))] * 2 for w in range(1, 10)}, [0.002, 0.002])


def oracle(confidence: float) -> Proposer:
    """A model draft that always proposes the recorded continuation, with a fixed confidence."""
    sequence = np.asarray(PROMPT + OUTPUT)

    def propose(committed: np.ndarray, length: int, stop: StopRule | None) -> Proposal:
        tokens = sequence[len(committed) : len(committed) + length]
        return stopped(Proposal(tokens, np.full(len(tokens), confidence)), stop)

    return propose


def always_wrong(confidence: float) -> Proposer:
    """A model draft that is never right (token 0 never occurs), with a fixed confidence."""
    return lambda committed, length, stop: stopped(
        Proposal(np.zeros(length, np.int64), np.full(length, confidence)), stop
    )


def test_rounds_accept_the_matching_prefix_and_commit_one_more() -> None:
    sequence = np.asarray(PROMPT + OUTPUT)

    def wrong_third(committed: np.ndarray, length: int) -> tuple[str, Proposal]:
        """The recorded continuation, but for its third token."""
        right = sequence[len(committed) : len(committed) + length]
        return MODEL, Proposal(np.where(np.arange(length) == 2, 0, right))

    rounds = list(replay_rounds(PROMPT, OUTPUT, wrong_third))
    assert [r.accepted for r in rounds[:3]] == [2, 2, 2]
    assert [r.context for r in rounds[:3]] == [4, 7, 10]
    assert sum(r.accepted + 1 for r in rounds) == len(OUTPUT) - 1


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_an_always_right_draft_commits_k_plus_one_tokens_a_round(k: int) -> None:
    rounds = fixed_length_rounds(PROMPT, OUTPUT, oracle(1.0), k, MODEL)
    assert len(rounds) == -(-(len(OUTPUT) - 1) // (k + 1))
    assert all(r.accepted == r.drafted for r in rounds)
    assert rounds[-1].context + rounds[-1].drafted + 1 == len(PROMPT) + len(OUTPUT)  # never drafts past the end


def test_plain_decoding_costs_one_verify_step_a_token() -> None:
    seconds = generation_seconds(PROMPT, OUTPUT, {MODEL: oracle(1.0)}, lambda _: MODEL, PRICES, 0, 8)
    assert seconds == pytest.approx((len(OUTPUT) - 1) * 0.010)


def test_prices_charge_model_drafts_and_not_lookup_drafts() -> None:
    round_ = Round(50, MODEL, Proposal(np.arange(3)), 3)
    assert PRICES(round_) == pytest.approx((3 * 0.002, 0.010 * 1.15))
    assert PRICES(Round(50, LOOKUP, Proposal(np.arange(3)), 3)) == pytest.approx((0.0, 0.010 * 1.15))
    with pytest.raises(ValueError, match="draft step prices"):
        StepPrices((0, 100), PRICES.verify)(round_)


def test_auto_drafts_long_when_right_and_stops_early_when_unconfident() -> None:
    """An always-right, confident draft: auto drafts the most it can and nears the best possible speedup.
    A never-right, unconfident one: after the first round, every drafting round stops after one token."""
    seen: list[Round] = []

    def recording_price(round_: Round) -> tuple[float, float]:
        seen.append(round_)
        return PRICES(round_)

    plain = generation_seconds(PROMPT, OUTPUT, {MODEL: oracle(1.0)}, lambda _: MODEL, PRICES, 0, 8)
    auto = generation_seconds(PROMPT, OUTPUT, {MODEL: oracle(1.0)}, lambda _: MODEL, recording_price, None, 8)
    assert plain / auto > 2.5  # k=8 throughout: 2.83x
    assert max(r.drafted for r in seen) == 8
    seen.clear()
    generation_seconds(PROMPT, OUTPUT, {MODEL: always_wrong(0.01)}, lambda _: MODEL, recording_price, None, 8)
    assert seen[0].drafted == 4  # the controller's first round, before anything was measured
    assert all(r.drafted <= 1 for r in seen[1:]) and any(r.drafted == 1 for r in seen[1:])
    assert all(r.accepted == 0 for r in seen)


def steady_rounds(
    prompt: list[int], output: list[int], parts: dict[str, Proposer], part_of, k: int | str, max_draft: int
) -> list[Round]:
    """The rounds of ``output`` replayed with ``parts`` drafting ``k`` tokens a round, or auto priced as the
    decoder times it under ``steady_clock`` (1 ms a reading: every draft and every verify takes 1 ms)."""
    replayed: list[Round] = []

    def steady_price(round_: Round) -> tuple[float, float]:
        replayed.append(round_)
        return 1e-3, 1e-3

    generation_seconds(prompt, output, parts, part_of, steady_price, None if k == AUTO else k, max_draft)
    return replayed


def lookup_rounds_replayed(decoder: SpeculativeDecoder, k: int | str, seed: int) -> tuple[bool, int, int]:
    """One sampled run of ``decoder`` (prompt lookup drafting ``k`` tokens a round, or auto on the steady clock)
    and its output replayed the same way: whether the replay gives the run's rounds and per-position
    acceptances, and its accepted and rejected drafts."""
    prompt = [1, 5, 3, 6, 1, 5]
    torch.manual_seed(seed)  # unseeded: rejection sampling, with torch's global generator
    real = decoder.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0.8, ignore_eos=True))
    parts = {LOOKUP: lookup_proposer(decoder.drafter)}
    replayed = steady_rounds(prompt, real.token_ids, parts, lambda _: LOOKUP, k, decoder.max_auto_draft)
    drafted, accepted = position_counts(replayed, len(real.stats.drafted_per_position))
    same = (len(replayed), drafted, accepted) == (
        real.stats.rounds,
        real.stats.drafted_per_position,
        real.stats.accepted_per_position,
    )
    return same, sum(accepted), sum(r.drafted > r.accepted for r in replayed)


@pytest.mark.usefixtures("steady_clock")
@pytest.mark.parametrize("k", [1, 3, 8, AUTO])
def test_replayed_lookup_rounds_equal_the_decoder_rounds_when_sampling(
    k: int | str, make_checkpoint, monkeypatch
) -> None:
    """Prompt lookup's drafts are deterministic (q one-hot), so rejection sampling accepts a drafted token
    exactly when the token it emits there is that token: replaying a sampled run's own output at the same
    draft length gives that run's rounds, which is what lets scripts/replay_prompt_lookup.py replay plain
    samples; with auto too, where the decoder's controller stops rounds on lookup's confidence. An 8-token
    vocabulary makes lookup match often, and be rejected often. Negative control: a sampler whose
    replacement token is drawn from p, not from the residual, can emit the token it just rejected, and the
    replay then miscounts."""
    checkpoint = make_checkpoint(with_tokenizer=False, vocab_size=8, seed=11, logit_scale=1.5)

    def fresh() -> SpeculativeDecoder:
        """A decoder of its own for each run: a decoder's auto controllers learn across its requests, and the
        replay starts every generation with fresh ones."""
        _, engine, _ = load_engines(checkpoint, None, max_context=64)
        return SpeculativeDecoder(engine, PromptLookupDrafter(), num_draft_tokens=k)

    runs = [lookup_rounds_replayed(fresh(), k, seed) for seed in range(4)]
    assert all(same for same, _, _ in runs)
    assert sum(a for _, a, _ in runs) > 0 and sum(r for _, _, r in runs) > 0, runs
    monkeypatch.setattr(
        specdec_trt.rejection,
        "recovery_distribution",
        lambda accepted, _ids, _q, p, _drafted: p[torch.arange(len(p)), accepted],
    )
    assert not all(lookup_rounds_replayed(fresh(), k, seed)[0] for seed in range(4))
