"""Training text for a distilled draft: the target's own continuations of prompts, and text the user gives.

Everything ends as token chunks of at most ``seq_len`` tokens; the teacher labels each chunk as a whole
(``labels.py``), so the draft is trained on exactly the context the teacher saw. Every chunk carries a
group: the prompt it continues (all of that prompt's continuations share it), or the text file it comes
from, so that held-out evaluation can hold out whole prompts and files rather than near-copies of training
chunks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from specdec_trt.bench.suites import BenchPrompt, load_suite
from specdec_trt.decoder import SpeculativeDecoder
from specdec_trt.sampling import SamplingParams

SEED_PROMPTS = Path(__file__).parent / "prompts.jsonl"
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")  # what a directory given as text contributes
Progress = Callable[[int, int], None]
Grouped = list[tuple[int, list[int]]]  # (group, token ids)


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
) -> Grouped:
    """Prompt + the target's continuation, once per prompt and temperature, grouped by prompt (plain
    decoding, so these are exactly the target's outputs; sampled rows are seeded: reproducible)."""
    jobs = [
        (group, ids, t, seed + n)
        for n, (group, ids, t) in enumerate((g, ids, t) for t in temperatures for g, ids in enumerate(prompts))
    ]
    jobs.sort(key=lambda job: len(job[1]))  # similar lengths per batch: less padding
    sequences: Grouped = []
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start : start + batch_size]
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=t, seed=s) for _, _, t, s in batch]
        outputs = decoder.generate_batch([ids for _, ids, _, _ in batch], params, num_draft_tokens=0)
        sequences += [(group, ids + out.token_ids) for (group, ids, _, _), out in zip(batch, outputs)]
        on_progress(len(sequences), len(jobs))
    return sequences


def text_paths(paths: Sequence[Path]) -> list[Path]:
    """The files of ``paths``: a file as given, a directory as every file under it with a
    ``TEXT_SUFFIXES`` suffix; sorted, without repeats."""
    files = set()
    for path in paths:
        if path.is_dir():
            files.update(f for f in path.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
        else:
            files.add(path)
    return sorted(files)


def text_files(
    paths: Sequence[Path], tokenizer: PreTrainedTokenizerBase, max_tokens: int | None = None, seed: int = 0
) -> list[list[int]]:
    """The token ids of each text file, whole. With ``max_tokens``, files are taken in a seeded random
    order until that many tokens (the last file cut short); files that are not UTF-8 text are skipped."""
    files = text_paths(paths)
    if max_tokens is not None:
        random.Random(seed).shuffle(files)
    texts, total = [], 0
    for file in files:
        try:
            ids = tokenizer.encode(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
        if max_tokens is not None:
            ids = ids[: max_tokens - total]
        if ids:
            texts.append(ids)
            total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    return texts


def chunks(sequences: Grouped, seq_len: int, min_len: int = 8) -> Grouped:
    """Every sequence cut into consecutive pieces of at most ``seq_len`` tokens, each keeping its group
    (pieces under ``min_len`` tokens are dropped: too little context to learn from)."""
    pieces = [(g, s[i : i + seq_len]) for g, s in sequences for i in range(0, len(s), seq_len)]
    return [(g, p) for g, p in pieces if len(p) >= min_len]
