"""The ONNX Runtime engine against the PyTorch engine, and the decoder's guarantees on ONNX engines.

Engine directories are built once for the module by ``specdec_trt.build.build`` (in fresh processes, see
test_build.py): one per family (a tiny target with a draft that agrees often), an int4 self-draft, and a
V=8 target/draft pair for the losslessness tests. ``OrtEngine`` must give the torch engine's logits to
1e-4 through prefill, verify-shaped forwards on both of its internal paths, and per-row truncation; a slot
extended with another engine's keys and values (``copy_from``) must compute what that engine computes;
speculative greedy output must equal target-only greedy output token for token; sampled output must
follow the target's exact distribution.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import FAMILIES
from onnx import numpy_helper
from scipy import stats
from test_build import SIZE, build_all
from test_greedy_equivalence import (
    assert_auto_greedy_lossless,
    assert_greedy_lossless,
    assert_scripted_greedy_lossless,
    scripted_schedule,  # noqa: F401 - a fixture
)
from test_losslessness import (
    PASS_P,
    PROMPT,
    REJECT_P,
    VOCAB,
    WARPINGS,
    chi_square_p,
    exact_joint,
    no_residual,
    pipeline_counts,
    steady_clock,  # noqa: F401 - a fixture
)
from test_replay import steady_rounds
from transformers import AutoModelForCausalLM

import specdec_trt.rejection
import specdec_trt.runtime.ort_engine
from benchlib.replay import (
    ModelChains,
    Proposer,
    SampledChains,
    fixed_length_rounds,
    fork,
    position_counts,
    record_model_chains,
    record_sampled_chains,
    sampled_continuation,
)
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.build import BuildRequest
from specdec_trt.build_engines.checkpoint import load_checkpoint
from specdec_trt.build_engines.manifest import read_manifest
from specdec_trt.build_engines.onnx_export import EXTERNAL_DATA_SUFFIX
from specdec_trt.costs import Costs
from specdec_trt.decoder import AUTO
from specdec_trt.drafting import MODEL, LookupFirstDrafter, ModelDrafter
from specdec_trt.loading import model_spec, open_engine_directory
from specdec_trt.planner import DraftPlanner
from specdec_trt.runtime.engine import Engine
from specdec_trt.runtime.ort_engine import OrtEngine
from specdec_trt.runtime.torch_engine import TorchEngine

ATOL = 1e-4
MAX_DRAFT_LEN = 8
VERIFY_WIDTH = MAX_DRAFT_LEN + 1
MAX_CONTEXT = 64
LOSSLESS_CONTEXT = 16  # prompt + 3 tokens + 3 drafts + slack: keeps the 24,000-row KV cache small
LOSSLESS_DRAFTS = 3
PROMPTS = ["hello world", "the quick brown fox", "a", "spec decoding is fun. spec"]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)  # longest prompt + 24 + 8 drafts fit in 64
# An independently initialised model of another family (same vocabulary): a draft that rarely agrees.
# Llama and Mistral with one seed have the same weights, so each is paired with a Qwen model.
STRANGER = {"llama": "qwen2", "mistral": "qwen3", "qwen2": "llama", "qwen3": "mistral"}


def family_kwargs(family: str) -> dict:
    return {"family": family, **SIZE}


@pytest.fixture(scope="module")
def engine_dirs(make_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every engine directory of this module, built at once: one per family, "int4" and "lossless"."""
    root = tmp_path_factory.mktemp("onnx_engines")
    requests = {
        family: BuildRequest(
            out=root / family,
            target=make_checkpoint(**family_kwargs(family)),
            draft=make_checkpoint(draft_of=(family_kwargs(family), 0.05), seed=100),
            max_draft_len=MAX_DRAFT_LEN,
            max_context=MAX_CONTEXT,
        )
        for family in FAMILIES
    }
    requests["int4"] = BuildRequest(
        out=root / "int4",
        target=make_checkpoint(**family_kwargs("llama")),
        draft="int4",
        max_draft_len=MAX_DRAFT_LEN,
        max_context=MAX_CONTEXT,
    )
    requests["lossless"] = BuildRequest(
        out=root / "lossless",
        target=make_checkpoint(with_tokenizer=False, vocab_size=VOCAB, seed=11, logit_scale=1.5, **SIZE),
        draft=make_checkpoint(with_tokenizer=False, vocab_size=VOCAB, seed=12, logit_scale=1.5, **SIZE),
        max_draft_len=LOSSLESS_DRAFTS,
        max_context=LOSSLESS_CONTEXT,
    )
    requests["lossless_int4"] = replace(requests["lossless"], out=root / "lossless_int4", draft="int4")
    build_all(*requests.values())
    return {name: request.out for name, request in requests.items()}


def target_engine(directory: Path) -> OrtEngine:
    """A fresh ONNX Runtime engine over a directory's target graph."""
    return OrtEngine(model_spec(directory, read_manifest(directory).target))


def release_slots(*engines: Engine) -> None:
    """Free every slot of ``engines`` that the replay's recordings (engine-level batches) left occupied: a
    decoder over the same engines admits its requests into those slots."""
    for engine in engines:
        for slot in range(engine.num_slots):
            if engine.occupied(slot):
                engine.release(slot)


# --- logits: OrtEngine against TorchEngine ----------------------------------------------------------------


class Lockstep:
    """An ONNX Runtime engine and the torch engine of the same checkpoint, driven together: every call
    compares their logits and their cached lengths."""

    def __init__(self, ours: OrtEngine, reference: TorchEngine, generator: torch.Generator) -> None:
        self.ours, self.reference, self.generator = ours, reference, generator
        self.batch = 0  # rows of the batch started by the last prefill (slots 0 .. batch - 1)

    def ids(self, batch: int, width: int) -> torch.Tensor:
        return torch.randint(3, self.ours.vocab_size, (batch, width), generator=self.generator)

    def prefill(self, lengths: list[int]) -> None:
        """Right-padded prompts; the padding is random real tokens, so padding that leaks shows."""
        ids, real = self.ids(len(lengths), max(lengths)), torch.tensor(lengths)
        self.batch = len(lengths)
        self.check(self.ours.prefill(ids, real), self.reference.prefill(ids, real), (len(lengths), self.vocab))
        assert self.ours.lengths[: self.batch].tolist() == lengths and self.ours.lengths[self.batch :].sum() == 0

    def forward(self, width: int) -> None:
        ids = self.ids(self.batch, width)
        self.check(self.ours.forward(ids), self.reference.forward(ids), (len(ids), width, self.vocab))

    def truncate(self, lengths: list[int]) -> None:
        self.ours.truncate_all(torch.tensor(lengths))
        self.reference.truncate_all(torch.tensor(lengths))
        assert self.ours.lengths[: self.batch].tolist() == lengths

    @property
    def vocab(self) -> int:
        return self.ours.vocab_size

    def check(self, ours: torch.Tensor, reference: torch.Tensor, shape: tuple[int, ...]) -> None:
        assert ours.dtype == torch.float32 and ours.shape == shape
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
        assert torch.equal(self.ours.lengths, self.reference.lengths)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("batch", [1, 3, 12], ids=["B1", "B3", "B12"])
def test_logits_match_the_torch_engine(family: str, batch: int, engine_dirs: dict[str, Path], make_checkpoint) -> None:
    """Prefill (a ragged batch), T = 1, T = max_draft_len + 1, T = 2 and 3, per-row truncation, then
    speculative-style rounds (verify 9, keep a different prefix per row): every multi-token step is one
    batched pass over rows of different cached lengths."""
    checkpoint = load_checkpoint(make_checkpoint(**family_kwargs(family)))
    generator = torch.Generator().manual_seed(batch)
    pair = Lockstep(target_engine(engine_dirs[family]), TorchEngine.from_checkpoint(checkpoint, MAX_CONTEXT), generator)
    pair.prefill(torch.randint(1, 11, (batch,), generator=generator).tolist())
    for width in (1, VERIFY_WIDTH, 2, 3):
        pair.forward(width)
    pair.truncate(torch.randint(1, 13, (batch,), generator=generator).tolist())
    pair.forward(VERIFY_WIDTH)
    pair.forward(1)
    for _ in range(3):  # verify rounds: each row keeps its own number of accepted drafts plus one token
        kept = pair.ours.lengths[:batch] + 1 + torch.randint(0, MAX_DRAFT_LEN + 1, (batch,), generator=generator)
        pair.forward(VERIFY_WIDTH)
        pair.truncate(kept.tolist())
    pair.forward(VERIFY_WIDTH)


def test_copied_prompt_cache_continues_like_its_source(engine_dirs: dict[str, Path]) -> None:
    """An engine whose fresh slots copy another's prompt caches (``copy_from``, here over the same graph) then
    computes exactly what the source computes, on a ragged batch, after a previous batch of another size."""
    source, adopter = target_engine(engine_dirs["llama"]), target_engine(engine_dirs["llama"])
    generator = torch.Generator().manual_seed(0)
    adopter.prefill(torch.randint(3, source.vocab_size, (1, 30), generator=generator), torch.tensor([30]))
    adopter.release(0)
    source.prefill(torch.randint(3, source.vocab_size, (3, 9), generator=generator), torch.tensor([5, 2, 9]))
    adopter.reserve(3)
    for slot, length in enumerate((5, 2, 9)):
        adopter.admit(slot)
        adopter.copy_from(source, slot, length)
    assert adopter.lengths.tolist() == [5, 2, 9]
    for width in (VERIFY_WIDTH, 1):
        ids = torch.randint(3, source.vocab_size, (3, width), generator=generator)
        torch.testing.assert_close(adopter.forward(ids), source.forward(ids), atol=1e-6, rtol=0)


def test_copied_cache_extends_rows_like_their_source(engine_dirs: dict[str, Path]) -> None:
    """copy_from extends each slot by the source's keys and values (a ragged batch, one row unchanged): the
    adopter then computes what the source computes; shrinking a row, or reading past the source, is refused."""
    source, adopter = target_engine(engine_dirs["llama"]), target_engine(engine_dirs["llama"])
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, source.vocab_size, (3, 9), generator=generator)
    source.prefill(prompts, torch.tensor([5, 2, 9]))
    adopter.prefill(prompts, torch.tensor([5, 2, 9]))
    source.forward(torch.randint(3, source.vocab_size, (3, 4), generator=generator))  # lengths 9, 6, 13
    for slot, stop in enumerate((8, 2, 13)):
        adopter.copy_from(source, slot, stop)
    assert adopter.lengths.tolist() == [8, 2, 13]
    source.truncate_all(torch.tensor([8, 2, 13]))
    for width in (VERIFY_WIDTH, 1):
        ids = torch.randint(3, source.vocab_size, (3, width), generator=generator)
        torch.testing.assert_close(adopter.forward(ids), source.forward(ids), atol=1e-6, rtol=0)
    lengths = adopter.lengths.tolist()
    for slot, stop in enumerate((8, 2, 13)):
        with pytest.raises(ValueError, match="only extends"):
            adopter.copy_from(source, slot, stop)
        with pytest.raises(ValueError, match="only extends"):
            adopter.copy_from(source, slot, 30)
    assert adopter.lengths.tolist() == lengths


def test_forked_cache_continues_each_prefix_like_a_prefill_of_it(engine_dirs: dict[str, Path]) -> None:
    """``fork`` (copy_from one source slot into several) starts one row per prefix of a cached sequence: each
    then computes what a prefill of that prefix computes; a prefix longer than the source holds is refused."""
    source, forked, reference = (target_engine(engine_dirs["llama"]) for _ in range(3))
    generator = torch.Generator().manual_seed(2)
    sequence = torch.randint(3, source.vocab_size, (1, 20), generator=generator)
    forked.prefill(sequence[:, :3], torch.tensor([3]))  # a batch of another size before
    source.prefill(sequence, torch.tensor([20]))
    fork(forked, source, [4, 11, 20])
    assert forked.lengths.tolist() == [4, 11, 20]
    new = torch.randint(3, source.vocab_size, (3, 2), generator=generator)
    logits = forked.forward(new)
    for row, length in enumerate((4, 11, 20)):
        reference.prefill(torch.cat([sequence[:, :length], new[row : row + 1]], 1), torch.tensor([length + 2]))
        reference.truncate_all(length)
        torch.testing.assert_close(logits[row : row + 1], reference.forward(new[row : row + 1]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="copy_from"):
        fork(forked, source, [21])


@pytest.mark.parametrize("gamma", [1, 3, MAX_DRAFT_LEN])
def test_replayed_self_draft_rounds_equal_the_decoder_rounds(gamma: int, engine_dirs: dict[str, Path]) -> None:
    """The int4 self-draft's proposals recorded once per committed length (``record_model_chains``) and
    replayed at a fixed draft length give the decoder's own rounds: the same count, and the same acceptances
    at every draft position."""
    decoder = SpeculativeDecoder.from_engines(engine_dirs["int4"], "engine")
    target, draft = decoder.target, decoder.drafter.engine
    total_accepted = 0
    for prompt in PROMPTS:
        real = decoder.generate(prompt, GREEDY, num_draft_tokens=gamma)
        prompt_ids = decoder.tokenize(prompt)
        chains = record_model_chains(
            target, draft, prompt_ids + real.token_ids, len(prompt_ids) + 1, MAX_DRAFT_LEN, rows=3
        )
        release_slots(target, draft)
        replayed = fixed_length_rounds(prompt_ids, real.token_ids, chains.proposer(), gamma, MODEL)
        assert len(replayed) == real.stats.rounds, prompt
        drafted, accepted = position_counts(replayed, gamma)
        assert drafted == real.stats.drafted_per_position, prompt
        assert accepted == real.stats.accepted_per_position, prompt
        total_accepted += sum(accepted)
    assert total_accepted > 0, "the int4 self-draft should be accepted sometimes"


def run_shape(rounds: int, drafted: list[int], accepted: list[int]) -> tuple:
    """A generation's rounds and its drafted and accepted tokens per draft position, as one category."""
    return rounds, tuple(drafted), tuple(accepted)


def replayed_shape(output: list[int], parts: dict[str, Proposer], gamma: int | str) -> tuple:
    """``run_shape`` of ``output`` replayed after ``PROMPT`` with ``parts`` drafting ``gamma`` a round (auto:
    the decoder's controller on the steady clock)."""
    replayed = steady_rounds(PROMPT, output, parts, lambda _: MODEL, gamma, LOSSLESS_DRAFTS)
    return run_shape(len(replayed), *position_counts(replayed, LOSSLESS_DRAFTS))


def homogeneity_p(first: Counter, second: Counter) -> float:
    """Chi-square test that two samples of categories come from one distribution; categories seen fewer than
    10 times in both samples together are pooled into one."""
    categories = sorted(set(first) | set(second), key=lambda c: first[c] + second[c], reverse=True)
    common = [c for c in categories if first[c] + second[c] >= 10]
    rare = [c for c in categories if first[c] + second[c] < 10]
    table = [
        [sample[c] for c in common] + ([sum(sample[c] for c in rare)] if rare else []) for sample in (first, second)
    ]
    return float(stats.chi2_contingency(table).pvalue)


SAMPLED_REPLAY = SamplingParams(max_new_tokens=7, temperature=0.8, top_k=5, ignore_eos=True)
SAMPLED_REPLAY_RUNS = 1_000


@dataclass
class SampledRecording:
    """A plain sampled continuation of ``PROMPT`` and what the replay needs of it: the int4 self-draft's
    sampled chains along it, its coins, and (for the negative control) its greedy chains."""

    seed: int
    output: list[int]
    sampled: SampledChains
    coins: np.ndarray
    greedy: ModelChains


@pytest.fixture(scope="module")
def sampled_recordings(lossless_int4: tuple[SpeculativeDecoder, torch.nn.Module]) -> list[SampledRecording]:
    decoder, _ = lossless_int4
    target, draft = decoder.target, decoder.drafter.engine
    runs, first = SAMPLED_REPLAY_RUNS, len(PROMPT) + 1
    params = [replace(SAMPLED_REPLAY, seed=runs + seed) for seed in range(runs)]  # not the speculative runs' seeds
    generator = torch.Generator().manual_seed(0)
    recordings = []
    for seed, output in enumerate(decoder.generate_batch([PROMPT] * runs, params, 0)):
        sequence = PROMPT + output.token_ids
        greedy = record_model_chains(target, draft, sequence, first, LOSSLESS_DRAFTS, rows=8)
        sampled = record_sampled_chains(
            target, draft, sequence, first, LOSSLESS_DRAFTS, SAMPLED_REPLAY, generator, rows=8
        )
        coins = np.random.default_rng(seed).random(len(sequence))
        recordings.append(SampledRecording(seed, output.token_ids, sampled, coins, greedy))
    release_slots(target, draft)
    return recordings


@pytest.mark.slow
@pytest.mark.usefixtures("steady_clock")
@pytest.mark.parametrize("gamma", [LOSSLESS_DRAFTS, AUTO])
def test_replayed_sampled_self_draft_rounds_follow_the_decoder_in_distribution(
    gamma: int | str,
    lossless_int4: tuple[SpeculativeDecoder, torch.nn.Module],
    sampled_recordings: list[SampledRecording],
) -> None:
    """The int4 self-draft sampling (temperature and top-k) at a fixed k and with auto (its stop rule reading
    the confidence of drafts after a rejected one from ``sampled_continuation``), replayed on plain sampled
    continuations by ``record_sampled_chains``, each drafted position accepted on a coin of chance
    min(1, q(y) / p(y)): the replayed rounds (their count, and drafted and accepted tokens per draft
    position) follow the distribution of the decoder's own speculative runs, by a chi-square test over 1,000
    runs each. Negative control: the draft's greedy proposals replayed on the same sampled continuations,
    as for greedy output, are rejected."""
    decoder, _ = lossless_int4
    target, draft = decoder.target, decoder.drafter.engine
    # One request at a time: in a batch, auto plans each row beside the others in the pass. Each with fresh
    # costs and a fresh planner: a decoder's learn across its requests, and the replay starts every
    # generation afresh.
    speculative = []
    for seed in range(SAMPLED_REPLAY_RUNS):
        scheduler, planner = decoder.scheduler, decoder.scheduler.planner
        scheduler.costs = Costs(scheduler.target.packs_rows)
        scheduler.planner = DraftPlanner(planner.drafter, planner.max_auto_draft, planner.max_context, scheduler.costs)
        speculative.append(decoder.generate(PROMPT, replace(SAMPLED_REPLAY, seed=seed), gamma))
    decoded = Counter(
        run_shape(o.stats.rounds, o.stats.drafted_per_position, o.stats.accepted_per_position) for o in speculative
    )
    replayed, as_greedy = Counter(), Counter()
    try:
        for recording in sampled_recordings:
            sequence = PROMPT + recording.output
            after_rejected = sampled_continuation(target, draft, sequence, SAMPLED_REPLAY, recording.seed)
            proposer = recording.sampled.proposer(recording.coins, after_rejected)
            replayed[replayed_shape(recording.output, {MODEL: proposer}, gamma)] += 1
            as_greedy[replayed_shape(recording.output, {MODEL: recording.greedy.proposer()}, gamma)] += 1
    finally:
        release_slots(target, draft)  # the continuations ran on the decoder's engines
    assert len(decoded) > 3, decoded  # rounds vary: some drafts are rejected
    assert homogeneity_p(decoded, replayed) > PASS_P
    assert homogeneity_p(decoded, as_greedy) < REJECT_P


def test_copy_from_refuses_another_layout_or_an_empty_source(
    engine_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = engine_dirs["llama"]
    source = target_engine(directory)

    def admitted(engine: OrtEngine) -> OrtEngine:
        engine.reserve(1)
        engine.admit(0)
        return engine

    with pytest.raises(ValueError, match="are free"):  # the source holds no sequence in that slot
        admitted(target_engine(directory)).copy_from(source, 0, 3)
    with pytest.raises(ValueError, match="only extends, with tokens the source holds"):  # nor any token
        admitted(target_engine(directory)).copy_from(admitted(source), 0, 3)
    source.prefill(torch.tensor([[3, 4, 5]]), torch.tensor([3]))
    # An engine that claims twice the heads: it runs no pass, so the check of its graph against that claim is
    # lifted for the test.
    monkeypatch.setattr(specdec_trt.runtime.ort_engine, "check_graph", lambda session, spec: None)
    spec = model_spec(directory, read_manifest(directory).target)
    other = admitted(OrtEngine(replace(spec, num_kv_heads=spec.num_kv_heads * 2)))
    with pytest.raises(ValueError, match="same cache layout"):
        other.copy_from(source, 0, 3)


def test_second_prefill_starts_afresh(engine_dirs: dict[str, Path], make_checkpoint) -> None:
    """A new batch of another size after a long one: no stale cache rows or lengths."""
    checkpoint = load_checkpoint(make_checkpoint(**family_kwargs("qwen2")))
    pair = Lockstep(
        target_engine(engine_dirs["qwen2"]), TorchEngine.from_checkpoint(checkpoint, MAX_CONTEXT), torch.Generator()
    )
    pair.prefill([20, 3])
    pair.forward(VERIFY_WIDTH)
    for lengths in ([5, 2, 9], [4, 4, 1], [7]):
        pair.prefill(lengths)
        pair.forward(VERIFY_WIDTH)
        pair.forward(2)


# --- greedy: speculative == target-only on the same ONNX engines ------------------------------------------


def decoder_for(kind: str, family: str, engine_dirs: dict[str, Path]) -> SpeculativeDecoder:
    directory = engine_dirs[family]
    if kind == "agrees_often":
        return SpeculativeDecoder.from_engines(directory, "engine")
    if kind == "ngram":
        return SpeculativeDecoder.from_engines(directory, "ngram")
    loaded = open_engine_directory(directory, [])
    stranger = ModelDrafter(target_engine(engine_dirs[STRANGER[family]]))
    return SpeculativeDecoder(loaded.target, stranger, loaded.tokenizer, loaded.eos_token_ids)


@pytest.mark.parametrize("kind", ["agrees_often", pytest.param("agrees_rarely", marks=pytest.mark.slow), "ngram"])
def test_speculative_greedy_equals_target_only(family: str, kind: str, engine_dirs: dict[str, Path]) -> None:
    decoder = decoder_for(kind, family, engine_dirs)
    assert isinstance(decoder.target, OrtEngine)
    assert assert_greedy_lossless(decoder, kind, PROMPTS, GREEDY, MAX_DRAFT_LEN) > 0


@pytest.mark.parametrize(
    ("family_name", "kind"),
    [("llama", "agrees_often"), ("qwen3", "agrees_rarely"), ("mistral", "ngram"), ("qwen2", "agrees_often")],
)
def test_auto_greedy_equals_target_only(family_name: str, kind: str, engine_dirs: dict[str, Path]) -> None:
    """num_draft_tokens="auto" on ONNX engines: up to the engines' 8 drafts, early stops included."""
    decoder = decoder_for(kind, family_name, engine_dirs)
    assert decoder.max_auto_draft == MAX_DRAFT_LEN
    assert assert_auto_greedy_lossless(decoder, PROMPTS, GREEDY) > 0


@pytest.mark.usefixtures("scripted_schedule")
@pytest.mark.parametrize("kind", ["agrees_often", "int4"])
def test_plain_rounds_keep_the_draft_cache_right(kind: str, engine_dirs: dict[str, Path]) -> None:
    """Runs of plain rounds the draft never sees, on a separate draft engine and on the int4 self-draft
    started from the target's prompt cache."""
    decoder = SpeculativeDecoder.from_engines(engine_dirs["llama" if kind == "agrees_often" else "int4"], "engine")
    assert isinstance(decoder.drafter.engine, OrtEngine)
    assert_scripted_greedy_lossless(decoder, PROMPTS, GREEDY)


def test_plain_output_equals_the_torch_engine(family: str, engine_dirs: dict[str, Path], make_checkpoint) -> None:
    onnx_out = SpeculativeDecoder.from_engines(engine_dirs[family], "none").generate_batch(PROMPTS, GREEDY)
    torch_decoder = SpeculativeDecoder.from_pretrained(
        make_checkpoint(**family_kwargs(family)), "none", max_context=MAX_CONTEXT
    )
    torch_out = torch_decoder.generate_batch(PROMPTS, GREEDY)
    assert [o.token_ids for o in onnx_out] == [o.token_ids for o in torch_out]
    assert [o.text for o in onnx_out] == [o.text for o in torch_out]


def test_int4_self_draft_is_greedy_lossless(engine_dirs: dict[str, Path]) -> None:
    decoder = SpeculativeDecoder.from_engines(engine_dirs["int4"], "engine")
    assert decoder.drafter.cache_from is decoder.target  # no draft prefill: the target's prompt cache
    baseline = decoder.generate_batch(PROMPTS, GREEDY, num_draft_tokens=0)
    for gamma in range(1, MAX_DRAFT_LEN + 1):
        batched = decoder.generate_batch(PROMPTS, GREEDY, num_draft_tokens=gamma)
        assert [o.token_ids for o in batched] == [o.token_ids for o in baseline], f"gamma={gamma}"
        single = decoder.generate(PROMPTS[0], GREEDY, num_draft_tokens=gamma)
        assert single.token_ids == baseline[0].token_ids, f"gamma={gamma} (alone)"
        drafted = sum(o.stats.drafted_tokens for o in batched)
        accepted = sum(o.stats.accepted_tokens for o in batched)
        assert drafted > 0 and 0 < accepted <= drafted, f"gamma={gamma}: the int4 draft should often agree"
        assert all(0 <= o.stats.acceptance_rate <= 1 for o in batched)


def test_lookup_first_int4_self_draft_is_greedy_lossless(engine_dirs: dict[str, Path]) -> None:
    """Prompt lookup, then the int4 self-draft (started from the target's prompt cache) where it finds
    nothing: the target-only output for every draft length."""
    decoder = SpeculativeDecoder.from_engines(engine_dirs["int4"], "ngram+engine")
    assert isinstance(decoder.drafter, LookupFirstDrafter)
    assert decoder.drafter.model.cache_from is decoder.target
    assert assert_greedy_lossless(decoder, "lookup_first", PROMPTS, GREEDY, MAX_DRAFT_LEN) > 0


@pytest.mark.parametrize(
    ("draft", "message"),
    [("ngram+no/such/dir", "not an engine directory"), ("ngram+none", "name the model"), ("ngram+", "name the model")],
)
def test_lookup_first_names_a_model_draft(draft: str, message: str, engine_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeDecoder.from_engines(engine_dirs["int4"], draft)


def test_int4_draft_graph_is_block_quantized(engine_dirs: dict[str, Path]) -> None:
    directory = engine_dirs["int4"]
    manifest = read_manifest(directory)
    assert manifest.draft_kind == "int4" and manifest.draft.quantization == "int4-block32"
    assert manifest.target.quantization == "none"
    graphs = {
        role: onnx.load(directory / role / "model.onnx", load_external_data=False).graph for role in ("target", "draft")
    }
    ops = {role: Counter(node.op_type for node in graph.node) for role, graph in graphs.items()}
    assert ops["draft"]["MatMulNBits"] == ops["target"]["MatMul"] > 0, ops
    assert float_matmul_weights(graphs["draft"]) == []
    assert len(float_matmul_weights(graphs["target"])) == ops["target"]["MatMul"], "the check must see float weights"
    for node in graphs["draft"].node:
        if node.op_type == "MatMulNBits":
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attributes["bits"] == 4 and attributes["block_size"] == 32
    sizes = {role: (directory / role / "model.onnx.data").stat().st_size for role in ("target", "draft")}
    assert sizes["draft"] < sizes["target"] / 2, sizes


def float_matmul_weights(graph: onnx.GraphProto) -> list[str]:
    """Float initializers consumed by a plain MatMul or Gemm."""
    floats = {i.name for i in graph.initializer if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    return [name for node in graph.node if node.op_type in ("MatMul", "Gemm") for name in node.input if name in floats]


# --- graph layout -------------------------------------------------------------------------------------------


def test_target_graph_layout(family: str, engine_dirs: dict[str, Path]) -> None:
    """GroupQueryAttention per layer, past/present caches of one shape (one shared buffer can be bound as
    both), new tokens packed, and every weight in one external data file beside the graph."""
    directory = engine_dirs[family]
    entry = read_manifest(directory).target
    graph_path = directory / entry.graph
    graph = onnx.load(graph_path, load_external_data=False).graph
    assert Counter(node.op_type for node in graph.node)["GroupQueryAttention"] == entry.num_layers

    def shapes(values) -> dict[str, list]:
        return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}

    inputs, outputs = shapes(graph.input), shapes(graph.output)
    cache = ["batch", entry.num_kv_heads, "cache_positions", entry.head_dim]  # the runtime grows its buffers
    for i in range(entry.num_layers):
        for kind in ("key", "value"):
            assert inputs[f"past_{kind}.{i}"] == outputs[f"present_{kind}.{i}"] == cache
    assert inputs["input_ids"] == [1, "new_tokens"]  # packed: row after row, no padding
    assert inputs["unpack_index"] == ["batch", "width"] and inputs["pack_index"] == ["new_tokens"]
    assert outputs["logits"] == [1, "logit_positions", entry.vocab_size]
    data = graph_path.with_name(graph_path.name + EXTERNAL_DATA_SUFFIX)
    assert data.is_file() and data.stat().st_size > graph_path.stat().st_size
    external = [i for i in graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert {e.value for i in external for e in i.external_data if e.key == "location"} == {data.name}
    inline = [i for i in graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL]
    assert all(numpy_helper.to_array(i).nbytes < 1024 for i in inline), "weights should live in the data file"


# --- losslessness on ONNX engines -------------------------------------------------------------------------


def lossless_pair(directory: Path) -> tuple[SpeculativeDecoder, torch.nn.Module]:
    """V=8 engines as a decoder, and transformers' own model of the same target checkpoint."""
    decoder = SpeculativeDecoder.from_engines(directory, "engine", num_draft_tokens=LOSSLESS_DRAFTS)
    assert isinstance(decoder.target, OrtEngine) and isinstance(decoder.drafter.engine, OrtEngine)
    reference = AutoModelForCausalLM.from_pretrained(read_manifest(directory).target.source).eval()
    return decoder, reference


@pytest.fixture(scope="module")
def lossless(engine_dirs: dict[str, Path]) -> tuple[SpeculativeDecoder, torch.nn.Module]:
    """A separate draft model's engine."""
    return lossless_pair(engine_dirs["lossless"])


@pytest.fixture(scope="module")
def lossless_int4(engine_dirs: dict[str, Path]) -> tuple[SpeculativeDecoder, torch.nn.Module]:
    """The int4 self-draft, which starts every request from the target's prompt cache."""
    decoder, reference = lossless_pair(engine_dirs["lossless_int4"])
    assert decoder.drafter.cache_from is decoder.target
    return decoder, reference


@pytest.mark.parametrize(
    ("pair", "name"),
    [("lossless", name) for name in ("temperature", "top_k", "top_p", "min_p")]
    + [("lossless_int4", name) for name in ("temperature", "top_p")],
)
@pytest.mark.slow
def test_drafts_are_lossless(pair: str, name: str, request: pytest.FixtureRequest) -> None:
    """A separate draft model, and the int4 self-draft started from the target's prompt cache."""
    decoder, reference = request.getfixturevalue(pair)
    counts, outputs = pipeline_counts(decoder, WARPINGS[name], gamma=LOSSLESS_DRAFTS)
    assert sum(o.stats.accepted_tokens for o in outputs) > 0
    assert chi_square_p(counts, exact_joint(reference, WARPINGS[name])) > PASS_P


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["lossless", "lossless_int4"])
def test_missing_residual_is_caught(pair: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    decoder, reference = request.getfixturevalue(pair)
    monkeypatch.setattr(specdec_trt.rejection, "recovery_distribution", no_residual)
    counts, _ = pipeline_counts(decoder, WARPINGS["temperature"], gamma=LOSSLESS_DRAFTS)
    assert chi_square_p(counts, exact_joint(reference, WARPINGS["temperature"])) < REJECT_P


@pytest.mark.slow
@pytest.mark.usefixtures("steady_clock")
@pytest.mark.parametrize(("pair", "name"), [("lossless", "top_p"), ("lossless_int4", "temperature")])
def test_auto_draft_length_is_lossless(
    pair: str, name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """num_draft_tokens="auto" on ONNX engines (the length of each round chosen from the costs and the
    acceptance so far, up to the engines' limit): the target's exact distribution; and the same run with
    the residual broken is rejected. Each run on a decoder of its own: auto's controllers learn across a
    decoder's requests (a new row starts at the acceptance of those before it), and both runs start alike."""
    _, reference = request.getfixturevalue(pair)
    directory = request.getfixturevalue("engine_dirs")[pair]
    probs = exact_joint(reference, WARPINGS[name])
    decoder = SpeculativeDecoder.from_engines(directory, "engine", num_draft_tokens=LOSSLESS_DRAFTS)
    counts, outputs = pipeline_counts(decoder, WARPINGS[name], gamma=AUTO)
    assert sum(o.stats.accepted_tokens for o in outputs) > 0
    assert chi_square_p(counts, probs) > PASS_P
    monkeypatch.setattr(specdec_trt.rejection, "recovery_distribution", no_residual)
    fresh = SpeculativeDecoder.from_engines(directory, "engine", num_draft_tokens=LOSSLESS_DRAFTS)
    broken, _ = pipeline_counts(fresh, WARPINGS[name], gamma=AUTO)
    assert chi_square_p(broken, probs) < REJECT_P


def test_the_rotary_positions_come_from_the_graph_metadata_or_the_graph(engine_dirs: dict[str, Path]) -> None:
    """A graph records the positions its rotary tables cover in its metadata (read at load without parsing the
    graph); a graph built before that is read instead, to the same answer."""
    import onnx
    import onnxruntime as ort

    from specdec_trt.build_engines.manifest import ROTARY_POSITIONS_KEY
    from specdec_trt.runtime.ort_engine import rotary_positions, session_options

    for graph in (engine_dirs["llama"] / "target" / "model.onnx", engine_dirs["int4"] / "draft" / "model.onnx"):
        session = ort.InferenceSession(str(graph), session_options())
        assert session.get_modelmeta().custom_metadata_map[ROTARY_POSITIONS_KEY] == str(MAX_CONTEXT)
        model = onnx.load(str(graph), load_external_data=False)
        del model.metadata_props[:]
        older = graph.with_name("older.onnx")  # beside the graph: its weights' relative location still holds
        onnx.save(model, str(older))
        older_session = ort.InferenceSession(str(older), session_options())
        assert ROTARY_POSITIONS_KEY not in older_session.get_modelmeta().custom_metadata_map
        assert rotary_positions(older_session, older) == rotary_positions(session, graph) == MAX_CONTEXT
        older.unlink()
