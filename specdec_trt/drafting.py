"""Draft strategies: propose up to ``num_tokens`` next tokens for every row of a batch.

A drafter sees the committed sequences (prompt + accepted output, whose last token is not yet in any
cache) and returns the drafted ids with the distributions they were sampled from (None when the drafts
are deterministic, as for prompt lookup or an all-greedy batch: q is then one-hot on the drafted token).

Given a stop rule, a drafter reports the confidence of every token it drafted (a model draft: its own
probability of the token; prompt lookup: ``lookup_confidence`` of its match), so the caller can learn how well
that confidence predicts acceptance, and asks the rule after each token whether to end the round there. This
keeps decoding lossless: how many tokens are drafted depends only on the draft's own samples and logits (and on
the committed prefix and earlier rounds), never on the target's verdict on this round, so every drafted token
is still a sample from the q it reports, and the rejection sampler's guarantee holds for any draft length
chosen that way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specdec_trt.runtime.engine import Engine
from specdec_trt.runtime.transfer import HostCopy, to_device
from specdec_trt.sampling import BatchSampler

MODEL, LOOKUP = "model", "lookup"  # the parts a drafter reports (``Drafter.part``)
LOOKUP_FIRST_MIN_NGRAM = 2  # shortest match on which lookup-first drafts by lookup rather than by its model
StopRule = Callable[[torch.Tensor], bool]
"""Asked after each drafted token with the draft's probability of it per row [B]: True ends the round there."""


def confidence_below(threshold: float) -> StopRule:
    """A fixed cut-off: end the round after a token whose confidence is below ``threshold`` in every row."""
    return lambda confidence: bool((confidence < threshold).all())


def lookup_confidence(match_length: int, count: int) -> np.ndarray:
    """Prompt lookup's confidence in the ``count`` tokens it copies after a match of ``match_length`` tokens:
    the i-th copied token continues a repeat of ``match_length + i`` tokens if the ones before it were right,
    and a repeat that has gone on for m tokens goes on with chance about m / (m + 1) (Laplace's rule of
    succession). Auto calibrates it online against the verifier, as a model draft's own probability."""
    run = match_length + np.arange(count)
    return run / (run + 1.0)


@dataclass(frozen=True)
class Draft:
    """Drafted tokens [B, k] and the distributions they were drawn from [B, k, V] (None: one-hot); with a
    stop rule, the draft's own probability of each drafted token [B, k] (else None)."""

    token_ids: torch.Tensor
    probs: torch.Tensor | None
    confidence: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[1]


class Drafter(Protocol):
    """What the decoder needs from a draft strategy."""

    max_context: int | None  # longest sequence the drafter can follow; None when unlimited

    def begin(self, prompt_ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Start a batch from right-padded prompts [B, T] with real lengths [B]."""

    def part(self, sequences: Sequence[Sequence[int]]) -> str:
        """Which of the drafter's parts would draft the next round after ``sequences`` (a drafter combining
        two kinds of draft, with their own acceptance and cost, gets one "auto" controller per part)."""

    def propose(
        self,
        sequences: Sequence[Sequence[int]],
        num_tokens: int,
        sampler: BatchSampler,
        stop_rule: StopRule | None = None,
    ) -> Draft:
        """Draft ``num_tokens`` (or fewer) tokens after each committed sequence. Given a ``stop_rule``, a
        drafter with its own distribution reports each token's probability under the draft (softmax of its
        raw logits) and ends the round after a token the rule stops at, keeping that token."""


class ModelDrafter:
    """Drafts by sampling autoregressively from a small model's engine, with the request's warping.

    Cache bookkeeping: the drafter remembers, per row, how many committed tokens its cache held after the
    last round and which drafts it wrote after them. At the next round the drafts that were accepted are
    still valid; every committed token after them is fed in one forward (usually the newest token, or the
    last two when every draft was accepted and the draft never ran on its own last token; more after plain
    rounds that drafted nothing). Rows feed one common width: a row needing fewer tokens re-feeds some it
    has, which rewrites the same keys and values at the same positions, so there is no branch per row.

    A self-draft (``cache_from``: the target's engine, with the same cache layout) feeds only each row's newest
    token: the keys and values of the committed tokens before it, which the target's verify pass computed,
    are copied from the target's cache, so even a long run of tokens the draft never saw (rounds drafted by
    prompt lookup, plain rounds) costs one draft step. Its own keys and values of accepted drafts are replaced
    by the target's too, which took fewer rounds on every bench suite (docs/MEASUREMENTS.md) and makes the
    draft's proposals depend on the committed text alone, so ``specdec_trt.bench.replay`` replays them exactly.
    """

    def __init__(self, engine: Engine, cache_from: Engine | None = None) -> None:
        self.engine = engine
        self.cache_from = cache_from
        self.max_context: int | None = engine.max_context
        self._cached: list[int] = []  # per row: committed tokens in the cache at the end of the last round
        self._fed = HostCopy(torch.zeros(0, 0, dtype=torch.int64))  # [B, k - 1]: the drafts written after them

    def begin(self, prompt_ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prefill the draft, or, with ``cache_from`` (a self-draft sharing the target's cache layout), copy
        the target's cached prompt, which the decoder has prefilled already."""
        if self.cache_from is not None:
            self.engine.adopt_prompt_cache(self.cache_from)
        else:
            self.engine.prefill(prompt_ids, lengths)
        self._cached = lengths.tolist()
        self._fed = HostCopy(torch.zeros(len(lengths), 0, dtype=torch.int64))

    def part(self, sequences: Sequence[Sequence[int]]) -> str:
        return MODEL

    def propose(
        self,
        sequences: Sequence[Sequence[int]],
        num_tokens: int,
        sampler: BatchSampler,
        stop_rule: StopRule | None = None,
    ) -> Draft:
        logits = self._catch_up(sequences)
        tokens, dists, confidences = [], [], []
        for i in range(num_tokens):
            token, probs = sampler.draw(logits)
            tokens.append(token)
            if probs is not None:  # None when every row is greedy: q is then one-hot on the draft
                dists.append(probs)
            if stop_rule is not None:
                confidences.append(logits.float().softmax(-1).gather(1, token.unsqueeze(1)).squeeze(1))
                if stop_rule(confidences[-1]):  # a host sync
                    break  # the token is kept: its logits are paid for, and it may still be accepted
            if i + 1 == num_tokens:
                break
            logits = self.engine.forward(token.unsqueeze(1))[:, 0]
        device = self.engine.device
        token_ids = (
            torch.stack(tokens, 1) if tokens else torch.zeros(len(sequences), 0, dtype=torch.int64, device=device)
        )
        self._cached = [len(s) for s in sequences]
        if self.cache_from is None:  # a self-draft takes the target's keys and values instead
            self._fed = HostCopy(token_ids[:, :-1])  # the last draft is in no cache
        probs = torch.stack(dists, 1) if dists else None
        return Draft(token_ids, probs, torch.stack(confidences, 1) if confidences else None)

    def _catch_up(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Feed each row the committed tokens its cache lacks; the logits after its last token [B, V]."""
        lengths = [len(s) for s in sequences]
        cached = self.engine.lengths.tolist()
        if self.cache_from is not None:
            # A self-draft: from the token it last fed on, its own keys and values give way to the target's,
            # which hold all but each row's newest token.
            self.engine.truncate(
                torch.tensor([min(base - 1, in_cache) for base, in_cache in zip(self._cached, cached)])
            )
            valid = [length - 1 for length in lengths]
            self.engine.adopt_cache(self.cache_from, valid)
        else:
            fed = self._fed.get().tolist()  # copied during the last round, which the decoder has synchronised since
            valid = [
                min(_matching_prefix(s, base, drafts), length - 1, in_cache)
                for s, base, drafts, length, in_cache in zip(sequences, self._cached, fed, lengths, cached)
            ]
        width = max(length - v for length, v in zip(lengths, valid))
        # A row shorter than the width (possible only for a finished, frozen row) starts at 0, padded.
        starts = [max(length - width, 0) for length in lengths]
        block = [list(s[start:]) + [s[-1]] * (start + width - len(s)) for s, start in zip(sequences, starts)]
        self.engine.truncate(torch.tensor(starts))
        logits = self.engine.forward(torch.tensor(block))
        self.engine.truncate(torch.tensor(lengths))
        last = to_device(torch.tensor([length - 1 - start for length, start in zip(lengths, starts)]), logits.device)
        return logits[torch.arange(len(sequences), device=logits.device), last]


def _matching_prefix(sequence: Sequence[int], base: int, drafts: list[int]) -> int:
    """Committed tokens in the cache: the ``base`` known ones, then the drafts the sequence went on with."""
    count = 0
    while count < len(drafts) and base + count < len(sequence) and sequence[base + count] == drafts[count]:
        count += 1
    return base + count


class PromptLookupDrafter:
    """Model-free drafting by n-gram match (as transformers' ``prompt_lookup_num_tokens`` and vLLM's
    ngram method): find the most recent earlier occurrence of the sequence's last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it.

    The defaults (matches of 1 to 4 tokens) come from replaying the default model's outputs on the bench
    suites (docs/MEASUREMENTS.md): with auto, drafting after a one-token match pays."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, device: torch.device | str = "cpu") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = torch.device(device)
        self.max_context: int | None = None

    def begin(self, prompt_ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prompt lookup keeps no state between rounds."""

    def part(self, sequences: Sequence[Sequence[int]]) -> str:
        return LOOKUP

    def propose(
        self,
        sequences: Sequence[Sequence[int]],
        num_tokens: int,
        sampler: BatchSampler,
        stop_rule: StopRule | None = None,
    ) -> Draft:
        """Given a ``stop_rule``, the copied tokens report ``lookup_confidence`` and the round ends after the
        first token the rule stops at (``sampler`` is not needed: the drafts are deterministic)."""
        return self.draft_from(self.matches(sequences, num_tokens), sequences, stop_rule)

    def matches(self, sequences: Sequence[Sequence[int]], num_tokens: int) -> list[tuple[int, np.ndarray]]:
        """Each row's ``match``: (match length, looked-up tokens), (0, empty) where it finds none."""
        return [self.match(np.asarray(s, dtype=np.int64), num_tokens) for s in sequences]

    def draft_from(
        self,
        matches: Sequence[tuple[int, np.ndarray]],
        sequences: Sequence[Sequence[int]],
        stop_rule: StopRule | None = None,
    ) -> Draft:
        """The batch's draft from each row's match; given a ``stop_rule``, cut where it stops and with the
        tokens' confidence (0 for padding)."""
        width = max(len(tokens) for _, tokens in matches)
        # Rows with shorter matches are padded; any deterministic draft is lossless, padding only costs
        # the verify positions the longest row needs anyway.
        rows = [
            np.pad(tokens, (0, width - len(tokens)), mode="edge") if len(tokens) else np.full(width, s[-1])
            for (_, tokens), s in zip(matches, sequences)
        ]
        confidence = None
        if stop_rule is not None:
            confidence = torch.zeros(len(matches), width)
            for row, (length, tokens) in enumerate(matches):
                confidence[row, : len(tokens)] = torch.from_numpy(lookup_confidence(length, len(tokens)))
            width = next((i + 1 for i in range(width) if stop_rule(confidence[:, i])), width)
            confidence = confidence[:, :width]
        token_ids = (
            torch.from_numpy(np.stack(rows)[:, :width]).to(self.device)
            if width
            else torch.zeros(len(sequences), 0, dtype=torch.int64, device=self.device)
        )
        return Draft(token_ids, None, confidence)

    def lookup(self, sequence: np.ndarray, num_tokens: int) -> np.ndarray:
        """Up to ``num_tokens`` tokens that followed the latest earlier match of the sequence's suffix."""
        return self.match(sequence, num_tokens)[1]

    def match(self, sequence: np.ndarray, num_tokens: int) -> tuple[int, np.ndarray]:
        """The longest suffix (``max_ngram`` down to ``min_ngram`` tokens) that occurred earlier, and up to
        ``num_tokens`` tokens that followed its latest occurrence; (0, empty) if there is none."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(sequence) <= n or num_tokens == 0:
                continue
            windows = sliding_window_view(sequence[:-1], n)
            matches = np.flatnonzero((windows == sequence[-n:]).all(axis=1))
            if len(matches):
                start = matches[-1] + n
                return n, sequence[start : start + num_tokens]
        return 0, sequence[:0]


class LookupFirstDrafter:
    """Prompt lookup where it finds a match, a model draft elsewhere: each round, when the n-gram lookup
    proposes tokens for every row, those are the round's drafts (at no model cost); otherwise the model
    drafts for the whole batch. Text that copies its context (code, extraction, summaries) then drafts for
    free, and free-form text still gets the model's drafts.

    Lookup drafts only after a match of at least ``LOOKUP_FIRST_MIN_NGRAM`` tokens: after a match of one
    token, prompt lookup is right less often than a model draft.

    Lossless as each part is: which drafter runs depends only on the committed sequences. The model's cache
    skips the lookup rounds; ``ModelDrafter`` feeds it the tokens committed meanwhile when it next drafts."""

    def __init__(self, model: ModelDrafter) -> None:
        self.lookup = PromptLookupDrafter(min_ngram=LOOKUP_FIRST_MIN_NGRAM, device=model.engine.device)
        self.model = model
        self.engine = model.engine
        self.max_context: int | None = model.max_context

    def begin(self, prompt_ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Start the model's batch (prompt lookup keeps no state)."""
        self.model.begin(prompt_ids, lengths)

    def part(self, sequences: Sequence[Sequence[int]]) -> str:
        return LOOKUP if all(length for length, _ in self.lookup.matches(sequences, 1)) else MODEL

    def propose(
        self,
        sequences: Sequence[Sequence[int]],
        num_tokens: int,
        sampler: BatchSampler,
        stop_rule: StopRule | None = None,
    ) -> Draft:
        matches = self.lookup.matches(sequences, num_tokens)
        if all(length for length, _ in matches):
            return self.lookup.draft_from(matches, sequences, stop_rule)
        return self.model.propose(sequences, num_tokens, sampler, stop_rule)
