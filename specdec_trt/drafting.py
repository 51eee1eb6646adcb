"""Draft strategies: propose up to ``num_tokens`` next tokens for every row of a batch.

A drafter sees the committed sequences (prompt + accepted output, whose last token is not yet in any
cache) and returns the drafted ids with the distributions they were sampled from (None when the drafts
are deterministic, as for prompt lookup or an all-greedy batch: q is then one-hot on the drafted token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from runtime.engine import Engine
from specdec_trt.sampling import BatchSampler


@dataclass(frozen=True)
class Draft:
    """Drafted tokens [B, k] and the distributions they were drawn from [B, k, V] (None: one-hot)."""

    token_ids: torch.Tensor
    probs: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[1]


class Drafter(Protocol):
    """What the decoder needs from a draft strategy."""

    max_context: int | None  # longest sequence the drafter can follow; None when unlimited

    def begin(self, prompt_ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Start a batch from right-padded prompts [B, T] with real lengths [B]."""

    def propose(self, sequences: Sequence[Sequence[int]], num_tokens: int, sampler: BatchSampler) -> Draft:
        """Draft ``num_tokens`` (or fewer) tokens after each committed sequence."""


class ModelDrafter:
    """Drafts by sampling autoregressively from a small model's engine, with the request's warping.

    Cache bookkeeping: the committed sequence's last two tokens are fed at the start of every round. The
    newest one is in no cache yet; the one before it is in the draft cache unless the previous round
    accepted every draft (the draft never ran on its own last token). Re-feeding it rewrites the same
    keys and values at the same position, so one code path serves both cases with no branch per row.
    """

    def __init__(self, engine: Engine, prompt_cache_from: Engine | None = None) -> None:
        self.engine = engine
        self.prompt_cache_from = prompt_cache_from
        self.max_context: int | None = engine.max_context

    def begin(self, prompt_ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prefill the draft, or, with ``prompt_cache_from`` (a self-draft sharing the target's cache
        layout), copy the target's cached prompt, which the decoder has prefilled already."""
        if self.prompt_cache_from is not None:
            self.engine.adopt_prompt_cache(self.prompt_cache_from)
        else:
            self.engine.prefill(prompt_ids, lengths)

    def propose(self, sequences: Sequence[Sequence[int]], num_tokens: int, sampler: BatchSampler) -> Draft:
        lengths = torch.tensor([len(s) for s in sequences])
        self.engine.truncate(lengths - 2)
        logits = self.engine.forward(torch.tensor([list(s[-2:]) for s in sequences]))[:, -1]
        tokens, dists = [], []
        for i in range(num_tokens):
            probs = sampler.probs(logits.unsqueeze(1)).squeeze(1)
            token = sampler.sample(probs)
            tokens.append(token)
            dists.append(probs)
            if i + 1 < num_tokens:
                logits = self.engine.forward(token.unsqueeze(1))[:, 0]
        device = self.engine.device
        token_ids = (
            torch.stack(tokens, 1) if tokens else torch.zeros(len(sequences), 0, dtype=torch.int64, device=device)
        )
        probs = None if sampler.all_greedy or not dists else torch.stack(dists, 1)
        return Draft(token_ids, probs)


class PromptLookupDrafter:
    """Model-free drafting by n-gram match (as transformers' ``prompt_lookup_num_tokens`` and vLLM's
    ngram method): find the most recent earlier occurrence of the sequence's last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, device: torch.device | str = "cpu") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = torch.device(device)
        self.max_context: int | None = None

    def begin(self, prompt_ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prompt lookup keeps no state between rounds."""

    def propose(self, sequences: Sequence[Sequence[int]], num_tokens: int, sampler: BatchSampler) -> Draft:
        proposals = [self.lookup(np.asarray(s, dtype=np.int64), num_tokens) for s in sequences]
        width = max(len(p) for p in proposals)
        # Rows with shorter matches are padded; any deterministic draft is lossless, padding only costs
        # the verify positions the longest row needs anyway.
        rows = [
            np.pad(p, (0, width - len(p)), mode="edge") if len(p) else np.full(width, s[-1])
            for p, s in zip(proposals, sequences)
        ]
        token_ids = (
            torch.from_numpy(np.stack(rows)).to(self.device)
            if width
            else torch.zeros(len(sequences), 0, dtype=torch.int64, device=self.device)
        )
        return Draft(token_ids, None)

    def lookup(self, sequence: np.ndarray, num_tokens: int) -> np.ndarray:
        """Up to ``num_tokens`` tokens that followed the latest earlier match of the sequence's suffix."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(sequence) <= n or num_tokens == 0:
                continue
            windows = sliding_window_view(sequence[:-1], n)
            matches = np.flatnonzero((windows == sequence[-n:]).all(axis=1))
            if len(matches):
                start = matches[-1] + n
                return sequence[start : start + num_tokens]
        return sequence[:0]
