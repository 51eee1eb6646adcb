"""Shared fixtures: tiny random Llama-family checkpoints and a character-level tokenizer, made here.

Nothing is downloaded: every model is built from a ``transformers`` config with random weights and
saved as a real checkpoint directory (config.json + safetensors, optionally a tokenizer).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from specdec_trt.runtime.ort_engine import size_thread_pool


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (the README runs ``-n 2``) each worker process has one core of its own: torch and
    ONNX Runtime get one intra-op thread each, so the workers' thread pools never fight over the cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        size_thread_pool(1)


# Heavy tests of two modules that carry no marks of their own, marked ``slow`` here by node name: ``name``
# marks every parametrization of a test, ``name[id]`` one of them. ``pytest -m "not slow"`` leaves them out.
SLOW_TESTS = {
    # Every test here: a chi-square or binomial test over 24,000 seeded generations (twice that where the
    # negative control runs beside it). test_rejection.py checks the sampler's distributions in the fast loop.
    "test_losslessness.py": (
        "test_model_draft_is_lossless",
        "test_unwarped_draft_probs_are_caught",
        "test_missing_residual_is_caught",
        "test_prompt_lookup_drafts_are_lossless",
        "test_lookup_first_drafts_are_lossless",
        "test_acceptance_rate_matches_theory",
        "test_auto_with_early_stop_is_lossless",
        "test_auto_with_unwarped_draft_probs_is_caught",
        "test_auto_with_its_cost_aware_stop_is_lossless",
    ),
    # A model draft at every fixed draft length from 1 to 8, batched and alone: the slowest greedy runs (one that
    # rarely agrees takes about a round per token). The fast loop keeps prompt lookup and lookup-first (whose
    # model rounds run the agrees_often draft) at every length, and auto with every draft.
    "test_greedy_equivalence.py": (
        "test_speculative_greedy_equals_target_only[agrees_often-llama]",
        "test_speculative_greedy_equals_target_only[agrees_often-mistral]",
        "test_speculative_greedy_equals_target_only[agrees_often-qwen2]",
        "test_speculative_greedy_equals_target_only[agrees_often-qwen3]",
        "test_speculative_greedy_equals_target_only[agrees_rarely-llama]",
        "test_speculative_greedy_equals_target_only[agrees_rarely-mistral]",
        "test_speculative_greedy_equals_target_only[agrees_rarely-qwen2]",
        "test_speculative_greedy_equals_target_only[agrees_rarely-qwen3]",
    ),
}


@pytest.hookimpl(tryfirst=True)  # before the -m option deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = SLOW_TESTS.get(item.path.name, ())
        for name in names:  # a renamed test must be renamed in the table too
            if not hasattr(item.module, name.split("[")[0]):
                raise pytest.UsageError(f"SLOW_TESTS names {name}, which {item.path.name} does not define")
        if item.name in names or getattr(item, "originalname", None) in names:
            item.add_marker(pytest.mark.slow)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz .,!?\n")
TEXT_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
_CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def char_tokenizer(chars: list[str] = CHARS) -> PreTrainedTokenizerFast:
    """A real ``tokenizers`` tokenizer with one token per character, a BOS/EOS pair and a chat template."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(
    family: str = "llama",
    vocab_size: int = TEXT_VOCAB_SIZE,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 32,
    logit_scale: float = 3.0,
    like: torch.nn.Module | None = None,
    noise: float = 0.0,
    head_dim: int | None = None,
    max_position_embeddings: int = 256,
) -> torch.nn.Module:
    """A random model of ``family`` whose every parameter (biases and norm weights too) is non-trivial.

    ``logit_scale`` sets the spread of the output logits, so distributions are peaked rather than
    uniform. With ``like``, the weights are ``like``'s plus relative Gaussian ``noise``: a draft that
    agrees with that target often. Qwen3 gets a head_dim unrelated to hidden_size / heads (12 unless
    ``head_dim`` says otherwise), as real Qwen3 configs have."""
    extra = {"head_dim": head_dim or 12} if family == "qwen3" else {"head_dim": head_dim} if head_dim else {}
    config = _CONFIGS[family](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            fresh = torch.randn(param.shape, generator=generator)
            if like is not None:
                base = like.get_parameter(name)
                param.copy_(base + noise * base.abs().mean() * fresh)
            elif name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * fresh)
            elif name.endswith("bias"):
                param.copy_(0.2 * fresh)
            elif name == "lm_head.weight":
                param.copy_(logit_scale * fresh / math.sqrt(hidden_size))
            else:
                param.copy_(fresh / math.sqrt(param.shape[-1]))
    return model


def save_checkpoint(model: torch.nn.Module, directory: Path, with_tokenizer: bool = True) -> Path:
    """Save ``model`` (and the character tokenizer) as a Hugging Face checkpoint directory."""
    model.save_pretrained(directory)
    if with_tokenizer:
        char_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``make_checkpoint(family=..., seed=..., draft_of=(target_kwargs, noise))`` -> directory.

    Checkpoints are cached per argument set for the whole session."""
    cache: dict[tuple, Path] = {}

    def make(with_tokenizer: bool = True, draft_of: tuple[dict, float] | None = None, **kwargs) -> Path:
        key = (with_tokenizer, repr(draft_of), tuple(sorted(kwargs.items())))
        if key not in cache:
            like = None
            if draft_of is not None:
                target_kwargs, noise = draft_of
                like = build_model(**target_kwargs)
                kwargs = {**target_kwargs, **kwargs, "noise": noise}
            model = build_model(like=like, **kwargs)
            cache[key] = save_checkpoint(model, tmp_path_factory.mktemp("ckpt"), with_tokenizer)
        return cache[key]

    return make
