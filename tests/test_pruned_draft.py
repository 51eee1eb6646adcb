"""A vocabulary-pruned draft (q = 0 outside its vocabulary, as specdec-distill writes) keeps losslessness.

Same method as test_losslessness.py: the exact joint distribution of the first tokens, a chi-square test
over tens of thousands of seeded runs, and a negative control the test must reject. The control is the
pruning-specific mistake: drafts sampled from the pruned head but q reported from the unpruned one.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_losslessness import (
    MAX_CONTEXT,
    PASS_P,
    PROMPT,
    REJECT_P,
    VOCAB,
    WARPINGS,
    chi_square_p,
    exact_joint,
    pipeline_counts,
    reference_probs,
)
from transformers import AutoModelForCausalLM

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.build_engines.model import DRAFT_VOCAB_KEY
from specdec_trt.drafting import Draft, ModelDrafter
from specdec_trt.loading import load_engines
from specdec_trt.sampling import BatchSampler

DRAFT_VOCAB = [0, 1, 3, 4, 6]
PRUNED = [2, 5, 7]  # these can only come from the target


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint, tmp_path_factory) -> tuple:
    """A target, and a draft of another seed whose config prunes its head to ``DRAFT_VOCAB``."""
    target = make_checkpoint(with_tokenizer=False, vocab_size=VOCAB, seed=11, logit_scale=1.5)
    draft = tmp_path_factory.mktemp("pruned") / "draft"
    shutil.copytree(make_checkpoint(with_tokenizer=False, vocab_size=VOCAB, seed=12, logit_scale=1.5), draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {DRAFT_VOCAB_KEY: DRAFT_VOCAB}))
    return target, draft


@pytest.fixture(scope="module")
def target_model(checkpoints) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(checkpoints[0]).eval()


class UnprunedQDrafter(ModelDrafter):
    """Negative control: drafts from the pruned head, but reports q from the unpruned head's warped
    distribution (which is positive on tokens the draft can never propose)."""

    def __init__(self, pruned: ModelDrafter, unpruned: ModelDrafter) -> None:
        super().__init__(pruned.engine)
        self.unpruned = unpruned

    def reserve(self, num_slots: int) -> None:
        super().reserve(num_slots)
        self.unpruned.reserve(num_slots)

    def admit(self, slot: int, prefix=(), source=None) -> None:
        super().admit(slot, prefix, source)
        self.unpruned.admit(slot, prefix, source)

    def prefill(self, slots, chunks) -> None:
        super().prefill(slots, chunks)
        self.unpruned.prefill(slots, chunks)

    def release(self, slot: int) -> None:
        super().release(slot)
        self.unpruned.release(slot)

    def propose(self, slots, sequences, limits, sampler: BatchSampler, *args, **kwargs) -> Draft:
        draft = super().propose(slots, sequences, limits, sampler)
        self.unpruned.engine.truncate(slots, [len(s) - 2 for s in sequences])
        context = torch.tensor([list(s[-2:]) for s in sequences])
        logits = self.unpruned.engine.step(slots, torch.cat([context, draft.token_ids[:, :-1]], 1))[:, 1:]
        return Draft(draft.token_ids, draft.num_drafts, sampler.probs(logits))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_pruned_draft_is_lossless(name: str, checkpoints, target_model) -> None:
    decoder = SpeculativeDecoder.from_pretrained(*checkpoints, max_context=MAX_CONTEXT)
    params = WARPINGS[name]
    counts, outputs = pipeline_counts(decoder, params, gamma=3)
    exact = exact_joint(target_model, params)
    assert chi_square_p(counts, exact) > PASS_P
    pruned_mass = float(reference_probs(target_model, [PROMPT], params)[0, PRUNED].sum())
    assert pruned_mass > 0.1, "the target must often emit tokens the draft cannot propose"
    assert sum(out.stats.accepted_tokens for out in outputs) > 0.1 * sum(out.stats.drafted_tokens for out in outputs)


def test_pruned_draft_never_proposes_pruned_tokens(checkpoints) -> None:
    _, _, drafter = load_engines(*checkpoints, max_context=MAX_CONTEXT)
    rows = 2000
    slots = list(range(rows))
    drafter.reserve(rows)
    for slot in slots:
        drafter.admit(slot)
    drafter.prefill(slots, [PROMPT] * rows)
    sampler = BatchSampler([SamplingParams(temperature=1.5, seed=seed) for seed in range(rows)])
    draft = drafter.propose(slots, [PROMPT + [5]] * rows, [3] * rows, sampler)
    assert draft.num_drafts.tolist() == [3] * rows
    assert not torch.isin(draft.token_ids, torch.tensor(PRUNED)).any()
    assert (draft.probs[..., PRUNED] == 0).all() and (draft.probs[..., DRAFT_VOCAB] > 0).any(-1).all()
    assert len(draft.token_ids.unique()) == len(DRAFT_VOCAB), "a hot draft should propose every token it has"


@pytest.mark.slow
def test_unpruned_q_is_caught(checkpoints, target_model, tmp_path) -> None:
    unpruned = tmp_path / "unpruned"
    shutil.copytree(checkpoints[1], unpruned)
    config = json.loads((unpruned / "config.json").read_text())
    config.pop(DRAFT_VOCAB_KEY)
    (unpruned / "config.json").write_text(json.dumps(config))
    _, engine, pruned = load_engines(*checkpoints, max_context=MAX_CONTEXT)
    _, _, full = load_engines(checkpoints[0], unpruned, max_context=MAX_CONTEXT)
    broken = SpeculativeDecoder(engine, UnprunedQDrafter(pruned, full), num_draft_tokens=3)
    params = WARPINGS["temperature"]
    counts, _ = pipeline_counts(broken, params, gamma=3)
    assert chi_square_p(counts, exact_joint(target_model, params)) < REJECT_P
