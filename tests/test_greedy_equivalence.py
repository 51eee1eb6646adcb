"""Trap 1 (KV bookkeeping) and trap 3 (EOS / stop strings inside an accepted block): greedy speculative
output equals target-only greedy output on the same engine, token for token, for every draft length,
and with the draft length chosen per round ("auto"), plain rounds included."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import FAMILIES

import specdec_trt.planner
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.build_engines.checkpoint import load_checkpoint
from specdec_trt.decoder import AUTO
from specdec_trt.draft_length import DraftLengthController
from specdec_trt.drafting import LookupFirstDrafter, ModelDrafter, StopRule, confidence_below
from specdec_trt.runtime.torch_engine import TorchEngine

PROMPTS = ["hello world", "the quick brown fox", "a", "speculative decoding is fun. speculative"]
MAX_DRAFT = 8
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
DRAFTS = {
    "agrees_often": 0.05,  # relative weight noise on a copy of the target
    "agrees_rarely": None,  # an independently initialised model
    "ngram": "ngram",
    "lookup_first": "ngram+",  # prompt lookup, and the agrees_often model where lookup finds nothing
}


def _draft_path(make_checkpoint, family: str, kind: str):
    target_kwargs = {"family": family}
    if kind == "agrees_often":
        return make_checkpoint(draft_of=(target_kwargs, DRAFTS[kind]), seed=100)
    if kind == "agrees_rarely":
        return make_checkpoint(family=family, seed=7)
    if kind == "lookup_first":
        return "ngram+" + str(_draft_path(make_checkpoint, family, "agrees_often"))
    return "ngram"


def assert_greedy_lossless(
    decoder: SpeculativeDecoder, kind: str, prompts: list[str], params: SamplingParams, max_draft: int
) -> int:
    """Speculative greedy output equals target-only greedy output on the same engine for every gamma from
    1 to ``max_draft``, batched and alone; checks the draft's acceptance for its ``kind``. Returns the
    number of drafted tokens."""
    baseline = decoder.generate_batch(prompts, params, num_draft_tokens=0)
    assert all(o.stats.drafted_tokens == 0 and len(o.token_ids) == params.max_new_tokens for o in baseline)
    acceptance, drafted = [], 0
    for gamma in range(1, max_draft + 1):
        batched = decoder.generate_batch(prompts, params, num_draft_tokens=gamma)
        drafted += sum(o.stats.drafted_tokens for o in batched)
        for prompt, out, base in zip(prompts, batched, baseline):
            assert out.token_ids == base.token_ids, f"gamma={gamma} prompt={prompt!r} (batched)"
            assert out.text == base.text
        single = decoder.generate(prompts[3], params, num_draft_tokens=gamma)
        assert single.token_ids == baseline[3].token_ids, f"gamma={gamma} (alone)"
        acceptance.append(sum(o.stats.acceptance_rate for o in batched) / len(batched))
    if kind == "agrees_often":
        assert acceptance[0] > 0.6, acceptance
    if kind == "agrees_rarely":
        assert acceptance[0] < 0.3, acceptance
    return drafted


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", DRAFTS)
def test_speculative_greedy_equals_target_only(family: str, kind: str, make_checkpoint) -> None:
    target = make_checkpoint(family=family)
    decoder = SpeculativeDecoder.from_pretrained(target, _draft_path(make_checkpoint, family, kind), max_context=96)
    assert assert_greedy_lossless(decoder, kind, PROMPTS, GREEDY, MAX_DRAFT) > 0


def assert_auto_greedy_lossless(decoder: SpeculativeDecoder, prompts: list[str], params: SamplingParams) -> int:
    """With num_draft_tokens="auto", with its cost-aware stop and with a fixed cut-off at confidence 0.9 (which
    cuts most rounds short), batched and alone, the output is the target-only greedy output. Returns the
    drafted tokens."""
    baseline = decoder.generate_batch(prompts, params, num_draft_tokens=0)
    drafted = 0
    try:
        for threshold in (None, 0.9):
            decoder.draft_confidence_threshold = threshold
            batched = decoder.generate_batch(prompts, params, num_draft_tokens=AUTO)
            assert [o.token_ids for o in batched] == [o.token_ids for o in baseline], f"threshold {threshold}"
            assert [o.text for o in batched] == [o.text for o in baseline]
            single = decoder.generate(prompts[-1], params, num_draft_tokens=AUTO)
            assert single.token_ids == baseline[-1].token_ids, f"threshold {threshold} (alone)"
            drafted += sum(o.stats.drafted_tokens for o in batched)
    finally:
        decoder.draft_confidence_threshold = None
    return drafted


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", DRAFTS)
def test_auto_greedy_equals_target_only(family: str, kind: str, make_checkpoint) -> None:
    target = make_checkpoint(family=family)
    decoder = SpeculativeDecoder.from_pretrained(target, _draft_path(make_checkpoint, family, kind), max_context=96)
    assert assert_auto_greedy_lossless(decoder, PROMPTS, GREEDY) > 0


def test_lookup_first_alternates_lookup_and_model_rounds(make_checkpoint) -> None:
    """Both parts draft in one generation, and the model's cache follows the tokens committed in the lookup
    rounds it skipped (the output is the target-only output, and the model is fed several tokens at once)."""
    target = make_checkpoint(family="llama")
    decoder = SpeculativeDecoder.from_pretrained(target, _draft_path(make_checkpoint, "llama", "lookup_first"))
    drafter = decoder.drafter
    assert isinstance(drafter, LookupFirstDrafter)
    calls = {"lookup": 0, "model": 0}
    lookup_draft = drafter.lookup.draft_from
    drafter.lookup.draft_from = lambda *a: (calls.__setitem__("lookup", calls["lookup"] + 1), lookup_draft(*a))[1]
    widths = spy_on_draft_steps(drafter.model, drafter.engine)
    model_propose = drafter.model.propose
    drafter.model.propose = lambda *a: (calls.__setitem__("model", calls["model"] + 1), model_propose(*a))[1]
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    prompt = PROMPTS[3]
    assert (
        decoder.generate(prompt, params, num_draft_tokens=4).token_ids
        == decoder.generate(prompt, params, num_draft_tokens=0).token_ids
    )
    assert calls["lookup"] > 0 and calls["model"] > 0, calls
    assert max(widths) > 2, widths  # a catch-up over the tokens of skipped lookup rounds, in one step


def spy_on_draft_steps(drafter, engine) -> list[int]:
    """From now on, the most new tokens any row gets in each step ``engine`` runs while ``drafter`` drafts
    (its catch-up, then one token a step; its prefill is not drafting)."""
    widths: list[int] = []
    drafting: list[bool] = []
    step, propose = engine.step, drafter.propose

    def spy_step(slots, ids, num_new=None, logits_from=None):
        if drafting:
            widths.append(ids.shape[1] if num_new is None else max(num_new))
        return step(slots, ids, num_new, logits_from)

    def spy_propose(*args):
        drafting.append(True)
        try:
            return propose(*args)
        finally:
            drafting.pop()

    engine.step, drafter.propose = spy_step, spy_propose
    return widths


SCRIPT = (3, 0, 0, 0, 2, 0, 5, 1, 0, 0, 4, 8, 0, 0, 0, 1)  # runs of plain rounds the draft never sees


class ScriptedSchedule(DraftLengthController):
    """Stands in for the "auto" controller: a fixed cycle of draft lengths with runs of plain rounds, so
    the draft's catch-up on rounds it did not run is exercised deterministically."""

    def __init__(self, max_draft: int, costs=None) -> None:
        super().__init__(max_draft, costs)
        self.round = 0

    def plan(self, rows, remaining: int, context=None, tokens=None) -> list[int]:
        self.round += 1
        return [min(SCRIPT[(self.round - 1) % len(SCRIPT)], self.max_draft, remaining)] * len(rows)

    def observe(self, *args, **kwargs) -> None:
        pass

    def stop_rule(self, slots, rows, context=None, exempt=(), rate=None) -> StopRule:
        return confidence_below(0.3, exempt)  # cuts rounds after tokens the draft is unconfident about


@pytest.fixture
def scripted_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(specdec_trt.planner, "DraftLengthController", ScriptedSchedule)


def assert_scripted_greedy_lossless(decoder: SpeculativeDecoder, prompts: list[str], params: SamplingParams) -> None:
    """Under the scripted schedule: the target-only greedy output, batched, alone, and in a batch whose first
    row stops after its first token and leaves; the others' draft caches catch up, each row with its own
    number of tokens, after the script's runs of plain rounds. (Without the store of earlier requests' text:
    the runs repeat the prompts, and their earlier outputs would draft every row in place of the model.)"""
    if isinstance(decoder.drafter, LookupFirstDrafter):
        decoder.drafter.lookup.store = None
    baseline = decoder.generate_batch(prompts, params, num_draft_tokens=0)
    batched = decoder.generate_batch(prompts, params, num_draft_tokens=AUTO)
    assert [o.token_ids for o in batched] == [o.token_ids for o in baseline]
    assert all(o.stats.rounds > 4 for o in batched), "the script's first plain rounds should be followed by drafts"
    single = decoder.generate(prompts[0], params, num_draft_tokens=AUTO)
    assert single.token_ids == baseline[0].token_ids
    short = [dataclasses.replace(params, max_new_tokens=1)] + [params] * len(prompts)
    engine = getattr(decoder.drafter, "engine", None)
    widths = [] if engine is None else spy_on_draft_steps(decoder.drafter, engine)
    try:
        mixed = decoder.generate_batch(["a"] + prompts, short, num_draft_tokens=AUTO)
    finally:
        if engine is not None:
            del engine.step, decoder.drafter.propose
    assert len(mixed[0].token_ids) == 1
    assert [o.token_ids for o in mixed[1:]] == [o.token_ids for o in baseline]
    if getattr(decoder.drafter, "cache_from", None) is not None:
        assert set(widths) == {1}, widths  # a self-draft copies the target's cache and feeds the newest token
    elif engine is not None:
        assert max(widths) > 2, widths  # a row caught up with several tokens committed in plain rounds


@pytest.mark.parametrize("kind", DRAFTS)
def test_plain_rounds_keep_the_draft_cache_right(kind: str, make_checkpoint, scripted_schedule) -> None:
    target = make_checkpoint(family="qwen3")
    decoder = SpeculativeDecoder.from_pretrained(target, _draft_path(make_checkpoint, "qwen3", kind), max_context=96)
    assert_scripted_greedy_lossless(decoder, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def self_drafted(make_checkpoint) -> SpeculativeDecoder:
    """The target drafting for itself: every draft is accepted, so every round is a full block and any
    EOS or stop string falls inside an accepted block."""
    target = load_checkpoint(make_checkpoint(family="llama"))
    draft = TorchEngine.from_checkpoint(target, max_context=96)
    return SpeculativeDecoder(
        TorchEngine.from_checkpoint(target, max_context=96), ModelDrafter(draft), target.tokenizer
    )


@pytest.mark.parametrize("gamma", range(1, MAX_DRAFT + 1))
def test_eos_inside_an_accepted_block(gamma: int, self_drafted: SpeculativeDecoder) -> None:
    base = self_drafted.generate(PROMPTS[1], GREEDY, num_draft_tokens=0)
    # Pick as EOS a token first generated mid-way, not at a block boundary for this gamma.
    position = next(i for i in range(5, 40) if base.token_ids[i] not in base.token_ids[:i] and i % (gamma + 1))
    eos = base.token_ids[position]
    # No tokenizer: the chosen token is the only EOS (the tokenizer's own would stop earlier).
    decoder = SpeculativeDecoder(self_drafted.target, self_drafted.drafter, eos_token_ids=[eos])
    prompt = self_drafted.tokenize(PROMPTS[1])
    plain = decoder.generate(prompt, SamplingParams(max_new_tokens=40), num_draft_tokens=0)
    spec = decoder.generate(prompt, SamplingParams(max_new_tokens=40), num_draft_tokens=gamma)
    assert spec.token_ids == plain.token_ids == base.token_ids[: position + 1]
    assert spec.finish_reason == plain.finish_reason == "stop"
    assert spec.stats.acceptance_rate == 1.0, "the self-draft must accept everything, or EOS was not inside a block"


@pytest.mark.parametrize("gamma", range(1, MAX_DRAFT + 1))
def test_stop_string_inside_an_accepted_block(gamma: int, self_drafted: SpeculativeDecoder) -> None:
    base = self_drafted.generate(PROMPTS[0], GREEDY, num_draft_tokens=0)
    stop = base.text[12:14]
    cut = base.text.index(stop)
    params = SamplingParams(max_new_tokens=40, stop=[stop], ignore_eos=True)
    plain = self_drafted.generate(PROMPTS[0], params, num_draft_tokens=0)
    spec = self_drafted.generate(PROMPTS[0], params, num_draft_tokens=gamma)
    assert spec.text == plain.text == base.text[:cut]
    assert spec.token_ids == plain.token_ids == base.token_ids[: len(plain.token_ids)]
    assert spec.finish_reason == "stop"
    streamed = self_drafted.stream(PROMPTS[0], params, num_draft_tokens=gamma)
    pieces = list(streamed)
    assert "".join(pieces) == base.text[:cut]
    assert streamed.output.token_ids == spec.token_ids


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_max_new_tokens_inside_an_accepted_block(gamma: int, self_drafted: SpeculativeDecoder) -> None:
    base = self_drafted.generate(PROMPTS[2], GREEDY, num_draft_tokens=0)
    for limit in (1, 2, 7, 11):
        params = SamplingParams(max_new_tokens=limit, ignore_eos=True)
        out = self_drafted.generate(PROMPTS[2], params, num_draft_tokens=gamma)
        assert out.token_ids == base.token_ids[:limit]
        assert out.finish_reason == "length"
