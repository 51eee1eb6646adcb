"""One speculative round over the decoding rows of a batch: draft, verify every row in one pass, accept.

Cache invariant between rounds, per row: the target's cache holds the committed sequence except its last
token. A round feeds the target [last committed token, d_1 .. d_k] for each row (each with its own k, 0 for a
plain step) in one verify pass, rejection-samples each row with its own generator, and leaves the accepted
drafts and the target's token to commit; the next round rolls the target back to the committed length by
moving its length pointers, so rejected drafts are never read and nothing is copied.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec_trt.drafting import Draft, Drafter, StopRule, merge_drafts
from specdec_trt.rejection import greedy_verify, rejection_sample
from specdec_trt.runtime.engine import Engine
from specdec_trt.runtime.transfer import HostCopy, to_device
from specdec_trt.sampling import BatchSampler


@dataclass
class RoundResult:
    """Per row: the tokens to commit (accepted drafts, then the target's own), drafts made and accepted;
    the drafts' confidences (queued to the host, when stop rules asked for them) and the round's times."""

    tokens: list[list[int]]
    num_drafted: list[int]
    num_accepted: list[int]
    confidence: HostCopy | None
    draft_s: float
    verify_s: float


def speculative_round(
    target: Engine,
    drafter: Drafter | None,
    slots: Sequence[int],
    sequences: Sequence[Sequence[int]],
    limits: Sequence[int],
    sampler: BatchSampler,
    stop_rules: dict[str, StopRule] | None = None,
) -> RoundResult:
    """Draft up to ``limits[i]`` tokens for row i (none where 0), verify all rows in one target pass and
    accept each row's longest valid prefix plus one token. One host synchronisation, reading the result."""
    tick = time.perf_counter()
    drafting = [i for i, k in enumerate(limits) if k > 0]
    draft = Draft.empty(len(slots), target.device)
    if drafting:
        picked = [slots[i] for i in drafting], [sequences[i] for i in drafting], [limits[i] for i in drafting]
        rows = sampler if len(drafting) == len(slots) else sampler.subset(drafting)
        draft = merge_drafts([(drafting, drafter.propose(*picked, rows, stop_rules))], len(slots))
    tock = time.perf_counter()
    # Queued now, read after the round's sync: reading the confidences would otherwise sync again.
    confidence = None if draft.confidence is None else HostCopy(draft.confidence.float())
    target.truncate(slots, [len(s) - 1 for s in sequences])
    last = to_device(torch.tensor([s[-1:] for s in sequences]), target.device)
    logits = target.step(slots, torch.cat([last, draft.token_ids.to(last.device)], 1), (draft.num_drafts + 1).tolist())
    num_drafts = to_device(draft.num_drafts, target.device)
    if sampler.all_greedy:
        output, num_accepted = greedy_verify(draft.token_ids, logits, num_drafts)
    else:
        probs = sampler.probs(logits)
        output, num_accepted = rejection_sample(draft.token_ids, draft.probs, probs, sampler.generators, num_drafts)
    rows = torch.cat([output, num_accepted[:, None]], 1).tolist()  # the round's one host sync
    done = time.perf_counter()
    tokens = [row[: row[-1] + 1] for row in rows]
    return RoundResult(
        tokens, draft.num_drafts.tolist(), [row[-1] for row in rows], confidence, tock - tick, done - tock
    )
