"""Continuous batching (``specdec_trt.scheduler``): requests join a running batch and leave it at once, on both
engines. A request's greedy output never depends on what it shares the batch with; sampled output keeps the
target's exact distribution; a cancelled, refused or failed request touches no other; a long prompt is
prefilled in chunks between the running requests' rounds; any number of threads may call one decoder."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from test_losslessness import (
    DEPTH,
    PROMPT,
    REJECT_P,
    VOCAB,
    WARPINGS,
    chi_square_p,
    exact_joint,
    no_residual,
    noise_keyed_without_positions,  # noqa: F401 - a fixture
    steady_clock,  # noqa: F401 - a fixture
)
from transformers import AutoModelForCausalLM

import specdec_trt.rejection
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.build import BuildRequest, build
from specdec_trt.costs import Costs, PassContext, PassCost, pass_features
from specdec_trt.draft_spec import AUTO, DraftSpec
from specdec_trt.drafting import LOOKUP, ModelDrafter, PromptLookupDrafter
from specdec_trt.loading import load_engines, open_engine_directory
from specdec_trt.planner import DraftPlanner
from specdec_trt.prefill import DEFAULT_PREFILL_CHUNK_ROUNDS, MIN_PREFILL_CHUNK, PrefillPolicy, PrefillQueue
from specdec_trt.request import GenerationError, QueueFullError, Request, SchedulerClosedError
from specdec_trt.runtime.engine import ContextOverflowError
from specdec_trt.sampling import BatchSampler
from specdec_trt.text import TextTracker

SIZE = {"hidden_size": 64, "head_dim": 16}  # exportable to ONNX
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
PROMPTS = ["the cat sat on the mat", "hello there", "abc abc abc abc", "a long way", "quiet", "one two one two"]
LENGTHS = [24, 6, 15, 30, 3, 11]  # requests of mixed lengths finish, and free their slots, at different rounds
DRAFT_LENGTHS = [0, 2, AUTO, 5, 1, AUTO]
PASS_P = 1e-3


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint) -> tuple[Path, Path]:
    target = {"family": "llama", **SIZE}
    return make_checkpoint(**target), make_checkpoint(draft_of=(target, 0.1), seed=5, **SIZE)


@pytest.fixture(scope="module")
def engine_dir(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sched") / "engines"
    build(BuildRequest(out=out, target=checkpoints[0], draft=checkpoints[1], max_draft_len=8, max_context=128))
    return out


@pytest.fixture(params=["pytorch", "onnxruntime"])
def make_decoder(request, checkpoints, engine_dir):
    """A factory of decoders with a model draft on one engine, taking the scheduler's settings."""

    def make(**settings) -> SpeculativeDecoder:
        if request.param == "pytorch":
            loaded, _, _ = load_engines(*checkpoints, max_context=128)
        else:
            loaded = open_engine_directory(engine_dir, [DraftSpec.parse("engine")])
        drafter = loaded.only_drafter()
        return SpeculativeDecoder(loaded.target, drafter, loaded.tokenizer, loaded.eos_token_ids, **settings)

    return make


def solo(decoder: SpeculativeDecoder, prompt: str, params: SamplingParams, k) -> list[int]:
    return decoder.generate(prompt, params, num_draft_tokens=k).token_ids


def requests() -> list[tuple[str, SamplingParams, object]]:
    return [
        (prompt, dataclasses.replace(GREEDY, max_new_tokens=n), k)
        for prompt, n, k in zip(PROMPTS, LENGTHS, DRAFT_LENGTHS)
    ]


def test_greedy_output_does_not_depend_on_the_batch(make_decoder) -> None:
    """Six requests of mixed lengths and draft lengths (fixed, 0 and auto) through two slots, so that each
    joins the batch when another leaves it, mid-generation; then the same requests submitted from threads
    as earlier ones stream. Each gives exactly the tokens it gives alone."""
    decoder = make_decoder(max_batch_size=2)
    alone = [solo(decoder, prompt, params, k) for prompt, params, k in requests()]
    handles = [decoder.submit(prompt, params, k) for prompt, params, k in requests()]
    assert [h.result().token_ids for h in handles] == alone
    decoder.scheduler.max_batch_size = 4
    handles = []
    for prompt, params, k in requests():
        handles.append(decoder.submit(prompt, params, k))
        next(iter(handles[-1]), None)  # the next request arrives once this one is decoding
    assert [h.result().token_ids for h in handles] == alone


def test_a_finished_request_leaves_the_batch_at_once(make_decoder) -> None:
    decoder = make_decoder()
    decoder.scheduler.events = []
    params = [dataclasses.replace(GREEDY, max_new_tokens=n) for n in (2, 12)]
    short, long = decoder.submit_batch(["hi", "hello there"], params, 2)
    long.result()
    rounds = [event.request_id for event in decoder.scheduler.events if event.kind == "round"]
    last_short = max(i for i, r in enumerate(rounds) if r == short.request_id)
    assert short.result().finish_reason == "length"
    assert rounds[last_short + 1 :] and set(rounds[last_short + 1 :]) == {long.request_id}
    assert decoder.scheduler.num_running == 0
    assert len(decoder.scheduler.prefix_cache.idle_slots) == 2  # each slot keeps its prefix for later requests


@pytest.mark.usefixtures("steady_clock")
def test_seeded_sampling_repeats_with_the_same_schedule(make_decoder) -> None:
    """The same seeds and the same submissions give the same tokens, run after run. Fixed draft lengths need
    nothing more; auto's draft lengths follow measured times, which the steady clock makes repeatable (on a
    real clock auto's sampled output is the same in distribution, not token for token)."""
    sampled = [
        (prompt, dataclasses.replace(params, temperature=0.9, top_p=0.9, seed=seed), k)
        for seed, (prompt, params, k) in enumerate(requests())
    ]
    runs = []
    for _ in range(2):
        decoder = make_decoder(max_batch_size=3)
        prompts, params, lengths = zip(*sampled)
        runs.append([h.result().token_ids for h in decoder.submit_batch(prompts, params, lengths)])
    assert runs[0] == runs[1]
    assert len({tuple(tokens) for tokens in runs[0]}) == len(sampled)


def test_a_seeded_request_gives_its_plain_tokens_whatever_it_drafts_and_shares(make_decoder) -> None:
    """A seeded sampled request returns the tokens it returns with no drafts: with fixed draft lengths, auto (on
    the real clock), alone or in a burst of 8 other requests (twice in it), and with prompt lookup's drafts."""
    decoder = make_decoder(max_batch_size=4)
    lookup = SpeculativeDecoder(  # on the same target: each releases its slots before the other runs
        decoder.target, PromptLookupDrafter(), decoder.tokenizer, decoder.eos_token_ids, prefix_cache=False
    )
    accepted = 0
    for seed in range(4):
        params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
        plain = solo(decoder, PROMPTS[seed], params, 0)
        for k in (1, 3, AUTO, 0):
            out = decoder.generate(PROMPTS[seed], params, num_draft_tokens=k)
            assert out.token_ids == plain, (seed, k)
            accepted += out.stats.accepted_tokens
        others = [
            (p, dataclasses.replace(params, seed=None if i % 2 else 100 + i), k)
            for i, (p, _, k) in enumerate(requests())
        ]
        burst = [(PROMPTS[seed], params, AUTO), *others[:4], (PROMPTS[seed], params, 2), *others[4:]]
        handles = decoder.submit_batch(*zip(*burst))
        assert handles[0].result().token_ids == handles[5].result().token_ids == plain, seed
        decoder.reset_prefix_cache()
        assert lookup.generate(PROMPTS[seed], params, num_draft_tokens=AUTO).token_ids == plain, seed
    assert accepted > 20, "drafts were meant to be accepted"


def test_an_error_in_one_requests_text_ends_that_request_alone(make_decoder, monkeypatch) -> None:
    """A fault injected into one request's stop-string check (its tracker raises at its fifth token): that request
    ends with the error, the requests beside it keep their solo tokens, and the scheduler serves on."""
    decoder = make_decoder(max_batch_size=3)
    long = dataclasses.replace(GREEDY, max_new_tokens=40)
    others = [("hello there", 2), ("quiet", AUTO)]
    expected = [solo(decoder, prompt, long, k) for prompt, k in others]
    add = TextTracker.add

    def faulty(tracker: TextTracker, token_id: int) -> bool:
        tracker.calls = getattr(tracker, "calls", 0) + 1
        if "never said" in tracker.stop and tracker.calls == 5:
            raise ValueError("an injected fault")
        return add(tracker, token_id)

    monkeypatch.setattr(TextTracker, "add", faulty)
    doomed = decoder.submit("the cat sat on the mat", dataclasses.replace(long, stop=("never said",)), 2)
    handles = [decoder.submit(prompt, long, k) for prompt, k in others]
    with pytest.raises(GenerationError, match="ValueError: an injected fault"):
        doomed.result()
    assert [h.result().token_ids for h in handles] == expected
    assert decoder.scheduler.error is None
    assert solo(decoder, "hello there", long, 2) == expected[0]


def test_cancelling_frees_the_slot_and_leaves_the_others_alone(make_decoder) -> None:
    decoder = make_decoder(max_batch_size=2)
    long = dataclasses.replace(GREEDY, max_new_tokens=60)
    expected = [solo(decoder, "hello there", GREEDY, 2), solo(decoder, "quiet", GREEDY, AUTO)]
    doomed = decoder.stream("the cat sat on the mat", long, 3)
    other = decoder.submit("hello there", GREEDY, 2)
    waiting = decoder.submit("quiet", GREEDY, AUTO)  # no slot until one is freed
    pieces = iter(doomed)
    first = next(pieces)
    doomed.cancel()
    rest = list(pieces)
    assert doomed.output.finish_reason == "cancelled" and len(doomed.output.token_ids) < 60
    assert first + "".join(rest) == doomed.output.text
    assert [other.result().token_ids, waiting.result().token_ids] == expected


def test_a_bad_request_is_refused_at_submit_and_the_rest_go_on(make_decoder) -> None:
    decoder = make_decoder()
    running = decoder.submit("hello there", GREEDY, 2)
    with pytest.raises(ContextOverflowError, match="max context"):
        decoder.submit("x" * 200, GREEDY, 2)
    with pytest.raises(ValueError, match="invalid sampling parameters"):
        decoder.submit("hello", SamplingParams(max_new_tokens=0))
    assert running.result().token_ids == solo(decoder, "hello there", GREEDY, 2)


def test_a_full_queue_is_a_clear_error(make_decoder) -> None:
    decoder = make_decoder(max_batch_size=1, max_queue=1)
    running = decoder.submit("the cat sat on the mat", dataclasses.replace(GREEDY, max_new_tokens=60), 2)
    next(iter(running))  # it holds the only slot
    waiting = decoder.submit("hello there", GREEDY, 2)
    with pytest.raises(QueueFullError, match="the most this server queues is 1"):
        decoder.submit("quiet", GREEDY, 2)
    running.cancel()
    assert waiting.result().token_ids == solo(decoder, "hello there", GREEDY, 2)


def test_a_request_cancelled_while_waiting_leaves_the_queue_at_once(make_decoder) -> None:
    """A waiting request that is cancelled ends, and frees its place in the queue, while the slots are still
    busy: the queue takes another request at once."""
    decoder = make_decoder(max_batch_size=1, max_queue=1)
    running = decoder.submit("the cat sat on the mat", dataclasses.replace(GREEDY, max_new_tokens=100), 0)
    next(iter(running))  # it holds the only slot, for a hundred plain rounds
    leaving = decoder.submit("hello there", GREEDY, 2)
    assert decoder.scheduler.num_waiting == 1
    leaving.cancel()
    assert leaving.result(timeout=60).finish_reason == "cancelled" and leaving.output.token_ids == []
    assert not running.done and decoder.scheduler.num_waiting == 0
    after = decoder.submit("quiet", GREEDY, 2)  # the queue of one has room again
    running.cancel()
    assert after.result().token_ids == solo(decoder, "quiet", GREEDY, 2)


def test_a_long_prompt_is_prefilled_between_the_running_requests_rounds(make_decoder) -> None:
    """With a prefill chunk of 8 tokens, a 102-token prompt takes 13 chunks; the two requests already decoding
    get a round after every one of them (the order of events, not their timing)."""
    decoder = make_decoder(prefill_chunk=8)
    decoder.scheduler.events = events = []
    runners = decoder.submit_batch(["hello there", "quiet"], dataclasses.replace(GREEDY, max_new_tokens=60), 2)
    for handle in runners:
        next(iter(handle))
    prompt = "the cat sat on the mat, " * 4 + "and on"
    assert len(decoder.tokenize(prompt)) == 102
    arriving = decoder.submit(prompt, GREEDY, 2)
    arriving.result()
    prefills = [i for i, (kind, r, _) in enumerate(events) if kind == "prefill" and r == arriving.request_id]
    assert len(prefills) == 13
    assert [events[i].tokens for i in prefills] == [8] * 12 + [6]
    for before, after in zip(prefills, prefills[1:]):
        between = {r for kind, r, _ in events[before:after] if kind == "round"}
        assert {h.request_id for h in runners} <= between, f"no round between chunks at events {before}-{after}"
    for handle in runners:
        handle.cancel()


FIXED, PER_ROW, PER_WIDE_ROW, PER_TOKEN = 0.013, 0.002, 0.001, 0.0014
ROUND_S = 0.0425


def timed_passes(packed: bool) -> PassCost:
    """Passes of 1 and 2 rows of several widths, timed as FIXED + PER_ROW * rows + PER_TOKEN * tokens, and
    PER_WIDE_ROW * rows more where the rows take several tokens."""
    passes = PassCost(decay=0.95, packed=packed)
    for rows in (1, 2):
        for tokens in (1, 10, 50, 100):
            per_row = PER_ROW + PER_WIDE_ROW * (tokens > 1)
            passes.add([0] * rows, [tokens] * rows, FIXED + per_row * rows + PER_TOKEN * rows * tokens)
    return passes


def chunk_fitting(seconds: float, packed: bool) -> float:
    """Tokens of a chunk taking ``seconds``: beside one decoding row in its pass (which it makes wide) where the
    target packs rows, in a pass of its own where it pads them."""
    if packed:
        return (seconds - PER_ROW - 2 * PER_WIDE_ROW) / PER_TOKEN
    return (seconds - FIXED - PER_ROW - PER_WIDE_ROW) / PER_TOKEN


@pytest.mark.parametrize("packed", [True, False])
def test_a_prefill_chunk_takes_about_a_round(packed: bool) -> None:
    """Beside decoding requests a chunk holds as many prompt tokens as take a round's time (by default), from
    the passes timed so far: what it adds to the round's pass where the target packs rows (ONNX Runtime), a
    pass of its own, fixed cost included, where it pads them; never more than the policy's chunk, never fewer
    than MIN_PREFILL_CHUNK; with nothing decoding, no limit."""
    policy, beside_one = PrefillPolicy(chunk=256), PrefillQueue(decoding=1, prompts=1, cached=0)
    assert policy.chunk_rounds == DEFAULT_PREFILL_CHUNK_ROUNDS == 1.0
    assert policy.budget(PassCost(0.95, packed), None, beside_one) == 256  # nothing timed yet
    passes = timed_passes(packed)
    fitting = chunk_fitting(ROUND_S, packed)  # 27 or 18 tokens (the fit may round one below)
    assert int(fitting) - 1 <= policy.budget(passes, ROUND_S, beside_one) <= int(fitting)
    assert policy.budget(passes, 0.5, beside_one) == 256
    assert policy.budget(passes, 0.004, beside_one) == MIN_PREFILL_CHUNK
    assert policy.budget(passes, ROUND_S, PrefillQueue(decoding=0, prompts=1, cached=0)) is None


@pytest.mark.parametrize("packed", [True, False])
def test_a_burst_of_prompts_beside_one_stream_gets_longer_chunks(packed: bool) -> None:
    """Three prompts waiting beside one decoding stream are prefilled in chunks of three rounds' time (each
    chunk holds up one stream, each round three prompts); beside three streams, in chunks of one round."""
    policy, passes = PrefillPolicy(chunk=256), timed_passes(packed)
    burst = policy.budget(passes, ROUND_S, PrefillQueue(decoding=1, prompts=3, cached=0))
    fitting = chunk_fitting(3 * ROUND_S, packed)
    assert int(fitting) - 1 <= burst <= int(fitting)
    one = policy.budget(passes, ROUND_S, PrefillQueue(decoding=1, prompts=1, cached=0))
    assert burst > 2 * one
    beside_three = policy.budget(passes, ROUND_S, PrefillQueue(decoding=3, prompts=3, cached=0))
    assert beside_three < burst


def prefill_steps(events: list) -> list[int]:
    """The prompt tokens each step prefilled: a step's chunks are recorded one event a row, together."""
    steps: list[int] = []
    for previous, event in zip([None, *events], events):
        if event.kind == "prefill":
            if previous is None or previous.kind != "prefill":
                steps.append(0)
            steps[-1] += event.tokens
    return steps


def test_the_scheduler_sizes_a_bursts_chunks_by_the_prompts_waiting(make_decoder) -> None:
    """Through the scheduler, passes priced at 0.1 ms a computed token and rounds at 4 ms each (so chunk
    lengths follow from these times, not from the machine's): a prompt arriving beside one stream is
    prefilled in chunks of about one round's time, three prompts arriving together in chunks about three
    times as long. (No prefix cache: the prompts repeat, and each would find the last one cached.)"""
    decoder = make_decoder(prefill_chunk=256, prefix_cache=False)
    costs = decoder.scheduler.costs
    add_pass, add_round = costs.passes.add, costs.add_round
    costs.passes.add = lambda cached, widths, seconds: add_pass(
        cached, widths, 1e-4 * float(pass_features(cached, widths, costs.packed)[3])
    )
    costs.add_round = lambda seconds: add_round(0.004)
    prompt = "the cat sat on the mat, " * 3 + "and on the mat"  # 86 tokens
    first_steps = []
    for prompts in ([prompt], [prompt] * 3):
        decoder.scheduler.events = events = []
        stream = decoder.submit("hello there", dataclasses.replace(GREEDY, max_new_tokens=100), 2)
        next(iter(stream))
        for handle in decoder.submit_batch(prompts, GREEDY, 2):
            handle.result()
        stream.cancel()
        first_steps.append(prefill_steps(events)[1])  # the step after the stream's own prompt
    one, burst = first_steps
    assert MIN_PREFILL_CHUNK <= one < 86 and burst > 2 * one, first_steps


def test_prefill_chunk_rounds_trades_the_streams_pauses_for_fewer_longer_chunks(make_decoder) -> None:
    """Twice the rounds' time, chunks take twice the time; no bound: chunks of prefill_chunk tokens, and the
    long prompt of the interleaving test is prefilled in as few passes as that allows."""
    beside_one = PrefillQueue(decoding=1, prompts=1, cached=0)
    budget = PrefillPolicy(chunk=256, chunk_rounds=2.0).budget(timed_passes(True), ROUND_S, beside_one)
    fitting = chunk_fitting(2 * ROUND_S, True)  # 57 tokens (the fit may round one below)
    assert int(fitting) - 1 <= budget <= int(fitting)
    assert PrefillPolicy(chunk=40, chunk_rounds=None).budget(timed_passes(True), ROUND_S, beside_one) == 40
    decoder = make_decoder(prefill_chunk=40, prefill_chunk_rounds=None)
    decoder.scheduler.events = events = []
    runners = decoder.submit_batch(["hello there", "quiet"], dataclasses.replace(GREEDY, max_new_tokens=60), 2)
    for handle in runners:
        next(iter(handle))
    arriving = decoder.submit("the cat sat on the mat, " * 4 + "and on", GREEDY, 2)  # 102 tokens
    arriving.result()
    chunks = [tokens for kind, r, tokens in events if kind == "prefill" and r == arriving.request_id]
    assert chunks == [40, 40, 22]
    for handle in runners:
        handle.cancel()
    with pytest.raises(ValueError, match="prefill_chunk_rounds must be > 0 or None"):
        make_decoder(prefill_chunk_rounds=0)


@pytest.mark.parametrize("rounds", [DEFAULT_PREFILL_CHUNK_ROUNDS, None])
def test_rounds_beside_a_prompt_being_chunked_count_the_chunks_fixed_cost(make_decoder, rounds) -> None:
    """What auto weighs a round's drafts against beyond its passes: where chunks run in passes of their own
    (the PyTorch engine), while a prompt is prefilled in chunks beside the round, the fixed cost of the chunk's
    pass each round brings (more tokens per round, fewer chunks), and nothing once no prompt is waiting; with
    chunks not bounded by rounds, their number does not depend on the rounds. Where chunks ride in the
    round's own pass (ONNX Runtime), they bring no pass of their own, and nothing."""
    decoder = make_decoder(prefill_chunk=16, prefill_chunk_rounds=rounds)
    scheduler = decoder.scheduler
    scheduler.events = events = []
    long_prompt = "the cat sat on the mat, " * 4 + "and on"  # 102 tokens
    arriving: list = []
    seen = []
    plan = scheduler.planner.plan

    def spy(rows, chunk=False, chunk_follows=False):
        prefilled = sum(e.tokens for e in events if e.kind == "prefill" and arriving and e.request_id == arriving[0])
        seen.append((chunk_follows, 0 < prefilled < 102))  # between its first chunk and its last
        return plan(rows, chunk, chunk_follows)

    scheduler.planner.plan = spy
    runners = decoder.submit_batch(["hello there", "quiet"], dataclasses.replace(GREEDY, max_new_tokens=60), AUTO)
    for handle in runners:
        next(iter(handle))
    handle = decoder.submit(long_prompt, dataclasses.replace(GREEDY, max_new_tokens=16), AUTO)
    arriving.append(handle.request_id)
    handle.result()
    for handle in runners:
        handle.cancel()
    beside = [follows for follows, prefilling in seen if prefilling]
    alone = [follows for follows, prefilling in seen[-3:] if not prefilling]
    assert len(beside) >= 3 and alone
    assert not any(alone)
    chunk_counts = not (rounds is None or scheduler.target.packs_rows)
    assert all(follows == chunk_counts for follows in beside)


def test_a_round_that_a_chunk_pass_follows_is_planned_with_that_pass_fixed_cost() -> None:
    """The planner prices the pass of a prefill chunk that follows the round as a fixed cost of the round:
    the fixed cost of a pass, as the timings fit it; nothing where no such pass follows."""
    costs = Costs(packed=False)
    costs.passes = timed_passes(packed=False)
    planner, contexts = DraftPlanner(PromptLookupDrafter(), 8, 128, costs), []
    lookup = planner.controllers[LOOKUP]
    plan = lookup.plan
    lookup.plan = lambda rows, remaining, context=None, tokens=None: (
        contexts.append(context) or plan(rows, remaining, context, tokens)
    )
    row = Request.create(0, [5, 6, 5, 6, 5], GREEDY, AUTO, 0.0, None, frozenset(), lambda request_id: None)
    row.slot = 0
    for follows in (True, False):
        planner.plan([row], chunk_follows=follows)
    assert [context.fixed_s for context in contexts] == [pytest.approx(FIXED), 0.0]


def test_chunks_ride_in_the_rounds_pass_where_the_target_packs_rows(make_decoder) -> None:
    """ONNX Runtime packs a pass's tokens: a chunk beside decoding requests goes into their round's verify pass
    (one pass a step), and the outputs are the solo ones. The PyTorch engine pads: a chunk there is a pass
    of its own, which would otherwise pad every verify row to the chunk's width. (No prefix cache: the long
    prompt runs alone first, for its expected output.)"""
    decoder = make_decoder(prefill_chunk=16, prefix_cache=False)
    target = decoder.scheduler.target
    passes = []
    step = target.step

    def spy(slots, ids, num_new=None, logits_from=None):
        passes.append(list(num_new) if num_new is not None else [ids.shape[1]] * len(slots))
        return step(slots, ids, num_new, logits_from)

    expected = solo(decoder, "hello there", dataclasses.replace(GREEDY, max_new_tokens=30), 2)
    prompt = "the cat sat on the mat, " * 4 + "and on"  # 102 tokens
    expected_long = solo(decoder, prompt, GREEDY, 2)
    target.step = spy
    runner = decoder.submit("hello there", dataclasses.replace(GREEDY, max_new_tokens=30), 2)
    pieces = iter(runner)
    next(pieces)
    passes.clear()
    arriving = decoder.submit(prompt, GREEDY, 2)
    assert arriving.result().token_ids == expected_long
    chunked = [p for p in passes if max(p) > 3]  # a verify row takes at most 3 tokens (k=2)
    assert len(chunked) >= 102 // 16
    shared = [p for p in chunked if len(p) == 2]
    if target.packs_rows:
        assert shared and len(shared) >= len(chunked) - 1, passes  # all but maybe one after the runner ended
    else:
        assert not shared, passes
    assert runner.result().token_ids == expected


def test_auto_plans_the_verify_pass_as_the_target_computes_it(make_decoder, request) -> None:
    """ONNX Runtime packs a pass's tokens, so rows drafting 4, 0 and 2 make it compute 2 drafts per row; the
    PyTorch engine pads every row to the widest, 4. Rounds are recorded at that width too."""
    decoder = make_decoder()
    packed = "onnxruntime" in request.node.callspec.id
    assert decoder.scheduler.target.packs_rows is packed
    context = PassContext.of([4, 0, 2], decoder.scheduler.target.packs_rows, tokens=1.0)
    assert (context.rows, context.drafts, context.width, context.packed) == (3, 6, 4, packed)
    assert float(context.drafts_per_row(0, 0)) == (2.0 if packed else 4.0)
    assert context.drafts_per_row(1, np.array([0, 8])).tolist() == ([2.0, 14 / 3] if packed else [4, 8])


def test_a_paused_stream_is_not_disturbed_by_another_call(make_decoder) -> None:
    decoder = make_decoder()
    expected = decoder.generate("the cat sat on the mat", GREEDY, 3).text
    other_expected = solo(decoder, "hello there", GREEDY, AUTO)
    stream = iter(decoder.stream("the cat sat on the mat", GREEDY, 3))
    first = next(stream)
    assert solo(decoder, "hello there", GREEDY, AUTO) == other_expected
    assert first + "".join(stream) == expected


def test_threads_share_one_decoder(make_decoder) -> None:
    decoder = make_decoder(max_batch_size=3)
    alone = [solo(decoder, prompt, params, k) for prompt, params, k in requests()]
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda r: solo(decoder, *r), requests()))
    assert outputs == alone


def test_async_iteration(make_decoder) -> None:
    decoder = make_decoder()

    async def collect() -> str:
        return "".join([piece async for piece in decoder.submit("hello there", GREEDY, 2)])

    assert asyncio.run(collect()) == decoder.generate("hello there", GREEDY, 2).text


def test_an_engine_error_ends_every_request_and_says_so(make_decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    decoder = make_decoder()
    decoder.generate("hi", GREEDY, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell off the bus")

    monkeypatch.setattr(decoder.target, "step", broken)
    handles = decoder.submit_batch(["hello", "there"], GREEDY, 2)
    for handle in handles:
        with pytest.raises(GenerationError, match="fell off the bus"):
            handle.result(timeout=60)
        assert handle.output.finish_reason == "error"
    with pytest.raises(SchedulerClosedError, match="restart it"):
        decoder.submit("hello", GREEDY)


def test_the_draft_catches_up_after_rounds_it_did_not_draft(checkpoints) -> None:
    """A model draft that sat out rounds (plain steps, or rounds drafted by prompt lookup) is fed what it
    missed when it next drafts: its proposals are those of a draft that saw every token."""
    loaded, _, drafter = load_engines(*checkpoints, max_context=128)
    fresh = ModelDrafter(load_engines(*checkpoints, max_context=128)[2].engine)
    sampler = BatchSampler([GREEDY])
    prompt, later = [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]
    for model, seen in ((drafter, prompt), (fresh, prompt + later)):
        model.reserve(1)
        model.admit(0)
        model.prefill([0], [seen[:-1]])
    drafter.propose([0], [prompt], [3], sampler)  # one round, then seven tokens committed without it
    caught_up = drafter.propose([0], [prompt + later], [4], sampler)
    assert caught_up.token_ids.tolist() == fresh.propose([0], [prompt + later], [4], sampler).token_ids.tolist()


# --- the exact distribution, with requests joining and leaving -------------------------------------------

RUNS = 12_000


@pytest.fixture(scope="module")
def lossless_models(make_checkpoint) -> tuple[tuple[Path, Path], torch.nn.Module]:
    target = make_checkpoint(with_tokenizer=False, vocab_size=VOCAB, seed=11, logit_scale=1.5)
    draft = make_checkpoint(with_tokenizer=False, vocab_size=VOCAB, seed=12, logit_scale=1.5)
    return (target, draft), AutoModelForCausalLM.from_pretrained(target).eval()


def shared_batch_counts(decoder: SpeculativeDecoder, params: SamplingParams, seeded: bool = False) -> np.ndarray:
    """Counts of the first DEPTH tokens of RUNS measured requests (``seeded``: with seeds 0, 1, ..) that flow
    through 96 slots with other requests (other prompts, lengths and draft lengths) joining and leaving around
    them."""
    noise_rng = np.random.default_rng(0)
    torch.manual_seed(0)
    measured, handles = [], []
    for start in range(0, RUNS, 500):
        seeds = range(start, start + 500) if seeded else [None] * 500
        batch = [dataclasses.replace(params, seed=s, max_new_tokens=DEPTH, ignore_eos=True) for s in seeds]
        measured += decoder.submit_batch([PROMPT] * len(batch), batch, num_draft_tokens=3)
        for k in (0, 1, 5):
            lengths = noise_rng.integers(1, 9, size=20)
            noise = [dataclasses.replace(params, seed=None, max_new_tokens=int(n), ignore_eos=True) for n in lengths]
            prompts = [noise_rng.integers(0, VOCAB, size=int(noise_rng.integers(2, 7))).tolist() for _ in noise]
            handles += decoder.submit_batch(prompts, noise, num_draft_tokens=k)
    outputs = [h.result() for h in measured]
    for handle in handles:
        handle.result()
    codes = [int(np.ravel_multi_index(out.token_ids[:DEPTH], (VOCAB,) * DEPTH)) for out in outputs]
    return np.bincount(codes, minlength=VOCAB**DEPTH)


@pytest.mark.slow
def test_sampled_output_keeps_the_exact_distribution_in_a_changing_batch(lossless_models, monkeypatch) -> None:
    """The chi-square test of the core (DESIGN.md) on requests that share the batch with others that join
    and leave; the same run with the residual distribution broken is rejected."""
    (target, draft), reference = lossless_models
    decoder = SpeculativeDecoder.from_pretrained(target, draft, max_context=24, max_batch_size=96)
    params = WARPINGS["combined"]
    probs = exact_joint(reference, params)
    assert chi_square_p(shared_batch_counts(decoder, params), probs) > PASS_P
    monkeypatch.setattr(specdec_trt.rejection, "recovery_distribution", no_residual)
    assert chi_square_p(shared_batch_counts(decoder, params), probs) < REJECT_P


@pytest.mark.slow
def test_seeded_output_keeps_the_exact_distribution_in_a_changing_batch(lossless_models, request) -> None:
    """The same for seeded requests (coupled verification); the negative control keys the noise without the
    positions."""
    (target, draft), reference = lossless_models
    params = WARPINGS["combined"]
    probs = exact_joint(reference, params)
    decoder = SpeculativeDecoder.from_pretrained(target, draft, max_context=24, max_batch_size=96)
    assert chi_square_p(shared_batch_counts(decoder, params, seeded=True), probs) > PASS_P
    request.getfixturevalue("noise_keyed_without_positions")
    decoder = SpeculativeDecoder.from_pretrained(target, draft, max_context=24, max_batch_size=96)
    assert chi_square_p(shared_batch_counts(decoder, params, seeded=True), probs) < REJECT_P


def test_many_concurrent_streams_through_few_slots(make_decoder) -> None:
    """Sixteen streaming callers on four slots, from sixteen threads: each gets its solo text."""
    decoder = make_decoder(max_batch_size=4)
    prompts = [f"{word} {word}" for word in "abcdefghijklmnop"]
    alone = [decoder.generate(p, GREEDY, k).text for p, k in zip(prompts, [2, AUTO, 0, 4] * 4)]
    barrier = threading.Barrier(16)

    def stream(args) -> str:
        barrier.wait()
        return "".join(decoder.stream(*args))

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(stream, [(p, GREEDY, k) for p, k in zip(prompts, [2, AUTO, 0, 4] * 4)]))
    assert texts == alone


@pytest.mark.parametrize("backend", ["pytorch", "onnxruntime"])
def test_decoders_sharing_a_target_each_get_slots_in_their_own_drafter(checkpoints, engine_dir, backend) -> None:
    """specdec-bench's runners share one target among decoders: a plain decoder grows the target's slots alone,
    and a decoder with a model draft, admitted after it, grows its draft's slots to match."""
    if backend == "pytorch":
        loaded, _, _ = load_engines(*checkpoints, max_context=128)
    else:
        loaded = open_engine_directory(engine_dir, [DraftSpec.parse("engine")])
    plain = SpeculativeDecoder(loaded.target, None, loaded.tokenizer, loaded.eos_token_ids, prefix_cache=False)
    drafting = SpeculativeDecoder(
        loaded.target, loaded.only_drafter(), loaded.tokenizer, loaded.eos_token_ids, prefix_cache=False
    )
    expected = plain.generate("the cat", GREEDY).token_ids
    assert drafting.generate("the cat", GREEDY, 2).token_ids == expected
