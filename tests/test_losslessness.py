"""Losslessness, proven statistically (DESIGN.md, "Proving losslessness").

With a vocabulary of 8 tokens the target's exact distribution over the first three generated tokens is
enumerable (512 sequences). The full pipeline (prefill, draft, verify, rejection sampling, cache
rollback, next rounds) runs tens of thousands of seeded times in one batch, and a chi-square test
compares the counts with the exact distribution. The reference is computed independently of our code:
transformers' own model forward and its logits warpers.

Every test has a negative control: a deliberately broken pipeline that the same test must reject.

Unseeded requests go through rejection sampling, with torch's global generator seeded before each batch;
seeded requests through coupled verification on their own keyed noise (``specdec_trt.seeded_noise``). Both
are tested, each with its own negative controls.

With num_draft_tokens="auto" the draft length of each round follows measured timings; those tests read a
clock that advances a fixed step per reading (``steady_clock``), so they are repeatable too.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy import stats
from test_rejection import race_agreement
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import specdec_trt.rejection
import specdec_trt.scheduler
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.decoder import AUTO, AUTO_MAX_DRAFT_TOKENS, DraftLength
from specdec_trt.drafting import Draft, ModelDrafter, PromptLookupDrafter
from specdec_trt.loading import load_engines
from specdec_trt.sampling import BatchSampler

VOCAB = 8
DEPTH = 3  # generated tokens whose joint distribution is tested: VOCAB ** DEPTH cells
PROMPT = [1, 5, 3, 6, 1, 5]
RUNS = 24_000
MAX_CONTEXT = 16  # prompt + 3 tokens + 3 drafts + slack: keeps the batch's KV cache small
AUTO_EXTRA = 3  # with "auto", tokens generated past DEPTH, so that rounds can draft several tokens
STOP_EXTRA = 5  # for auto's own stop: rounds that ask for enough drafts that the last ones no longer pay
AUTO_CONTEXT = len(PROMPT) + DEPTH + STOP_EXTRA + AUTO_MAX_DRAFT_TOKENS  # "auto" reserves up to 8 drafts
PASS_P = 1e-3  # a correct pipeline passes (fixed seeds: deterministic)
REJECT_P = 1e-6  # a broken one must be rejected this clearly

WARPINGS = {
    "temperature": SamplingParams(temperature=0.6),
    "top_k": SamplingParams(temperature=1.2, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.75),
    "min_p": SamplingParams(temperature=1.1, min_p=0.2),
    "combined": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
}


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint) -> tuple:
    """A target and an independently initialised draft that disagrees with it a lot."""
    target = make_checkpoint(with_tokenizer=False, vocab_size=VOCAB, seed=11, logit_scale=1.5)
    draft = make_checkpoint(with_tokenizer=False, vocab_size=VOCAB, seed=12, logit_scale=1.5)
    return target, draft


@pytest.fixture(scope="module")
def reference_models(checkpoints) -> tuple:
    return tuple(AutoModelForCausalLM.from_pretrained(path).eval() for path in checkpoints)


@pytest.fixture(scope="module")
def decoder(checkpoints) -> SpeculativeDecoder:
    return SpeculativeDecoder.from_pretrained(*checkpoints, max_context=MAX_CONTEXT)


def reference_probs(model: torch.nn.Module, prefixes: Sequence[Sequence[int]], params: SamplingParams) -> torch.Tensor:
    """Next-token distributions [N, V] for prefixes, warped by transformers' own warpers."""
    with torch.no_grad():
        scores = model(torch.tensor(prefixes)).logits[:, -1].double()
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(-1)


def exact_joint(model: torch.nn.Module, params: SamplingParams) -> np.ndarray:
    """P(x_1 .. x_DEPTH | prompt) for every sequence, flattened in base-VOCAB order."""
    joint = torch.ones(1, dtype=torch.float64)
    prefixes: list[list[int]] = [PROMPT]
    for _ in range(DEPTH):
        joint = (joint[:, None] * reference_probs(model, prefixes, params)).reshape(-1)
        prefixes = [prefix + [token] for prefix in prefixes for token in range(VOCAB)]
    return joint.numpy()


def pipeline_counts(
    decoder: SpeculativeDecoder,
    params: SamplingParams,
    gamma: DraftLength,
    runs: int = RUNS,
    extra: int | None = None,
    seeded: bool = False,
) -> tuple[np.ndarray, list]:
    """Counts of the first DEPTH tokens over ``runs`` requests (``seeded``: with seeds 0, 1, ...), run as one
    batch, each generating ``extra`` tokens past them (default: AUTO_EXTRA with "auto", gamma otherwise)."""
    extra = extra if extra is not None else AUTO_EXTRA if gamma == AUTO else gamma
    requests = [
        dataclasses.replace(params, seed=seed if seeded else None, max_new_tokens=DEPTH + extra, ignore_eos=True)
        for seed in range(runs)
    ]
    torch.manual_seed(0)
    outputs = decoder.generate_batch([PROMPT] * runs, requests, num_draft_tokens=gamma)
    codes = [int(np.ravel_multi_index(out.token_ids[:DEPTH], (VOCAB,) * DEPTH)) for out in outputs]
    return np.bincount(codes, minlength=VOCAB**DEPTH), outputs


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells expected below 5 counts are pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    assert counts[probs == 0].sum() == 0, "the pipeline produced a sequence the target cannot produce"
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


class UnwarpedQDrafter(ModelDrafter):
    """Negative control (trap 2): samples drafts from the warped distribution but reports the unwarped
    softmax as q, so the sampler divides by a distribution that was never sampled from."""

    def propose(self, slots, sequences, limits, sampler: BatchSampler, stop_rules: dict | None = None) -> Draft:
        return super().propose(slots, sequences, limits, _ReportsUnwarped(sampler), stop_rules)


class _ReportsUnwarped:
    """A sampler whose ``draw`` samples from the warped distribution but returns the unwarped softmax as the
    distribution it drew from."""

    def __init__(self, sampler: BatchSampler) -> None:
        self.sampler, self.all_greedy, self.params = sampler, sampler.all_greedy, sampler.params

    def draw(self, logits: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        token, _ = self.sampler.draw(logits, step)
        return token, logits.softmax(-1)


def no_residual(num_accepted, draft_token_ids, draft_probs, target_probs, num_drafts) -> torch.Tensor:
    """Negative control: the replacement is drawn from p instead of norm(max(0, p - q))."""
    return target_probs[torch.arange(len(num_accepted)), num_accepted]


@pytest.mark.parametrize("name", WARPINGS)
def test_model_draft_is_lossless(name: str, decoder, reference_models) -> None:
    params = WARPINGS[name]
    counts, _ = pipeline_counts(decoder, params, gamma=3)
    assert chi_square_p(counts, exact_joint(reference_models[0], params)) > PASS_P


@pytest.mark.parametrize("name", WARPINGS)
def test_unwarped_draft_probs_are_caught(name: str, checkpoints, reference_models) -> None:
    _, engine, drafter = load_engines(*checkpoints, max_context=MAX_CONTEXT)
    broken = SpeculativeDecoder(engine, UnwarpedQDrafter(drafter.engine), num_draft_tokens=3)
    params = WARPINGS[name]
    counts, _ = pipeline_counts(broken, params, gamma=3)
    assert chi_square_p(counts, exact_joint(reference_models[0], params)) < REJECT_P


def test_missing_residual_is_caught(decoder, reference_models, monkeypatch) -> None:
    monkeypatch.setattr(specdec_trt.rejection, "recovery_distribution", no_residual)
    params = WARPINGS["temperature"]
    counts, _ = pipeline_counts(decoder, params, gamma=3)
    assert chi_square_p(counts, exact_joint(reference_models[0], params)) < REJECT_P


def test_prompt_lookup_drafts_are_lossless(checkpoints, reference_models, monkeypatch) -> None:
    """Deterministic drafts (draft_probs=None), then the same test with the residual broken."""
    _, engine, _ = load_engines(checkpoints[0], None, max_context=MAX_CONTEXT)
    decoder = SpeculativeDecoder(engine, PromptLookupDrafter(max_ngram=2, min_ngram=1), num_draft_tokens=3)
    params = WARPINGS["top_p"]
    probs = exact_joint(reference_models[0], params)
    counts, outputs = pipeline_counts(decoder, params, gamma=3)
    assert sum(out.stats.accepted_tokens for out in outputs) > RUNS / 4, "prompt lookup should often be accepted"
    assert chi_square_p(counts, probs) > PASS_P
    monkeypatch.setattr(specdec_trt.rejection, "recovery_distribution", no_residual)
    broken_counts, _ = pipeline_counts(decoder, params, gamma=3)
    assert chi_square_p(broken_counts, probs) < REJECT_P


def test_lookup_first_drafts_are_lossless(checkpoints, reference_models, monkeypatch) -> None:
    """A deterministic draft in the first round, the model's sampled drafts after it (its cache catching up
    over the skipped round), then the same test with the residual broken. Real prompt lookup on random
    8-token sequences would match in some rows and not others; so that every row has both kinds of round,
    its lookup is replaced by one that always proposes in the first round (the last three tokens again) and
    never after: deterministic given the committed prefix, as a lossless draft must be."""
    decoder = SpeculativeDecoder.from_pretrained(  # no store: its drafts would replace the scripted rounds
        checkpoints[0], f"ngram+{checkpoints[1]}", max_context=MAX_CONTEXT, num_draft_tokens=3, draft_store=False
    )
    first_round = len(PROMPT) + 1  # the prompt and the token sampled from the prefill's logits
    monkeypatch.setattr(
        decoder.drafter.lookup, "match", lambda seq, k: (3, seq[-3:][:k]) if len(seq) == first_round else (0, seq[:0])
    )
    rounds: list[str] = []
    lookup, model = decoder.drafter.lookup, decoder.drafter.model
    draft_from, propose = lookup.draft_from, model.propose
    monkeypatch.setattr(lookup, "draft_from", lambda *a: rounds.append("lookup") or draft_from(*a))
    monkeypatch.setattr(model, "propose", lambda *a: rounds.append("model") or propose(*a))
    params = WARPINGS["top_k"]
    probs = exact_joint(reference_models[0], params)
    counts, _ = pipeline_counts(decoder, params, gamma=3)
    assert rounds[0] == "lookup" and rounds[1:] and set(rounds[1:]) == {"model"}, rounds
    assert chi_square_p(counts, probs) > PASS_P
    monkeypatch.setattr(specdec_trt.rejection, "recovery_distribution", no_residual)
    broken_counts, _ = pipeline_counts(decoder, params, gamma=3)
    assert chi_square_p(broken_counts, probs) < REJECT_P


def test_acceptance_rate_matches_theory(decoder, reference_models) -> None:
    """With one draft in the first round, P(accept) = E_x1[sum_x min(p(x | x1), q(x | x1))]
    (Leviathan et al., Theorem 3.5); every request drafts exactly once."""
    params = WARPINGS["temperature"]
    target, draft = reference_models
    first = reference_probs(target, [PROMPT], params)[0]
    prefixes = [PROMPT + [token] for token in range(VOCAB)]
    overlap = torch.minimum(reference_probs(target, prefixes, params), reference_probs(draft, prefixes, params)).sum(-1)
    expected = float((first * overlap).sum())
    _, outputs = pipeline_counts(decoder, params, gamma=1, extra=0)
    assert all(out.stats.drafted_tokens == 1 for out in outputs)
    accepted = sum(out.stats.accepted_tokens for out in outputs)
    assert 0.2 < expected < 0.9, "the draft should disagree with the target a lot, but not always"
    assert stats.binomtest(accepted, RUNS, expected).pvalue > PASS_P


# --- seeded requests: coupled verification ------------------------------------------------------------------


@pytest.fixture
def noise_keyed_without_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for seeded requests: every batch draws from the noise of positions 0, 1, .. again, as if
    the noise were keyed by the draft's index in a round instead of the token's position in its sequence."""

    def sampler(self, rows):
        return BatchSampler([r.params for r in rows], self.target.device, [r.noise for r in rows], [0] * len(rows))

    monkeypatch.setattr(specdec_trt.scheduler.Scheduler, "_sampler", sampler)


SEEDED_DRAFTERS = {"model k=3": 3, "prompt lookup k=3": 3, "model auto": AUTO}


@pytest.mark.parametrize("name", SEEDED_DRAFTERS)
def test_seeded_requests_are_lossless(name: str, checkpoints, reference_models, request, steady_clock) -> None:
    """Seeded requests, one seed each, through coupled verification: the target's exact distribution with a model
    draft, prompt lookup's deterministic drafts and auto's draft lengths. Then the same run with the noise keyed
    without the positions must be rejected."""
    gamma = SEEDED_DRAFTERS[name]

    def fresh() -> SpeculativeDecoder:
        if name.startswith("prompt lookup"):
            _, engine, _ = load_engines(checkpoints[0], None, max_context=AUTO_CONTEXT)
            return SpeculativeDecoder(engine, PromptLookupDrafter(max_ngram=2, min_ngram=1), num_draft_tokens=gamma)
        return SpeculativeDecoder.from_pretrained(*checkpoints, max_context=AUTO_CONTEXT, num_draft_tokens=gamma)

    params = WARPINGS["top_p" if name.startswith("prompt lookup") else "combined"]
    probs = exact_joint(reference_models[0], params)
    counts, outputs = pipeline_counts(fresh(), params, gamma, seeded=True)
    assert sum(out.stats.accepted_tokens for out in outputs) > RUNS / 10
    assert chi_square_p(counts, probs) > PASS_P
    request.getfixturevalue("noise_keyed_without_positions")
    broken_counts, _ = pipeline_counts(fresh(), params, gamma, seeded=True)
    assert chi_square_p(broken_counts, probs) < REJECT_P


def test_seeded_acceptance_rate_is_the_races_agreement(decoder, reference_models) -> None:
    """With one draft in the first round, a seeded request accepts it with probability
    E_x1[P(argmax(p / E) = argmax(q / E))] (``race_agreement``), below rejection sampling's E_x1[sum min(p, q)]:
    the price of a text that does not depend on the drafts."""
    params = WARPINGS["temperature"]
    target, draft = reference_models
    first = reference_probs(target, [PROMPT], params)[0]
    prefixes = [PROMPT + [token] for token in range(VOCAB)]
    p, q = reference_probs(target, prefixes, params), reference_probs(draft, prefixes, params)
    expected = float(sum(first[x] * race_agreement(p[x], q[x]) for x in range(VOCAB)))
    _, outputs = pipeline_counts(decoder, params, gamma=1, extra=0, seeded=True)
    assert all(out.stats.drafted_tokens == 1 for out in outputs)
    accepted = sum(out.stats.accepted_tokens for out in outputs)
    assert stats.binomtest(accepted, RUNS, expected).pvalue > PASS_P
    assert expected < float((first * torch.minimum(p, q).sum(-1)).sum())


# --- num_draft_tokens="auto", with the draft's early stop -------------------------------------------------


@pytest.fixture
def steady_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's clock advances 1 ms per reading: auto's choices, and so the test, become repeatable."""
    ticks = itertools.count()
    monkeypatch.setattr(specdec_trt.scheduler.time, "perf_counter", lambda: next(ticks) * 1e-3)


def stopping_threshold(target: torch.nn.Module, draft: torch.nn.Module, params: SamplingParams) -> float:
    """A confidence threshold that cuts the first round after its second draft, in a batch of RUNS rows:
    below the best confidence of a first draft that some rows draw (with probability over 1e-3 each), and
    above that of every second draft that can be drawn, so that every row is then unconfident. Drafts start
    after the target's first token; confidence is the draft's probability of the drafted token under the
    warped distribution it drew it from."""
    first_tokens = reference_probs(target, [PROMPT], params)[0]
    contexts = [(PROMPT + [t], float(first_tokens[t])) for t in range(VOCAB) if first_tokens[t] > 0]
    best = []
    for depth in range(2):
        prefixes = [prefix for prefix, _ in contexts]
        drawn = reference_probs(draft, prefixes, params)
        paths = [(i, x, chance * float(drawn[i, x])) for i, (_, chance) in enumerate(contexts) for x in range(VOCAB)]
        paths = [(i, x, chance) for i, x, chance in paths if chance > (1e-3 if depth == 0 else 0)]
        best.append(max(float(drawn[i, x]) for i, x, _ in paths))
        contexts = [(prefixes[i] + [x], chance) for i, x, chance in paths]
    assert best[1] < best[0], f"this draft cannot be cut at its second token: {best}"
    return sum(best) / 2


def auto_decoder(checkpoints, threshold: float | None, unwarped_q: bool = False) -> SpeculativeDecoder:
    """A decoder with num_draft_tokens="auto"; with ``unwarped_q`` its drafter is the broken UnwarpedQDrafter."""
    _, engine, drafter = load_engines(*checkpoints, max_context=AUTO_CONTEXT)
    drafter = UnwarpedQDrafter(drafter.engine) if unwarped_q else drafter
    return SpeculativeDecoder(engine, drafter, num_draft_tokens=AUTO, draft_confidence_threshold=threshold)


def spy_on_rounds(decoder: SpeculativeDecoder, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(drafts asked for, drafts made) of every round the decoder's drafter runs from now on."""
    rounds = []
    propose = decoder.drafter.propose

    def spy(slots, sequences, limits, sampler, stop_rules=None):
        draft = propose(slots, sequences, limits, sampler, stop_rules)
        rounds.append((max(limits), draft.num_tokens))
        return draft

    monkeypatch.setattr(decoder.drafter, "propose", spy)
    return rounds


@pytest.mark.parametrize("name", ["top_k", "top_p"])
def test_auto_with_early_stop_is_lossless(name: str, checkpoints, reference_models, monkeypatch, steady_clock) -> None:
    """The draft length chosen per round, and the first round cut short by the draft's confidence: still
    the target's exact distribution. Then the same run with the residual broken must be rejected."""
    params = WARPINGS[name]
    decoder = auto_decoder(checkpoints, threshold=stopping_threshold(*reference_models, params))
    rounds = spy_on_rounds(decoder, monkeypatch)
    probs = exact_joint(reference_models[0], params)
    counts, outputs = pipeline_counts(decoder, params, AUTO)
    assert rounds[0] == (4, 2), f"the first round should ask for 4 drafts and stop after 2: {rounds}"
    assert sum(o.stats.accepted_tokens for o in outputs) > RUNS / 4
    assert chi_square_p(counts, probs) > PASS_P
    monkeypatch.setattr(specdec_trt.rejection, "recovery_distribution", no_residual)
    fresh = auto_decoder(checkpoints, threshold=stopping_threshold(*reference_models, params))  # as the first ran
    broken_counts, _ = pipeline_counts(fresh, params, AUTO)
    assert chi_square_p(broken_counts, probs) < REJECT_P


def test_auto_with_unwarped_draft_probs_is_caught(checkpoints, reference_models, monkeypatch, steady_clock) -> None:
    params = WARPINGS["top_k"]
    broken = auto_decoder(checkpoints, stopping_threshold(*reference_models, params), unwarped_q=True)
    rounds = spy_on_rounds(broken, monkeypatch)
    counts, _ = pipeline_counts(broken, params, AUTO)
    assert rounds[0] == (4, 2)
    assert chi_square_p(counts, exact_joint(reference_models[0], params)) < REJECT_P


def test_auto_with_its_cost_aware_stop_is_lossless(checkpoints, reference_models, monkeypatch, steady_clock) -> None:
    """Auto's own stop (no fixed cut-off): rounds after the first ask for every draft the context allows and
    end where the calibrated confidence says another draft no longer pays, a length that depends on the
    draft's samples. Still the target's exact distribution; the broken residual is still rejected."""
    params = WARPINGS["combined"]
    decoder = auto_decoder(checkpoints, threshold=None)
    rounds = spy_on_rounds(decoder, monkeypatch)
    probs = exact_joint(reference_models[0], params)
    counts, _ = pipeline_counts(decoder, params, AUTO, extra=STOP_EXTRA)
    assert any(made < asked for asked, made in rounds[1:]), f"no round was cut short: {rounds}"
    assert chi_square_p(counts, probs) > PASS_P
    monkeypatch.setattr(specdec_trt.rejection, "recovery_distribution", no_residual)
    fresh = auto_decoder(checkpoints, threshold=None)  # as the first ran
    broken_counts, _ = pipeline_counts(fresh, params, AUTO, extra=STOP_EXTRA)
    assert chi_square_p(broken_counts, probs) < REJECT_P
