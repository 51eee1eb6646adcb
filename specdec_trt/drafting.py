"""Draft strategies: propose up to a number of next tokens for each row of a step, per slot.

A drafter follows the sequences in the scheduler's slots: it admits a slot when a request arrives (its
prompt arrives chunk by chunk through ``prefill``), drafts for the rows of a round after their committed
sequences (prompt + accepted output, whose last token is not yet in any cache), and releases the slot when
the request ends. It returns the drafted ids with the distributions they were sampled from (None when every
draft is deterministic, as for prompt lookup or all-greedy rows: q is then one-hot on the drafted token),
and how many tokens each row drafted (rows may draft different numbers: the verify pass takes each row's own).

Given stop rules, a drafter reports the confidence of every token it drafted (a model draft: the probability it
drew the token with, ``drawn_confidence``; prompt lookup: ``lookup_confidence`` of its match), so the caller can
learn how well that confidence predicts acceptance, and asks the rule after each token whether to end the round
there. This keeps decoding lossless: how many tokens are drafted depends only on the draft's own samples and logits
(and on the committed prefix and earlier rounds), never on the target's verdict on this round, so every drafted
token is still a sample from the q it reports, and the rejection sampler's guarantee holds for any draft length
chosen that way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from specdec_trt.draft_store import DraftStore
from specdec_trt.runtime.engine import Engine
from specdec_trt.runtime.transfer import HostCopy, to_device
from specdec_trt.sampling import BatchSampler

# The kinds of draft a drafter's parts draft with (``Drafter.parts``): a draft model, prompt lookup in the request's
# own text, and lookup in earlier requests' text (``specdec_trt.draft_store``).
MODEL, LOOKUP, STORE = "model", "lookup", "store"
STORE_DRAFT_TOKENS = 64  # the most tokens a match in the store offers (a round drafts at most its limit of them)
LOOKUP_FIRST_MIN_NGRAM = 2  # shortest match on which lookup-first drafts by lookup rather than by its model
StopRule = Callable[[torch.Tensor, Sequence[int], np.ndarray], bool]
"""Asked after each drafted token with the draft's confidence in it per row [n], the rows' slots, and which
rows are still drafting [n] (bool): True ends the round there."""
LookupMatch = tuple[int, np.ndarray]
"""Prompt lookup's match for a row: the matched suffix's length (0: none) and the tokens that followed its latest
earlier occurrence."""


def confidence_below(threshold: float, exempt: Sequence[int] = ()) -> StopRule:
    """A fixed cut-off: end the round after a token whose confidence is below ``threshold`` in every row still
    drafting, unless a row of an ``exempt`` slot (one that drafts a fixed number) still drafts."""

    def rule(confidence: torch.Tensor, slots: Sequence[int], drafting: np.ndarray) -> bool:
        held = np.isin(np.asarray(slots), np.asarray(exempt, dtype=np.int64))
        if (drafting & held).any():
            return False
        return bool((confidence.cpu().numpy()[drafting] < threshold).all())

    return rule


def drawn_confidence(
    logits: torch.Tensor, token: torch.Tensor, probs: torch.Tensor | None, sampler: BatchSampler
) -> torch.Tensor:
    """A model draft's confidence in each row's drawn ``token`` [n]: its probability under the distribution the
    row sampled it from (``probs``, already computed), or for a greedy row, whose draw is one-hot, under the
    softmax of its ``logits`` (``probs`` is None where every row is greedy). Sampled rows so reuse the draw's
    pass over the vocabulary rather than make another each draft step, and their confidence is in the q that
    acceptance, min(1, p/q), depends on."""
    picked = token.unsqueeze(1)
    if probs is None:
        return logits.float().softmax(-1).gather(1, picked).squeeze(1)
    confidence = probs.gather(1, picked).squeeze(1)
    greedy = [i for i, params in enumerate(sampler.params) if params.greedy]
    if greedy:
        rows = to_device(torch.tensor(greedy), logits.device)
        confidence[rows] = logits[rows].float().softmax(-1).gather(1, picked[rows]).squeeze(1)
    return confidence


def lookup_confidence(match_length: int, count: int) -> np.ndarray:
    """Prompt lookup's confidence in the ``count`` tokens it copies after a match of ``match_length`` tokens:
    the i-th copied token continues a repeat of ``match_length + i`` tokens if the ones before it were right,
    and a repeat that has gone on for m tokens goes on with chance about m / (m + 1) (Laplace's rule of
    succession). Auto calibrates it online against the verifier, as a model draft's own probability."""
    run = match_length + np.arange(count)
    return run / (run + 1.0)


@dataclass(frozen=True)
class Draft:
    """Drafted tokens [n, k], of which row r drafted its first ``num_drafts[r]`` (the rest is padding); the
    distributions they were drawn from [n, k, V] (None: all one-hot); with stop rules, the draft's own
    probability of each drafted token [n, k] (else None)."""

    token_ids: torch.Tensor
    num_drafts: torch.Tensor  # int64 [n], on the host
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """The widest row's drafts."""
        return self.token_ids.shape[1]

    @classmethod
    def empty(cls, rows: int, device: torch.device) -> Draft:
        return cls(torch.zeros(rows, 0, dtype=torch.int64, device=device), torch.zeros(rows, dtype=torch.int64))


@dataclass(frozen=True)
class Part:
    """The part of a drafter that drafts a row this round: its ``kind`` (MODEL or LOOKUP), with prompt
    lookup's ``match`` for the row where lookup drafts it."""

    kind: str
    match: LookupMatch | None = None


@dataclass(frozen=True)
class DraftPlan:
    """What a round tells the drafter besides each row's limit: the part that drafts each row (``parts``,
    worked out once a round by ``Drafter.parts``; None for a row that never drafts) and each kind's stop rule
    (a kind without one drafts every row to its limit)."""

    parts: list[Part | None]
    stop_rules: dict[str, StopRule] = field(default_factory=dict)

    def subset(self, rows: Sequence[int]) -> DraftPlan:
        return DraftPlan([self.parts[i] for i in rows], self.stop_rules)


class Drafter(Protocol):
    """What the scheduler needs from a draft strategy."""

    max_context: int | None  # longest sequence the drafter can follow; None when unlimited

    def reserve(self, num_slots: int) -> None:
        """Hold at least ``num_slots`` slots."""

    def occupied(self, slot: int) -> bool:
        """Whether ``slot`` holds a sequence the drafter follows."""

    def admit(self, slot: int, prefix: Sequence[int] = (), source: int | None = None) -> None:
        """Start following a new sequence in ``slot``, whose first tokens ``prefix`` the target's cache already
        holds (a cached prefix, reused in ``slot`` or copied from ``source``'s): what the drafter's own cache of
        that slot holds of them is kept, the rest caught up. ``slot`` may still follow an ended sequence."""

    def prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> None:
        """The next chunk of each slot's prompt (the target has already run them)."""

    def release(self, slot: int) -> None:
        """Stop following ``slot``."""

    def remember(self, tokens: Sequence[int]) -> None:
        """An ended request's tokens, for later requests' drafts (kept where the drafter has a store)."""

    def forget(self) -> None:
        """Drop every earlier request's tokens it remembered."""

    def parts(self, sequences: Sequence[Sequence[int]]) -> list[Part]:
        """Which part drafts each row next, and what it found to draft from (a drafter combining two kinds of
        draft, with their own acceptance and cost, has "auto" choose a draft length per kind)."""

    def propose(
        self,
        slots: Sequence[int],
        sequences: Sequence[Sequence[int]],
        limits: Sequence[int],
        sampler: BatchSampler,
        plan: DraftPlan | None = None,
    ) -> Draft:
        """Draft up to ``limits[i]`` (>= 1) tokens after each committed sequence, each row by the part ``plan``
        names (None: worked out here, no stop rules). Given a stop rule for its kind, a part reports each
        token's confidence and ends its round after a token its rule stops at, keeping that token."""


class ModelDrafter:
    """Drafts by sampling autoregressively from a small model's engine, with each request's warping.

    Cache bookkeeping: the drafter remembers, per slot, how many committed tokens its cache held after the
    last round and which drafts it wrote after them. At the next round the drafts that were accepted are
    still valid; every committed token after them is fed in one step (usually the newest token, or the
    last two when every draft was accepted and the draft never ran on its own last token; more after rounds
    that drafted nothing for the row), each row with its own number of tokens.

    A self-draft (``cache_from``: the target's engine, with the same cache layout) feeds only each row's newest
    token: the keys and values of the committed tokens before it, which the target's passes computed, are
    copied from the target's cache, so even a long run of tokens the draft never saw (rounds drafted by
    prompt lookup, plain rounds) costs one draft step. Its own keys and values of accepted drafts are replaced
    by the target's too, which took fewer rounds on every bench suite (docs/MEASUREMENTS.md) and makes the
    draft's proposals depend on the committed text alone, so ``scripts/benchlib/replay.py`` replays them exactly.
    """

    def __init__(self, engine: Engine, cache_from: Engine | None = None) -> None:
        self.engine = engine
        self.cache_from = cache_from
        self.max_context: int | None = engine.max_context
        self._cached: dict[int, int] = {}  # per slot: committed tokens in the cache at the end of the last round
        self._fed: dict[int, list[int]] = {}  # per slot: the drafts written after them
        self._last_round: tuple[list[int], HostCopy] | None = None  # its slots and drafts, until read

    def reserve(self, num_slots: int) -> None:
        self.engine.reserve(num_slots)

    def occupied(self, slot: int) -> bool:
        return self.engine.occupied(slot)

    def admit(self, slot: int, prefix: Sequence[int] = (), source: int | None = None) -> None:
        """A model draft keeps the prefix its cache of ``source`` (default: ``slot``) holds, copied over when it
        is another slot's, and runs the rest in one step; a self-draft copies what it lacks from the target."""
        self._read_last_round()
        source = slot if source is None else source
        held = self._held(source, len(prefix))
        if not self.engine.occupied(slot):
            self.engine.admit(slot)
        if source == slot:
            self.engine.truncate([slot], [held])
        else:
            self.engine.truncate([slot], [0])
            if self.cache_from is None and held:
                self.engine.copy_from(self.engine, slot, held, source)
        if self.cache_from is not None:
            self.engine.copy_from(self.cache_from, slot, len(prefix))
        elif held < len(prefix):
            rest = list(prefix[held:])
            self.engine.step([slot], torch.tensor([rest]), [len(rest)], [len(rest) - 1])
        self._cached[slot], self._fed[slot] = len(prefix), []

    def _held(self, slot: int, limit: int) -> int:
        """Tokens of the sequence ``slot`` followed that its cache holds, up to ``limit``: the committed ones, and
        for a self-draft only those whose keys and values came from the target (not the newest, fed by itself)."""
        if slot not in self._cached or not self.engine.occupied(slot):
            return 0
        committed = self._cached[slot] - (self.cache_from is not None)
        return max(0, min(committed, self.engine.length(slot), limit))

    def prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> None:
        """Run the chunks on the draft in one step, or, for a self-draft, copy the target's keys and values."""
        stops = [int(self.engine.lengths[slot]) + len(chunk) for slot, chunk in zip(slots, chunks)]
        if self.cache_from is not None:
            for slot, stop in zip(slots, stops):
                self.engine.copy_from(self.cache_from, slot, stop)
        else:
            sizes = [len(chunk) for chunk in chunks]
            self.engine.step(slots, torch.tensor(pad_right(chunks)), sizes, [size - 1 for size in sizes])
        self._cached.update(zip(slots, stops))

    def release(self, slot: int) -> None:
        self._read_last_round()
        self.engine.release(slot)
        del self._cached[slot], self._fed[slot]

    def remember(self, tokens: Sequence[int]) -> None:
        """A model draft keeps no store."""

    def forget(self) -> None:
        """A model draft keeps no store."""

    def parts(self, sequences: Sequence[Sequence[int]]) -> list[Part]:
        return [Part(MODEL)] * len(sequences)

    def propose(
        self,
        slots: Sequence[int],
        sequences: Sequence[Sequence[int]],
        limits: Sequence[int],
        sampler: BatchSampler,
        plan: DraftPlan | None = None,
    ) -> Draft:
        stop_rule = None if plan is None else plan.stop_rules.get(MODEL)
        limits = np.asarray(limits, dtype=np.int64)
        logits = self._catch_up(slots, sequences)
        tokens, dists, confidences = [], [], []
        for i in range(int(limits.max())):
            token, probs = sampler.draw(logits, step=i)
            tokens.append(token)
            if probs is not None:  # None when every row is greedy: q is then one-hot on the draft
                dists.append(probs)
            drafting = limits > i
            if stop_rule is not None:
                confidences.append(drawn_confidence(logits, token, probs, sampler))
                if stop_rule(confidences[-1], slots, drafting):  # a host sync
                    break  # the token is kept: its logits are paid for, and it may still be accepted
            if i + 1 == limits.max():
                break
            logits = self.engine.step(slots, token.unsqueeze(1))[:, 0]
        token_ids = torch.stack(tokens, 1)
        self._cached.update((slot, len(s)) for slot, s in zip(slots, sequences))
        if self.cache_from is None:  # a self-draft takes the target's keys and values instead
            self._last_round = (list(slots), HostCopy(token_ids[:, :-1]))  # the last draft is in no cache
        num_drafts = torch.from_numpy(np.minimum(limits, len(tokens)))
        probs = torch.stack(dists, 1) if dists else None
        return Draft(token_ids, num_drafts, probs, torch.stack(confidences, 1) if confidences else None)

    def _read_last_round(self) -> None:
        """Record which drafts the last round wrote into each row's cache (copied to the host during the round,
        which the scheduler has synchronised since)."""
        if self._last_round is not None:
            slots, copy = self._last_round
            for slot, drafts in zip(slots, copy.get().tolist()):
                if slot in self._fed:
                    self._fed[slot] = drafts
            self._last_round = None

    def _catch_up(self, slots: Sequence[int], sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Feed each row the committed tokens its cache lacks; the logits after its last token [n, V]."""
        self._read_last_round()
        lengths = [len(s) for s in sequences]
        in_cache = self.engine.lengths[list(slots)].tolist()
        if self.cache_from is not None:
            # A self-draft: from the token it last fed on, its own keys and values give way to the target's,
            # which hold all but each row's newest token.
            bases = [min(self._cached[slot] - 1, cached) for slot, cached in zip(slots, in_cache)]
            self.engine.truncate(slots, bases)
            for slot, length in zip(slots, lengths):
                self.engine.copy_from(self.cache_from, slot, length - 1)
            valid = [length - 1 for length in lengths]
        else:
            valid = [
                min(_matching_prefix(s, self._cached[slot], self._fed[slot]), length - 1, cached)
                for slot, s, length, cached in zip(slots, sequences, lengths, in_cache)
            ]
            self.engine.truncate(slots, valid)
        missing = [length - v for length, v in zip(lengths, valid)]
        block = pad_right([s[v:] for s, v in zip(sequences, valid)])
        return self.engine.step(slots, torch.tensor(block), missing, [m - 1 for m in missing])[:, 0]


def pad_right(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """Token rows of different lengths as one block, each padded with its own last token (padding is never
    read: a step takes each row's own number of new tokens)."""
    width = max(len(row) for row in rows)
    return [list(row) + [row[-1]] * (width - len(row)) for row in rows]


def _matching_prefix(sequence: Sequence[int], base: int, drafts: list[int]) -> int:
    """Committed tokens in the cache: the ``base`` known ones, then the drafts the sequence went on with."""
    count = 0
    while count < len(drafts) and base + count < len(sequence) and sequence[base + count] == drafts[count]:
        count += 1
    return base + count


class PromptLookupDrafter:
    """Model-free drafting by n-gram match (as transformers' ``prompt_lookup_num_tokens`` and vLLM's
    ngram method): find the most recent earlier occurrence of the sequence's last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it. A row drafts as many tokens
    as it finds, up to its limit (none where it finds no match). Given a ``store``, a row whose own text has no
    match as long as the store's shortest drafts from earlier requests' text (a STORE part) where the store has
    one.

    The defaults (matches of 1 to 4 tokens) come from replaying the default model's outputs on the bench
    suites (docs/MEASUREMENTS.md): with auto, drafting after a one-token match pays."""

    def __init__(
        self,
        max_ngram: int = 4,
        min_ngram: int = 1,
        device: torch.device | str = "cpu",
        store: DraftStore | None = None,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = torch.device(device)
        self.store = store
        self.max_context: int | None = None

    def reserve(self, num_slots: int) -> None:
        """Prompt lookup keeps no state."""

    def occupied(self, slot: int) -> bool:
        return False

    def admit(self, slot: int, prefix: Sequence[int] = (), source: int | None = None) -> None:
        """Prompt lookup keeps no state: it searches each round's sequence afresh."""

    def prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> None:
        """Prompt lookup keeps no state."""

    def release(self, slot: int) -> None:
        """Prompt lookup keeps no state."""

    def remember(self, tokens: Sequence[int]) -> None:
        if self.store is not None:
            self.store.add(tokens)

    def forget(self) -> None:
        if self.store is not None:
            self.store.clear()

    def parts(self, sequences: Sequence[Sequence[int]]) -> list[Part]:
        """Each row's match in its own text, else in the store (one search a round: the draft copies from it)."""
        return [self._part(np.asarray(s, dtype=np.int64)) for s in sequences]

    def _part(self, sequence: np.ndarray) -> Part:
        own = self.match(sequence, len(sequence))
        if self.store is None or own[0] >= self.store.min_ngram:
            return Part(LOOKUP, own)
        earlier = self.store.match(sequence, STORE_DRAFT_TOKENS)
        return Part(STORE, earlier) if earlier[0] else Part(LOOKUP, own)

    def propose(
        self,
        slots: Sequence[int],
        sequences: Sequence[Sequence[int]],
        limits: Sequence[int],
        sampler: BatchSampler,
        plan: DraftPlan | None = None,
    ) -> Draft:
        """Given a stop rule for its kind (LOOKUP or STORE), a row's copied tokens report ``lookup_confidence``
        and its kind's rows end after the first token the rule stops at (``sampler`` is not needed: the drafts are
        deterministic)."""
        parts = self.parts(sequences) if plan is None else plan.parts
        drafts = []
        for kind in (LOOKUP, STORE):
            rows = [i for i, part in enumerate(parts) if part.kind == kind]
            if rows:
                matches = [(parts[i].match[0], parts[i].match[1][: int(limits[i])]) for i in rows]
                rule = None if plan is None else plan.stop_rules.get(kind)
                picked = [slots[i] for i in rows], [sequences[i] for i in rows]
                drafts.append((rows, self.draft_from(matches, *picked, rule)))
        return merge_drafts(drafts, len(sequences))

    def draft_from(
        self,
        matches: Sequence[tuple[int, np.ndarray]],
        slots: Sequence[int],
        sequences: Sequence[Sequence[int]],
        stop_rule: StopRule | None = None,
    ) -> Draft:
        """The draft from each row's match; given a ``stop_rule``, cut where it stops, with the tokens'
        confidence (0 for padding)."""
        found = np.array([len(tokens) for _, tokens in matches], dtype=np.int64)
        width = int(found.max(initial=0))
        rows = [
            np.pad(tokens, (0, width - len(tokens)), constant_values=s[-1])
            for (_, tokens), s in zip(matches, sequences)
        ]
        confidence = None
        if stop_rule is not None:
            confidence = torch.zeros(len(matches), width)
            for row, (length, tokens) in enumerate(matches):
                confidence[row, : len(tokens)] = torch.from_numpy(lookup_confidence(length, len(tokens)))
            width = next((i + 1 for i in range(width) if stop_rule(confidence[:, i], slots, found > i)), width)
            confidence = confidence[:, :width]
        if width == 0:
            return Draft.empty(len(sequences), self.device)
        token_ids = torch.from_numpy(np.stack(rows)[:, :width]).to(self.device)
        return Draft(token_ids, torch.from_numpy(np.minimum(found, width)), None, confidence)

    def lookup(self, sequence: np.ndarray, num_tokens: int) -> np.ndarray:
        """Up to ``num_tokens`` tokens that followed the latest earlier match of the sequence's suffix."""
        return self.match(sequence, num_tokens)[1]

    def match(self, sequence: np.ndarray, num_tokens: int) -> tuple[int, np.ndarray]:
        """The longest suffix (``max_ngram`` down to ``min_ngram`` tokens) that occurred earlier, and up to
        ``num_tokens`` tokens that followed its latest occurrence; (0, empty) if there is none. Runs on every
        row every round: one pass over the sequence finds where its last token occurred before, and only
        those places are extended backwards."""
        if num_tokens == 0 or len(sequence) <= self.min_ngram:
            return 0, sequence[:0]
        earlier = sequence[:-1]
        ends = np.flatnonzero(earlier == sequence[-1])  # where the suffix's last n tokens occurred before
        n = 1 if len(ends) else 0
        while 0 < n < min(self.max_ngram, len(earlier)):
            longer = ends[ends >= n]
            longer = longer[earlier[longer - n] == sequence[-1 - n]]
            if not len(longer):
                break
            ends, n = longer, n + 1
        if n < self.min_ngram:
            return 0, sequence[:0]
        start = int(ends[-1]) + 1
        return n, sequence[start : start + num_tokens]


class LookupFirstDrafter:
    """Prompt lookup where it finds a match, a model draft elsewhere, row by row: a row whose text repeats
    itself drafts for free by lookup, the others with the model, in the same round. Text that copies its
    context (code, extraction, summaries) then drafts for free, and free-form text still gets the model's
    drafts.

    Lookup drafts only after a match of at least ``LOOKUP_FIRST_MIN_NGRAM`` tokens: after a match of one
    token, prompt lookup is right less often than a model draft. Given a ``store``, a row whose own text has no
    match as long as the store's shortest drafts from earlier requests' text where the store has one, before
    the model.

    Lossless as each part is: which part drafts a row depends only on its committed sequence. The model's cache
    skips a row's lookup rounds; ``ModelDrafter`` feeds it the tokens committed meanwhile when it next drafts."""

    def __init__(self, model: ModelDrafter, store: DraftStore | None = None) -> None:
        self.lookup = PromptLookupDrafter(min_ngram=LOOKUP_FIRST_MIN_NGRAM, device=model.engine.device, store=store)
        self.model = model
        self.engine = model.engine
        self.max_context: int | None = model.max_context

    def reserve(self, num_slots: int) -> None:
        self.model.reserve(num_slots)

    def occupied(self, slot: int) -> bool:
        return self.model.occupied(slot)

    def admit(self, slot: int, prefix: Sequence[int] = (), source: int | None = None) -> None:
        self.model.admit(slot, prefix, source)

    def prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> None:
        self.model.prefill(slots, chunks)

    def release(self, slot: int) -> None:
        self.model.release(slot)

    def remember(self, tokens: Sequence[int]) -> None:
        self.lookup.remember(tokens)

    def forget(self) -> None:
        self.lookup.forget()

    def parts(self, sequences: Sequence[Sequence[int]]) -> list[Part]:
        return [part if part.match[0] else Part(MODEL) for part in self.lookup.parts(sequences)]

    def propose(
        self,
        slots: Sequence[int],
        sequences: Sequence[Sequence[int]],
        limits: Sequence[int],
        sampler: BatchSampler,
        plan: DraftPlan | None = None,
    ) -> Draft:
        plan = DraftPlan(self.parts(sequences)) if plan is None else plan
        drafts: list[tuple[list[int], Draft]] = []
        for kinds, drafter in (((LOOKUP, STORE), self.lookup), ((MODEL,), self.model)):
            rows = [i for i, part in enumerate(plan.parts) if part.kind in kinds]
            if rows:
                picked = (
                    [slots[i] for i in rows],
                    [sequences[i] for i in rows],
                    [limits[i] for i in rows],
                    sampler.subset(rows),
                )
                drafts.append((rows, drafter.propose(*picked, plan.subset(rows))))
        return merge_drafts(drafts, len(sequences))


def merge_drafts(parts: Sequence[tuple[list[int], Draft]], rows: int) -> Draft:
    """One draft for ``rows`` rows from drafts of some of them (each with its row indices). Where one part
    has distributions and another none, the other's drafts get one-hot ones (what they were drawn from)."""
    if len(parts) == 1 and parts[0][0] == list(range(rows)):
        return parts[0][1]
    width = max(draft.num_tokens for _, draft in parts)
    device = parts[0][1].token_ids.device
    token_ids = torch.zeros(rows, width, dtype=torch.int64, device=device)
    num_drafts = torch.zeros(rows, dtype=torch.int64)
    vocab = next((draft.probs.shape[-1] for _, draft in parts if draft.probs is not None), None)
    with_confidence = any(draft.confidence is not None for _, draft in parts)
    probs = torch.zeros(rows, width, vocab, device=device) if vocab is not None and width else None
    confidence = torch.zeros(rows, width) if with_confidence else None
    for indices, draft in parts:
        at, k = to_device(torch.tensor(indices), device), draft.num_tokens
        token_ids[at, :k] = draft.token_ids
        num_drafts[indices] = draft.num_drafts
        if probs is not None and k:
            probs[at, :k] = draft.probs if draft.probs is not None else one_hot(draft.token_ids, vocab)
        if confidence is not None and draft.confidence is not None:
            confidence[indices, : draft.confidence.shape[1]] = draft.confidence
    return Draft(token_ids, num_drafts, probs, confidence)


def one_hot(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The distributions [..., V] that put all mass on ``token_ids``."""
    return torch.zeros(*token_ids.shape, vocab_size, device=token_ids.device).scatter_(-1, token_ids.unsqueeze(-1), 1.0)
