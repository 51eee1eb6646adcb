"""Training text for a distilled draft: the target's own continuations of prompts, and text the user gives.

Everything ends as token chunks of at most ``seq_len`` tokens; the teacher labels each chunk as a whole
(``labels.py``), so the draft is trained on exactly the context the teacher saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from specdec_trt.bench.suites import BenchPrompt, load_suite
from specdec_trt.decoder import SpeculativeDecoder
from specdec_trt.sampling import SamplingParams

SEED_PROMPTS = Path(__file__).parent / "prompts.jsonl"
Progress = Callable[[int, int], None]


def prompt_ids(prompts: Sequence[BenchPrompt], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of each prompt; chat prompts go through the tokenizer's chat template when it has one."""
    encoded = []
    for prompt in prompts:
        text = prompt.prompt
        if prompt.chat and tokenizer.chat_template:
            message = [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        encoded.append(tokenizer.encode(text))
    return encoded


def load_prompts(files: Sequence[Path]) -> list[BenchPrompt]:
    """Prompts from JSONL files of ``{"id", "prompt", "chat"}`` (the shipped seed prompts when none)."""
    return [prompt for file in (files or [SEED_PROMPTS]) for prompt in load_suite(file).prompts]


def self_generated(
    decoder: SpeculativeDecoder,
    prompts: Sequence[list[int]],
    temperatures: Sequence[float],
    max_new_tokens: int,
    seed: int,
    batch_size: int,
    on_progress: Progress = lambda done, total: None,
) -> list[list[int]]:
    """Prompt + the target's continuation, once per prompt and temperature (plain decoding, so these are
    exactly the target's outputs; sampled rows are seeded, so the corpus is reproducible)."""
    jobs = [(ids, t, seed + n) for n, (ids, t) in enumerate((ids, t) for t in temperatures for ids in prompts)]
    jobs.sort(key=lambda job: len(job[0]))  # similar lengths per batch: less padding
    sequences: list[list[int]] = []
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start : start + batch_size]
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=t, seed=s) for _, t, s in batch]
        outputs = decoder.generate_batch([ids for ids, _, _ in batch], params, num_draft_tokens=0)
        sequences += [ids + out.token_ids for (ids, _, _), out in zip(batch, outputs)]
        on_progress(len(sequences), len(jobs))
    return sequences


def text_files(files: Sequence[Path], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """The token ids of each text file, whole."""
    return [tokenizer.encode(Path(file).read_text(encoding="utf-8")) for file in files]


def chunks(sequences: Sequence[list[int]], seq_len: int, min_len: int = 8) -> list[list[int]]:
    """Every sequence cut into consecutive pieces of at most ``seq_len`` tokens (pieces under ``min_len``
    tokens are dropped: too little context to learn from)."""
    pieces = [s[i : i + seq_len] for s in sequences for i in range(0, len(s), seq_len)]
    return [p for p in pieces if len(p) >= min_len]
