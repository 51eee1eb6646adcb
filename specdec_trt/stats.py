"""Per-request generation statistics and the speculative-decoding cost model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """Counters and timings for one request.

    A *round* is one verify pass of the target. ``accepted_per_position[i]`` counts rounds whose draft at
    position i was accepted, ``drafted_per_position[i]`` rounds that drafted a token at position i.
    Times are wall-clock seconds of this request's own life: ``queue_s`` from submission to a free slot,
    ``prefill_s`` from there to its first token (so ``queue_s + prefill_s`` is its time to first token),
    ``draft_prefill_s`` the draft's share of its prefill, ``draft_s`` / ``verify_s`` the drafting and verify
    (plus acceptance) time of the rounds it took part in, and ``total_s`` from submission to its end.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of the prompt tokens, those found in the prefix cache (not prefilled)
    generated_tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    store_drafted_tokens: int = 0  # of the drafted tokens, those copied from earlier requests' text (the store)
    store_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    draft_prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    def record_round(self, num_drafted: int, num_accepted: int, from_store: bool = False) -> None:
        """Count one verify pass that checked ``num_drafted`` drafts and accepted ``num_accepted`` (drafts from
        the store of earlier requests' text where ``from_store``)."""
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted
        self.rounds += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        if from_store:
            self.store_drafted_tokens += num_drafted
            self.store_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: tokens gained per verify pass, the accepted drafts plus the target's own token."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def drafts_per_round(self) -> float:
        """Mean drafts per verify pass (varies per round with num_draft_tokens="auto")."""
        return self.drafted_tokens / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of rounds that drafted position i in which that draft was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def time_to_first_token_s(self) -> float:
        return self.queue_s + self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time, queueing and prefill included."""
        return self.generated_tokens / self.total_s if self.total_s else 0.0

    @property
    def draft_ms_per_round(self) -> float:
        return 1e3 * self.draft_s / self.rounds if self.rounds else 0.0

    @property
    def verify_ms_per_round(self) -> float:
        return 1e3 * self.verify_s / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Raw counters plus the derived figures, for JSON output."""
        derived = (
            "acceptance_rate",
            "mean_accepted_tokens",
            "drafts_per_round",
            "per_position_acceptance",
            "time_to_first_token_s",
            "tokens_per_s",
            "draft_ms_per_round",
            "verify_ms_per_round",
        )
        return asdict(self) | {name: getattr(self, name) for name in derived}


def ideal_speedup(tau: float, gamma: float, cost_ratio: float) -> float:
    """Speedup over plain decoding when a round costs gamma draft steps of relative cost c plus one target
    step and yields tau tokens: tau / (gamma c + 1) (Leviathan et al. 2023)."""
    return tau / (gamma * cost_ratio + 1)
