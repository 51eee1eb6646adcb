"""Batched lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Draft token x at position i is accepted with probability min(1, p(x) / q(x)). The first rejected position
is replaced by a sample from norm(max(0, p - q)); when every draft is accepted the target's distribution
after the last draft gives a bonus token. The output is distributed exactly as the target's.
Everything is tensor code over the whole batch: no Python loop over rows, positions or the vocabulary.
A batch of greedy requests goes through ``greedy_verify``: with one-hot target distributions and
deterministic drafts the rule above accepts a draft exactly when it is the target's argmax and replaces the
first other one by the argmax, which needs neither the distributions nor random numbers.

Seeded rows go through ``coupled_verify`` instead: the target's token at each position is its own sample there,
drawn with noise keyed by the request's seed and the position (``seeded_noise``), and a draft is accepted while
it equals that sample. Every token is then exactly the target's sample, drafts or none. A deterministic draft x
is accepted with probability p(x), as above; a model draft, drawn with the same noise from q, with the
probability that both races pick the same token, which is at most sum(min(p, q)), rejection sampling's rate.
"""

from __future__ import annotations

import torch

from specdec_trt.sampling import argmax, race, sample_from


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    num_drafts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and sample the token that follows it.

    draft_token_ids [B, g] int64; draft_probs [B, g, V] (the distributions the drafts were sampled from)
    or None for deterministic drafts (q is one-hot on the drafted token); target_probs [B, g+1, V],
    already warped by the request's sampling parameters; random numbers from ``generator`` (default: torch's
    global one). ``num_drafts`` [B]: row r drafted only its first ``num_drafts[r]`` tokens (default: all g);
    the rest is padding, never accepted, and the bonus after a fully accepted row comes from its own last
    position. Returns output_ids [B, g+1] (accepted drafts, then the replacement or bonus token, then -1
    padding) and num_accepted [B].
    """
    batch, gamma = draft_token_ids.shape
    u = torch.rand(batch, gamma + 1, device=target_probs.device, generator=generator)
    p = target_probs[:, :gamma].gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)
    positions = torch.arange(gamma + 1, device=target_probs.device)
    drafted = _drafted(num_drafts, batch, gamma, target_probs.device)
    # u < p/q without dividing: q == 0 (impossible when drafts are sampled from q) cannot produce NaN.
    accepted = (u[:, :gamma] * q < p) & (positions[:gamma] < drafted.unsqueeze(1))
    num_accepted = accepted.cumprod(-1).sum(-1)
    residual = recovery_distribution(num_accepted, draft_token_ids, draft_probs, target_probs, drafted)
    final = sample_from(residual, u[:, gamma])
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), -1)], dim=1)
    output = torch.where(positions < num_accepted.unsqueeze(1), drafts, -1)
    output.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return output, num_accepted


def greedy_verify(
    draft_token_ids: torch.Tensor, target_logits: torch.Tensor, num_drafts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` for greedy requests, from the target's logits [B, g+1, V]: the drafts [B, g] that
    match the target's argmax, up to the first that does not (or the row's ``num_drafts``), then the argmax
    there (the correction) or after the last draft (the bonus). Returns output_ids [B, g+1] (-1 padded) and
    num_accepted [B]."""
    return _accept_matching(draft_token_ids, argmax(target_logits), num_drafts)


def coupled_verify(
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    exponentials: torch.Tensor,
    num_drafts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification of seeded rows: the target's token at each of the g+1 positions is the exponential race of
    its warped distribution ``target_probs`` [B, g+1, V] on the row's noise there (``exponentials``, same
    shape); the drafts [B, g] equal to it are accepted up to the first that is not (or the row's
    ``num_drafts``), then the target's token follows. Returns output_ids [B, g+1] (-1 padded) and num_accepted
    [B]."""
    return _accept_matching(draft_token_ids, race(target_probs, exponentials), num_drafts)


def _accept_matching(
    draft_token_ids: torch.Tensor, target_ids: torch.Tensor, num_drafts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's drafts while they equal the target's tokens [B, g+1], then the target's token after them."""
    target_ids = target_ids.to(draft_token_ids.device)
    batch, gamma = draft_token_ids.shape
    positions = torch.arange(gamma + 1, device=target_ids.device)
    drafted = _drafted(num_drafts, batch, gamma, target_ids.device)
    matches = (draft_token_ids == target_ids[:, :gamma]) & (positions[:gamma] < drafted.unsqueeze(1))
    num_accepted = matches.cumprod(-1).sum(-1)
    return torch.where(positions <= num_accepted.unsqueeze(1), target_ids, -1), num_accepted


def recovery_distribution(
    num_accepted: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_drafts: torch.Tensor,
) -> torch.Tensor:
    """Unnormalised distribution [B, V] of the token after the accepted prefix: max(0, p - q) at the first
    rejected position, or the target's own distribution after a row's ``num_drafts`` were all accepted (the
    bonus)."""
    batch, gamma = draft_token_ids.shape
    rows = torch.arange(batch, device=target_probs.device)
    p = target_probs[rows, num_accepted]
    if gamma == 0:
        return p
    at = num_accepted.clamp(max=gamma - 1)
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(-1, draft_token_ids[rows, at].unsqueeze(-1), 1.0)
    else:
        q = draft_probs[rows, at]
    q = q * (num_accepted < num_drafts).unsqueeze(-1)
    residual = (p - q).clamp_(min=0)
    # p == q leaves no residual mass; rejection then only happens through rounding, and p is the limit.
    empty = residual.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)


def _drafted(num_drafts: torch.Tensor | None, batch: int, gamma: int, device: torch.device) -> torch.Tensor:
    """Drafts per row [B]: ``num_drafts``, or all ``gamma``."""
    if num_drafts is None:
        return torch.full((batch,), gamma, dtype=torch.int64, device=device)
    return num_drafts.to(device=device, dtype=torch.int64)
