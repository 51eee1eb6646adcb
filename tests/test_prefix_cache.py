"""Prefix caching across requests (``specdec_trt.prefix_cache``) and drafts from earlier requests' text
(``specdec_trt.draft_store``), on both engines: a request that finds a prefix of its prompt cached, in its slot or
copied from another, gives exactly the greedy output it gives without the cache, at every prefix length; a rollback
off by one token is caught; the exact sampled distribution holds with cache hits and store drafts; idle slots are
evicted least recently used first; the store keeps to its memory bound."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from test_losslessness import PASS_P, PROMPT, REJECT_P, VOCAB, WARPINGS, chi_square_p, exact_joint, no_residual
from test_scheduler import GREEDY, checkpoints, engine_dir, lossless_models, make_decoder  # noqa: F401 - fixtures

import specdec_trt.prefix_cache
import specdec_trt.rejection
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.build import BuildRequest, build
from specdec_trt.decoder import AUTO
from specdec_trt.draft_store import DraftStore
from specdec_trt.drafting import PromptLookupDrafter
from specdec_trt.prefix_cache import Placement, PrefixCache
from specdec_trt.request import SchedulerClosedError
from specdec_trt.runtime.engine import ContextOverflowError
from specdec_trt.validation import InvalidValueError

SHORT = dataclasses.replace(GREEDY, max_new_tokens=6)
BASE = "the cat sat"
SYSTEM = "you are an agent. tools: add, sub. answer in json. "


@pytest.fixture(scope="module")
def int4_engines(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811 - the fixture
    out = tmp_path_factory.mktemp("prefix") / "int4"
    build(BuildRequest(out=out, target=checkpoints[0], draft="int4", max_draft_len=8, max_context=128))
    return out


def prompts_sharing(sequence: list[int], tail: list[int]) -> list[tuple[int, list[int]]]:
    """(shared prefix length, prompt) for every prefix of ``sequence``: the prefix followed by ``tail`` (a prompt
    that diverges there), and the prefix alone (a prompt the cached tokens start with)."""
    cases = []
    for shared in range(len(sequence) + 1):
        cases.append((shared, sequence[:shared] + tail))
        if shared:
            cases.append((shared, sequence[:shared]))
    return cases


def check_every_prefix_length(cached: SpeculativeDecoder, reference: SpeculativeDecoder, k) -> None:
    """Through one slot, so that the base request's sequence is what each next request finds cached."""
    base = cached.tokenize(BASE)
    sequence = base + cached.generate(base, SHORT, k).token_ids
    # A character the sequence never holds, so that a prompt diverges from it right after the shared prefix.
    tail = cached.tokenize(next(c for c in "xyzqjk!?" if cached.tokenize(c)[0] not in sequence))
    for shared, prompt in prompts_sharing(sequence, tail):
        cached.generate(base, SHORT, k)  # the slot holds the base sequence again, but for its newest token
        output = cached.generate(prompt, SHORT, k)
        assert output.token_ids == reference.generate(prompt, SHORT, k).token_ids, (shared, prompt)
        expected = min(shared, len(prompt) - 1, len(sequence) - 1)
        assert output.stats.cached_prompt_tokens == expected, (shared, prompt)


@pytest.mark.parametrize("k", [0, 2, AUTO])
def test_a_cache_hit_gives_the_uncached_greedy_output_at_every_prefix_length(make_decoder, k) -> None:  # noqa: F811
    """From no token shared to the whole prompt, including prompts that the cached tokens start with and
    cached sequences that ran past their prompt into their output; plain, a fixed draft length and auto."""
    check_every_prefix_length(make_decoder(max_batch_size=1), make_decoder(prefix_cache=False), k)


@pytest.mark.parametrize("k", [2, AUTO])
def test_the_int4_self_draft_takes_a_cached_prefix_from_the_target(int4_engines: Path, k) -> None:
    """The self-draft's cache follows the target's: lookup-first with the int4 draft, as the default engines run."""
    cached = SpeculativeDecoder.from_engines(int4_engines, max_batch_size=1)
    check_every_prefix_length(cached, SpeculativeDecoder.from_engines(int4_engines, prefix_cache=False), k)


def test_a_rollback_off_by_one_token_is_caught(make_decoder, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Negative control: a prefix cache that keeps one token past the shared prefix (the next request would see
    the cached request's token there) fails the every-prefix-length check."""
    place = PrefixCache.place

    def one_too_many(self, prompt, busy, empty_slot) -> Placement:
        held = {slot: len(self.cached_tokens(slot)) for slot in self.idle_slots}
        placement = place(self, prompt, busy, empty_slot)
        if placement.source is None and placement.cached < min(held.get(placement.slot, 0), len(prompt) - 1):
            placement = dataclasses.replace(placement, cached=placement.cached + 1)
        return placement

    monkeypatch.setattr(specdec_trt.prefix_cache.PrefixCache, "place", one_too_many)
    with pytest.raises(AssertionError):
        check_every_prefix_length(make_decoder(max_batch_size=1), make_decoder(prefix_cache=False), 2)


def test_staggered_requests_sharing_a_prefix_keep_their_outputs(make_decoder) -> None:  # noqa: F811
    """Requests sharing a system prompt arrive while others decode: each copies the prefix from a busy or idle
    slot, and gives exactly its solo output."""
    decoder, reference = make_decoder(max_batch_size=3), make_decoder(prefix_cache=False)
    prompts = [SYSTEM + question for question in ("add 1 2", "sub 3 1", "add 5 5", "sub 9 9", "add 0 7")]
    params = [dataclasses.replace(GREEDY, max_new_tokens=n) for n in (20, 8, 16, 4, 12)]
    alone = [reference.generate(p, q, AUTO).token_ids for p, q in zip(prompts, params)]
    handles = []
    for prompt, p in zip(prompts, params):
        handles.append(decoder.submit(prompt, p, AUTO))
        next(iter(handles[-1]), None)  # the next request arrives once this one is decoding
    outputs = [h.result() for h in handles]
    assert [o.token_ids for o in outputs] == alone
    system_tokens = len(decoder.tokenize(SYSTEM))
    assert all(o.stats.cached_prompt_tokens >= system_tokens - 1 for o in outputs[1:])


def test_a_slot_reused_after_its_prefix_was_copied_leaves_the_copy_alone(make_decoder) -> None:  # noqa: F811
    """B copies its prefix from A's busy slot; A ends, and its slot goes to an unrelated request C while B
    decodes: B's output is its solo one."""
    decoder, reference = make_decoder(max_batch_size=2), make_decoder(prefix_cache=False)
    a, b, c = SYSTEM + "add 1 2", SYSTEM + "sub 3 1", "zzz yyy"
    long = dataclasses.replace(GREEDY, max_new_tokens=30)
    first = decoder.submit(a, SHORT, 2)
    next(iter(first))
    second = decoder.submit(b, long, 2)
    stream = iter(second)
    next(stream)
    first.result()
    third = decoder.submit(c, SHORT, 2)
    assert second.result().token_ids == reference.generate(b, long, 2).token_ids
    assert second.result().stats.cached_prompt_tokens >= len(decoder.tokenize(SYSTEM)) - 1
    assert third.result().token_ids == reference.generate(c, SHORT, 2).token_ids
    assert third.result().stats.cached_prompt_tokens == 0


def test_idle_slots_are_evicted_least_recently_used_first(make_decoder) -> None:  # noqa: F811
    decoder = make_decoder(max_batch_size=2)
    first, second, third = "abcdefgh", "bcdefghi", "cdefghij"
    length = len(decoder.tokenize(first))
    decoder.generate(first, SHORT, 2)
    decoder.generate(second, SHORT, 2)
    assert decoder.generate(first, SHORT, 2).stats.cached_prompt_tokens == length - 1  # first: most recent
    assert decoder.generate(third, SHORT, 2).stats.cached_prompt_tokens == 0  # evicts second, not first
    assert decoder.generate(first, SHORT, 2).stats.cached_prompt_tokens == length - 1
    assert decoder.generate(second, SHORT, 2).stats.cached_prompt_tokens == 0  # it was evicted
    assert len(decoder.scheduler.prefix_cache.idle_slots) == 2


def test_a_cancelled_request_from_a_cached_prefix_leaves_a_usable_slot(make_decoder) -> None:  # noqa: F811
    decoder, reference = make_decoder(max_batch_size=1), make_decoder(prefix_cache=False)
    prompt = SYSTEM + "add 1 2"
    long = dataclasses.replace(GREEDY, max_new_tokens=40)
    decoder.generate(SYSTEM, SHORT, AUTO)
    handle = decoder.submit(prompt, long, AUTO)
    next(iter(handle))
    handle.cancel()
    cancelled = handle.result()
    assert cancelled.finish_reason == "cancelled" and cancelled.stats.cached_prompt_tokens > 0
    again = decoder.generate(prompt, long, AUTO)
    assert again.token_ids == reference.generate(prompt, long, AUTO).token_ids
    assert again.stats.cached_prompt_tokens == len(decoder.tokenize(prompt)) - 1


def test_bad_prompts_are_clear_errors_with_a_cache(make_decoder) -> None:  # noqa: F811
    decoder = make_decoder(max_batch_size=1)
    decoder.generate(BASE, SHORT, 2)
    with pytest.raises(InvalidValueError, match="the prompt is empty"):
        decoder.generate("", SHORT, 2)
    with pytest.raises(ContextOverflowError, match="shorten the prompt"):
        decoder.generate(BASE * 20, SHORT, 2)
    same = decoder.tokenize(BASE)  # exactly the cached prompt: all but its last token are reused
    assert decoder.generate(same, SHORT, 2).stats.cached_prompt_tokens == len(same) - 1


def test_without_the_prefix_cache_every_slot_is_released(make_decoder) -> None:  # noqa: F811
    decoder = make_decoder(prefix_cache=False)
    outputs = decoder.generate_batch([BASE, BASE], SHORT, 2)
    assert decoder.generate(BASE, SHORT, 2).stats.cached_prompt_tokens == 0
    assert [o.stats.cached_prompt_tokens for o in outputs] == [0, 0]
    assert decoder.target.lengths.sum() == 0 and not decoder.scheduler.prefix_cache.idle_slots


def test_an_idle_slot_freed_by_a_direct_use_of_the_engines_is_forgotten(make_decoder) -> None:  # noqa: F811
    """A benchmark or test that runs the decoder's engines directly (and frees their slots) between calls leaves
    no stale prefix behind: the next request starts from nothing, with its uncached output."""
    decoder, reference = make_decoder(max_batch_size=1), make_decoder(prefix_cache=False)
    decoder.generate(BASE, SHORT, 2)
    (slot,) = decoder.scheduler.prefix_cache.idle_slots
    decoder.target.release(slot)
    decoder.drafter.release(slot)
    output = decoder.generate(BASE, SHORT, 2)
    assert output.stats.cached_prompt_tokens == 0
    assert output.token_ids == reference.generate(BASE, SHORT, 2).token_ids


def test_a_reset_releases_every_idle_slot_and_empties_the_store(checkpoints) -> None:  # noqa: F811
    """After ``reset_prefix_cache`` a request starts as on a fresh decoder: nothing cached, nothing drafted from
    earlier requests, the engines' slots all free, and the same output."""
    decoder = SpeculativeDecoder.from_pretrained(checkpoints[0], "ngram", num_draft_tokens=AUTO, max_context=128)
    params = dataclasses.replace(GREEDY, max_new_tokens=40)
    prompt = decoder.tokenize(SYSTEM)
    first = decoder.generate(prompt, params, 0)
    assert decoder.scheduler.prefix_cache.idle_slots and len(decoder.drafter.store) == 1
    decoder.reset_prefix_cache()
    assert not decoder.scheduler.prefix_cache.idle_slots and len(decoder.drafter.store) == 0
    assert not any(decoder.target.occupied(slot) for slot in range(decoder.target.num_slots))
    again = decoder.generate(prompt + first.token_ids[:4], dataclasses.replace(params, max_new_tokens=36))
    assert again.token_ids == first.token_ids[4:]
    assert again.stats.cached_prompt_tokens == 0 and again.stats.store_drafted_tokens == 0
    decoder.close()
    with pytest.raises(SchedulerClosedError):
        decoder.reset_prefix_cache()


# --- drafts from earlier requests' text --------------------------------------------------------------------


def test_the_store_finds_what_followed_the_longest_suffix_match() -> None:
    store = DraftStore(min_ngram=2, max_ngram=4)
    store.add([1, 2, 3, 4, 5, 6])
    store.add([9, 3, 4, 7, 8])  # later: the latest occurrence of (3, 4) wins
    length, following = store.match(np.array([0, 3, 4]), 8)
    assert (length, following.tolist()) == (2, [7, 8])
    length, following = store.match(np.array([2, 5, 6]), 8)  # (5, 6) has nothing after it
    assert length == 0 and following.tolist() == []
    length, following = store.match(np.array([9, 3, 4]), 1)
    assert (length, following.tolist()) == (3, [7])


def test_the_store_keeps_to_its_memory_bound_least_recently_used_out() -> None:
    store = DraftStore(max_tokens=100, min_ngram=2)
    sequences = [list(range(start, start + 40)) for start in (0, 1000, 2000)]
    store.add(sequences[0])
    store.add(sequences[1])
    assert store.match(np.array([0, 1]), 2)[0] == 2  # drafting from the first makes it the most recently used
    store.add(sequences[2])  # 120 tokens: the least recently used one, the second, goes
    assert store.num_tokens == 80 and len(store) == 2
    assert store.match(np.array([1000, 1001]), 2)[0] == 0
    assert store.match(np.array([2000, 2001]), 2)[1].tolist() == [2002, 2003]
    assert store.match(np.array([5, 6]), 1)[1].tolist() == [7]
    store.add(list(range(500)))  # longer than the whole bound: not kept
    assert store.num_tokens == 80


def test_a_request_drafts_from_what_an_earlier_request_said(checkpoints) -> None:  # noqa: F811
    """A later request that goes on as an earlier one did drafts from the store, the drafts are accepted, and its
    output is the plain one."""
    decoder = SpeculativeDecoder.from_pretrained(checkpoints[0], "ngram", num_draft_tokens=AUTO, max_context=128)
    assert isinstance(decoder.drafter, PromptLookupDrafter) and decoder.drafter.store is not None
    params = dataclasses.replace(GREEDY, max_new_tokens=40)
    prompt = decoder.tokenize(SYSTEM)
    first = decoder.generate(prompt, params, 0)
    later = decoder.generate(prompt + first.token_ids[:4], dataclasses.replace(params, max_new_tokens=36))
    assert later.token_ids == first.token_ids[4:]
    assert later.stats.store_drafted_tokens > 0 and later.stats.store_accepted_tokens > 0


def test_without_the_store_no_request_drafts_from_earlier_ones(checkpoints) -> None:  # noqa: F811
    """``draft_store=False`` (as specdec-bench runs, each run cold): ended requests' text is not kept."""
    decoder = SpeculativeDecoder.from_pretrained(checkpoints[0], "ngram", max_context=128, draft_store=False)
    params = dataclasses.replace(GREEDY, max_new_tokens=40)
    prompt = decoder.tokenize(SYSTEM)
    first = decoder.generate(prompt, params, 0)
    later = decoder.generate(prompt + first.token_ids[:4], dataclasses.replace(params, max_new_tokens=36), AUTO)
    assert later.token_ids == first.token_ids[4:]
    assert later.stats.store_drafted_tokens == 0 and len(decoder.drafter.store) == 0


# --- the exact distribution, from a cached prefix with drafts from the store -------------------------------

RUNS = 12_000


def cached_store_counts(decoder: SpeculativeDecoder, params: SamplingParams) -> np.ndarray:
    """Counts of the first 3 tokens of RUNS requests of one prompt, in batches of 250: every request after the
    first finds its prompt cached, and its round after the token its prefill gave drafts from the store, filled
    with the earlier requests' outputs (its own text has no match that long)."""
    handles = []
    torch.manual_seed(0)  # unseeded requests: rejection sampling, with torch's global generator
    for _ in range(0, RUNS, 250):
        batch = [dataclasses.replace(params, seed=None, max_new_tokens=3, ignore_eos=True)] * 250
        handles += decoder.submit_batch([PROMPT] * len(batch), batch, num_draft_tokens=2)
    outputs = [h.result() for h in handles]
    assert sum(o.stats.store_drafted_tokens for o in outputs) > 0.9 * RUNS, "the store should draft most rounds"
    assert sum(o.stats.cached_prompt_tokens > 0 for o in outputs) > RUNS * 0.9
    codes = [int(np.ravel_multi_index(o.token_ids[:3], (VOCAB,) * 3)) for o in outputs]
    return np.bincount(codes, minlength=VOCAB**3)


@pytest.mark.slow
def test_cached_prefixes_and_store_drafts_keep_the_exact_distribution(lossless_models, monkeypatch) -> None:  # noqa: F811
    """The chi-square test of the core (DESIGN.md) on requests that start from a cached prefix and draft from
    earlier requests' outputs; the same run with the residual distribution broken is rejected."""
    (target, _), reference = lossless_models
    decoder = SpeculativeDecoder.from_pretrained(target, "ngram", max_context=24, max_batch_size=64)
    params = WARPINGS["combined"]
    probs = exact_joint(reference, params)
    assert chi_square_p(cached_store_counts(decoder, params), probs) > PASS_P
    monkeypatch.setattr(specdec_trt.rejection, "recovery_distribution", no_residual)
    assert chi_square_p(cached_store_counts(decoder, params), probs) < REJECT_P
