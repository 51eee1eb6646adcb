"""CUDA-only checks that the CPU suite cannot make (every test name contains "cuda": scripts/gpu_check.sh
selects them with ``-k cuda``; on a machine without a CUDA device they skip).

- The rejection sampler on CUDA tensors gives exactly the CPU result for the same uniforms, and performs
  no host synchronisation of its own (the decoder's one ``.tolist()`` per round is the round's only one).
- Greedy speculative decoding with a vocabulary-pruned draft on CUDA engines equals plain greedy output,
  for fixed draft lengths and "auto".
- With CUDA graphs (the engines' default on a GPU) every round of the loop makes exactly one host
  synchronisation. (test_model.py's reference tests also run on the graphs: their "cuda-graphs" variants.)
- specdec-distill trains on CUDA (the held-out KL falls as on the CPU) and writes a draft checkpoint that loads.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import TEXT_VOCAB_SIZE

from specdec_trt import SamplingParams, SpeculativeDecoder, rejection
from specdec_trt.build_engines.checkpoint import read_config
from specdec_trt.build_engines.model import DRAFT_VOCAB_KEY
from specdec_trt.decoder import AUTO
from specdec_trt.distill import DataSettings, DistillConfig, TrainSettings, distill
from specdec_trt.rejection import coupled_verify, rejection_sample
from specdec_trt.runtime.transfer import count_host_syncs
from specdec_trt.sampling import BatchSampler
from specdec_trt.seeded_noise import SeededNoise

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EOS = 2  # conftest's char tokenizer: <unk>, <s>, </s>
PROMPTS = ["hello world", "the cat sat on the mat", "why is the sky blue?", "one, two, three, four"]
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
MAX_CONTEXT = 96


# --- the rejection sampler ------------------------------------------------------------------------------


def dyadic_dists(*shape: int, vocab: int, generator: torch.Generator, units: int = 64) -> torch.Tensor:
    """Random distributions whose probabilities are multiples of 1/units: their cumulative sums (and
    p - q residuals) are exact in float32 in any summation order, so CPU and CUDA kernels agree bit for bit
    and inverse-CDF sampling cannot differ by rounding."""
    flat = (2.0 * torch.randn(*shape, vocab, generator=generator)).softmax(-1).reshape(-1, vocab)
    draws = torch.multinomial(flat, units, replacement=True, generator=generator)
    counts = torch.zeros_like(flat).scatter_add_(1, draws, torch.ones(draws.shape))
    return (counts / units).reshape(*shape, vocab)


def sampler_cases(batch: int = 4096, gamma: int = 4, vocab: int = 16) -> dict[str, tuple]:
    """(drafts, draft_probs or None, target_probs) for sampled drafts, deterministic drafts and greedy rows;
    targets half agree with the drafts so every number of accepted drafts occurs."""
    generator = torch.Generator().manual_seed(0)
    q = dyadic_dists(batch, gamma, vocab=vocab, generator=generator)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=generator).reshape(batch, gamma)
    noise = dyadic_dists(batch, gamma + 1, vocab=vocab, generator=generator)
    sampled = noise.clone()
    sampled[:, :gamma] = 0.5 * q + 0.5 * noise[:, :gamma]
    one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
    deterministic = noise.clone()
    deterministic[:, :gamma] = 0.5 * one_hot + 0.5 * noise[:, :gamma]
    argmax = noise.argmax(-1)
    agree = torch.rand(batch, gamma, generator=generator) < 0.8
    greedy_drafts = torch.where(agree, argmax[:, :gamma], (argmax[:, :gamma] + 1) % vocab)
    greedy = torch.nn.functional.one_hot(argmax, vocab).float()
    return {
        "sampled": (drafts, q, sampled),
        "deterministic": (drafts, None, deterministic),
        "greedy": (greedy_drafts, None, greedy),
    }


def to_cuda(case: tuple) -> tuple:
    return tuple(None if t is None else t.cuda() for t in case)


def without_host_sync(function):
    """Run ``function`` with CUDA's sync debug mode set to raise on any synchronising operation; return its
    result (the caller checks the mode really raises with a positive control)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return function()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
def test_cuda_rejection_sampler_matches_cpu_for_the_same_uniforms(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = sampler_cases()
    batch, gamma = cases["sampled"][0].shape
    u = torch.rand(batch, gamma + 1, generator=torch.Generator().manual_seed(1))
    uniforms = {"cpu": u, "cuda": u.cuda()}  # made up front: no host-to-device copy in the checked call
    monkeypatch.setattr(rejection, "_uniform", lambda generator, rows, num, device: uniforms[device.type][:rows])
    for name, case in cases.items():
        cpu_out, cpu_accepted = rejection_sample(*case)
        assert (torch.bincount(cpu_accepted, minlength=gamma + 1) > 0).all(), f"{name}: not every count occurred"
        cuda_case = to_cuda(case)
        cuda_out, cuda_accepted = without_host_sync(lambda cuda_case=cuda_case: rejection_sample(*cuda_case))
        assert cuda_out.device.type == "cuda" and cuda_accepted.device.type == "cuda"
        assert torch.equal(cuda_out.cpu(), cpu_out), name
        assert torch.equal(cuda_accepted.cpu(), cpu_accepted), name


@needs_cuda
def test_cuda_rejection_sampler_makes_no_host_sync() -> None:
    """With a CUDA generator or torch's global one, and for seeded rows coupled verification on their keyed
    noise (drawn on the host, copied through pinned memory), a call queues work only; the decoder's
    ``.tolist()`` afterwards is the round's one sync."""
    drafts, q, target = to_cuda(sampler_cases(batch=64)["sampled"])
    for name, generator in {"one generator": torch.Generator("cuda").manual_seed(0), "global generator": None}.items():
        for probs in (q, None):
            output, accepted = without_host_sync(
                lambda probs=probs, generator=generator: rejection_sample(drafts, probs, target, generator)
            )
            assert output.shape == (64, drafts.shape[1] + 1) and bool((accepted >= 0).all()), name
    noises = [SeededNoise(seed, "cuda") for seed in range(64)]
    noises[0].exponentials(0, 1, target.shape[-1])  # the first pinned copy sets up the pinned allocator
    sampler = BatchSampler([SamplingParams(temperature=0.8, seed=seed) for seed in range(64)], "cuda", noises)
    output, accepted = without_host_sync(lambda: coupled_verify(drafts, target, sampler.noise(0, *target.shape[1:])))
    assert output.shape == (64, drafts.shape[1] + 1) and bool((accepted >= 0).all())
    torch.cuda.set_sync_debug_mode("error")  # positive control: the mode does catch a sync
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            accepted.tolist()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- a vocabulary-pruned draft on CUDA engines -------------------------------------------------------------


@needs_cuda
def test_cuda_pruned_draft_speculative_greedy_equals_plain(make_checkpoint, tmp_path: Path) -> None:
    target = make_checkpoint(family="llama")
    plain_decoder = SpeculativeDecoder.from_pretrained(target, "none", max_context=MAX_CONTEXT, device="cuda")
    plain = {prompt: plain_decoder.generate(prompt, GREEDY).token_ids for prompt in PROMPTS}
    plain_decoder.close()
    # Prune the three rarest tokens the target does emit: the target must produce tokens the draft can
    # never propose (every such position is a rejection), while the draft still agrees elsewhere.
    counts = Counter(token for ids in plain.values() for token in ids if token != EOS)
    pruned = sorted(token for token, _ in counts.most_common()[-3:])
    vocab = [token for token in range(TEXT_VOCAB_SIZE) if token not in pruned]
    draft = tmp_path / "pruned-draft"
    shutil.copytree(make_checkpoint(draft_of=({"family": "llama"}, 0.1), seed=6), draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {DRAFT_VOCAB_KEY: vocab}))

    decoder = SpeculativeDecoder.from_pretrained(target, draft, max_context=MAX_CONTEXT, device="cuda")
    draft_engine = decoder.drafter.engine
    assert draft_engine.device.type == "cuda" and decoder.target.device.type == "cuda"
    logits = draft_engine.prefill(torch.tensor([[4, 5, 6]]), torch.tensor([3]))
    assert torch.isinf(logits[0, pruned]).all() and torch.isfinite(logits[0, vocab]).all()
    draft_engine.release(0)  # the decoder's scheduler admits its requests into the engine's slots
    accepted = drafted = 0
    for prompt, expected in plain.items():
        assert decoder.generate(prompt, GREEDY, num_draft_tokens=0).token_ids == expected, prompt
        for gamma in (1, 3, 5, AUTO):
            out = decoder.generate(prompt, GREEDY, num_draft_tokens=gamma)
            assert out.token_ids == expected, (prompt, gamma)
            accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
    assert 0 < accepted < drafted, "the draft should agree often but not always"
    decoder.close()


# --- host synchronisations with CUDA graphs -----------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize(
    ("gamma", "temperature"),
    [(0, 0.0), (3, 0.0), (3, 0.8), (AUTO, 0.0)],
    ids=["plain", "greedy k=3", "sampled k=3", "greedy auto"],
)
def test_cuda_graph_decoding_syncs_once_per_round(make_checkpoint, gamma: int | str, temperature: float) -> None:
    """A round (draft k tokens, verify, accept) makes one host sync: the decoder's read of the accepted tokens.
    A request also syncs a fixed number of times around its prefill, so two lengths of the same seeded request
    are counted: the longer one's extra rounds must add exactly one sync each. With "auto" a model draft's stop
    rule also reads the draft's confidence after every token it drafts (ending the round early saves draft
    steps, and the rule needs the confidence to decide): one more sync per drafted token, and no other."""
    target = make_checkpoint(family="llama")
    draft = make_checkpoint(draft_of=({"family": "llama"}, 0.1), seed=6)
    decoder = SpeculativeDecoder.from_pretrained(target, draft, max_context=MAX_CONTEXT, device="cuda")
    short, long = (SamplingParams(max_new_tokens=n, temperature=temperature, seed=0, ignore_eos=True) for n in (16, 40))

    def graphs() -> tuple[int, int]:
        return decoder.target.num_graphs, decoder.drafter.engine.num_graphs

    # A capture synchronises: count only runs that captured nothing. "auto" picks draft lengths from measured
    # times, so a repeat may meet a shape the runs before it did not; its counts are then taken again.
    for _ in range(5):
        before = graphs()
        (short_syncs, short_out), (long_syncs, long_out) = (
            count_host_syncs(lambda p=params: decoder.generate(PROMPTS[0], p, num_draft_tokens=gamma))
            for params in (short, long)
        )
        if graphs() == before:
            break
    assert graphs() == before, "every run captured new graphs"
    assert short_syncs > 0, "the per-request syncs must be seen: the counter works"
    extra_rounds = long_out.stats.rounds - short_out.stats.rounds
    stop_checks = long_out.stats.drafted_tokens - short_out.stats.drafted_tokens if gamma == AUTO else 0
    assert extra_rounds > 0 and (gamma != AUTO or stop_checks > 0)
    assert long_syncs - short_syncs == extra_rounds + stop_checks, (short_syncs, long_syncs, extra_rounds, stop_checks)
    assert graphs()[0] >= 1 and (gamma == 0 or graphs()[1] >= 1)  # the rounds ran on graphs
    decoder.close()


# --- specdec-distill on CUDA ---------------------------------------------------------------------------------


# test_distill.py's five prompts: distillation holds out whole prompts, and with fewer, the held-out KL of a
# single unseen prompt need not fall (measured: with four prompts and 20 steps it rose, on the CPU too).
DISTILL_PROMPTS = [*PROMPTS, "good day!"]


def distill_config(out: Path, target: Path, prompts: Path, device: str) -> DistillConfig:
    """test_distill.py's tiny settings."""
    data = DataSettings(prompts=(str(prompts),), temperatures=(0.0, 1.0), continuation_tokens=48, seq_len=32)
    train = TrainSettings(steps=40, batch_size=4, learning_rate=3e-3, warmup_steps=4, eval_every=10, seed=1)
    return DistillConfig(
        out=out, target=target, num_layers=1, draft_vocab_size=24, data=data, train=train, device=device
    )


def prompts_jsonl(directory: Path) -> Path:
    path = directory / "prompts.jsonl"
    lines = [json.dumps({"id": str(i), "prompt": p, "chat": i % 2 == 0}) for i, p in enumerate(DISTILL_PROMPTS)]
    path.write_text("\n".join(lines) + "\n")
    return path


@needs_cuda
def test_cuda_distill_trains_and_writes_a_loadable_draft(make_checkpoint, tmp_path: Path) -> None:
    target = make_checkpoint(family="llama", seed=3, hidden_size=64, head_dim=16, num_layers=3)
    out = tmp_path / "draft"
    report = distill(distill_config(out, target, prompts_jsonl(tmp_path), "cuda"))
    first, last = report.evaluations[0], report.evaluations[-1]
    assert [e.step for e in report.evaluations] == [0, 10, 20, 30, 40]
    assert last.kl < 0.6 * first.kl, [e.kl for e in report.evaluations]
    assert last.acceptance > first.acceptance + 0.1

    config = read_config(out)
    assert config.num_layers == 1 and len(config.draft_vocab) == report.draft_vocab_size <= 24
    assert EOS in config.draft_vocab
    decoder = SpeculativeDecoder.from_pretrained(target, out, max_context=MAX_CONTEXT, device="cuda")
    for prompt in PROMPTS[:2]:
        plain = decoder.generate(prompt, GREEDY, num_draft_tokens=0)
        assert decoder.generate(prompt, GREEDY, num_draft_tokens=3).token_ids == plain.token_ids
    decoder.close()
