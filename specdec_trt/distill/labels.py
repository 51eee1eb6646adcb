"""The teacher's distributions over training chunks, kept sparse: its top-k logits at every position, and
the log-normaliser that turns them into exact probabilities; and the choice of a pruned draft vocabulary."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass
class TeacherLabels:
    """Right-padded chunks ``tokens`` [N, L] with ``lengths`` [N]; at every position, the teacher's top-k
    next-token ids and logits [N, L, k] and the logsumexp over the whole vocabulary [N, L]."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    top_ids: torch.Tensor
    top_logits: torch.Tensor
    logsumexp: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def subset(self, rows: torch.Tensor) -> TeacherLabels:
        """The labels of the chunks ``rows``."""
        return TeacherLabels(
            *(t[rows] for t in (self.tokens, self.lengths, self.top_ids, self.top_logits, self.logsumexp))
        )

    def mask(self) -> torch.Tensor:
        """[N, L] True at real (unpadded) positions."""
        return torch.arange(self.tokens.shape[1])[None] < self.lengths[:, None]


@torch.inference_mode()
def label(
    teacher: PreTrainedModel,
    chunks: Sequence[list[int]],
    top_k: int,
    batch_size: int,
    on_progress: Callable[[int, int], None] = lambda done, total: None,
) -> TeacherLabels:
    """Run the teacher over every chunk (batched, right-padded) and keep its top-``top_k`` logits."""
    width = max(len(c) for c in chunks)
    tokens = torch.zeros(len(chunks), width, dtype=torch.int64)
    lengths = torch.tensor([len(c) for c in chunks])
    for row, chunk in enumerate(chunks):
        tokens[row, : len(chunk)] = torch.tensor(chunk)
    top_k = min(top_k, teacher.config.vocab_size)
    top_ids = torch.zeros(len(chunks), width, top_k, dtype=torch.int32)
    top_logits = torch.zeros(len(chunks), width, top_k)
    logsumexp = torch.zeros(len(chunks), width)
    device = teacher.device
    for start in range(0, len(chunks), batch_size):
        rows = slice(start, start + batch_size)
        ids = tokens[rows].to(device)
        mask = (torch.arange(width)[None] < lengths[rows, None]).to(device)
        logits = teacher(input_ids=ids, attention_mask=mask.long()).logits.float()
        values, indices = logits.topk(top_k, -1)
        top_ids[rows], top_logits[rows] = indices.int().cpu(), values.cpu()
        logsumexp[rows] = logits.logsumexp(-1).cpu()
        on_progress(min(start + batch_size, len(chunks)), len(chunks))
    return TeacherLabels(tokens, lengths, top_ids, top_logits, logsumexp)


def choose_draft_vocab(labels: TeacherLabels, size: int, vocab_size: int, always: Sequence[int] = ()) -> list[int]:
    """The ``size`` tokens the teacher predicts most often (its top-1 at every position, weighted by its
    probability, plus every token of the text), always including ``always`` (EOS); sorted ids."""
    mask = labels.mask()
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    top1 = labels.top_ids[..., 0][mask].long()
    top1_prob = (labels.top_logits[..., 0] - labels.logsumexp)[mask].exp().double()
    counts.index_add_(0, top1, top1_prob)
    counts.index_add_(0, labels.tokens[mask], torch.ones(int(mask.sum()), dtype=torch.float64))
    return sorted(set(counts.argsort(descending=True)[: max(size - len(set(always)), 0)].tolist()) | set(always))
