"""One speculative round over the decoding rows of a batch: draft, verify every row in one pass, accept.

Cache invariant between rounds, per row: the target's cache holds the committed sequence except its last
token. A round feeds the target [last committed token, d_1 .. d_k] for each row (each with its own k, 0 for a
plain step) in one verify pass, accepts each row's drafts (``_verify``), and leaves the accepted
drafts and the target's token to commit; the next round rolls the target back to the committed length by
moving its length pointers, so rejected drafts are never read and nothing is copied.

Prefill chunks of requests being admitted can ride in the verify pass: on an engine that packs a pass's
tokens they cost their own tokens and no pass of their own, whose fixed cost (reading every weight) would
otherwise be paid once more per round while a prompt is prefilled.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec_trt.drafting import Draft, Drafter, DraftPlan, merge_drafts, pad_right
from specdec_trt.rejection import coupled_verify, greedy_verify, rejection_sample
from specdec_trt.runtime.engine import Engine
from specdec_trt.runtime.transfer import HostCopy, to_device
from specdec_trt.sampling import BatchSampler


@dataclass
class RoundResult:
    """Per row: the tokens to commit (accepted drafts, then the target's own), drafts made and accepted;
    the drafts' confidences (queued to the host, when stop rules asked for them), the round's times (the
    verify pass's with the chunks that rode in it), and the logits after each riding chunk's last token."""

    tokens: list[list[int]]
    num_drafted: list[int]
    num_accepted: list[int]
    confidence: HostCopy | None
    draft_s: float
    verify_s: float
    rider_logits: torch.Tensor | None = None


def speculative_round(
    target: Engine,
    drafter: Drafter | None,
    slots: Sequence[int],
    sequences: Sequence[Sequence[int]],
    limits: Sequence[int],
    sampler: BatchSampler,
    plan: DraftPlan | None = None,
    riders: Sequence[tuple[int, Sequence[int]]] = (),
) -> RoundResult:
    """Draft up to ``limits[i]`` tokens for row i (none where 0; ``plan``: the part drafting each row and the
    stop rules), verify all rows in one target pass and accept each row's longest valid prefix plus one
    token. ``riders``: prefill chunks (slot, tokens) that the verify pass takes too. One host synchronisation,
    reading the result."""
    tick = time.perf_counter()
    drafting = [i for i, k in enumerate(limits) if k > 0]
    draft = Draft.empty(len(slots), target.device)
    if drafting:
        picked = [slots[i] for i in drafting], [sequences[i] for i in drafting], [limits[i] for i in drafting]
        rows = sampler if len(drafting) == len(slots) else sampler.subset(drafting)
        subset = None if plan is None else plan.subset(drafting)
        draft = merge_drafts([(drafting, drafter.propose(*picked, rows, subset))], len(slots))
    tock = time.perf_counter()
    # Queued now, read after the round's sync: reading the confidences would otherwise sync again.
    confidence = None if draft.confidence is None else HostCopy(draft.confidence.float())
    target.truncate(slots, [len(s) - 1 for s in sequences])
    last = to_device(torch.tensor([s[-1:] for s in sequences]), target.device)
    block = torch.cat([last, draft.token_ids.to(last.device)], 1)
    pass_slots, num_new, logits_from = list(slots), (draft.num_drafts + 1).tolist(), [0] * len(slots)
    if riders:
        chunks = to_device(torch.tensor(pad_right([chunk for _, chunk in riders])), target.device)
        width = max(block.shape[1], chunks.shape[1])
        block = torch.cat([F.pad(block, (0, width - block.shape[1])), F.pad(chunks, (0, width - chunks.shape[1]))])
        pass_slots += [slot for slot, _ in riders]
        num_new += [len(chunk) for _, chunk in riders]
        logits_from += [len(chunk) - 1 for _, chunk in riders]
    logits = target.step(pass_slots, block, num_new, logits_from)
    rider_logits = logits[len(slots) :, 0] if riders else None
    logits = logits[: len(slots)]
    output, num_accepted = _verify(draft, logits, sampler, to_device(draft.num_drafts, target.device))
    rows = torch.cat([output, num_accepted[:, None]], 1).tolist()  # the round's one host sync
    done = time.perf_counter()
    tokens = [row[: row[-1] + 1] for row in rows]
    return RoundResult(
        tokens, draft.num_drafts.tolist(), [row[-1] for row in rows], confidence, tock - tick, done - tock, rider_logits
    )


def _verify(
    draft: Draft, logits: torch.Tensor, sampler: BatchSampler, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ids [B, g+1] and accepted drafts [B] of each row from the target's logits [B, g+1, V]: a greedy
    batch by argmax; seeded rows by the target's own sample on their keyed noise (``coupled_verify``), so their
    text does not depend on what was drafted; the other rows by rejection sampling."""
    if sampler.all_greedy:
        return greedy_verify(draft.token_ids, logits, num_drafts)
    probs = sampler.probs(logits)
    seeded = sampler.seeded_rows
    if len(seeded) == len(sampler):
        return coupled_verify(draft.token_ids, probs, sampler.noise(0, *probs.shape[1:]), num_drafts)
    output, num_accepted = rejection_sample(draft.token_ids, draft.probs, probs, None, num_drafts)
    if seeded:
        rows = to_device(torch.tensor(seeded), probs.device)
        noise = sampler.noise(0, *probs.shape[1:])
        output[rows], num_accepted[rows] = coupled_verify(draft.token_ids[rows], probs[rows], noise, num_drafts[rows])
    return output, num_accepted
