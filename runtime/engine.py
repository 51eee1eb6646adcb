"""The Engine protocol: one model with its own KV cache for a batch of sequences.

The decoder talks to engines through this protocol only, so its backends (ONNX Runtime, PyTorch) are
interchangeable. Rows of a batch may hold different lengths: after a verify pass each
row keeps its own number of accepted drafts.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class ContextOverflowError(ValueError):
    """A request would write past the engine's maximum context."""


@runtime_checkable
class Engine(Protocol):
    """What the decoder needs from a backend. Token ids go in on the host; logits come back as float32
    tensors on ``device``."""

    vocab_size: int
    max_context: int
    max_draft_len: int | None  # most drafts one verify pass was built for (None: no limit)
    device: torch.device

    @property
    def lengths(self) -> torch.Tensor:
        """Cached tokens per row, int64 [B] on the host."""

    def prefill(self, token_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Start a new batch: reset the cache, run right-padded prompts ``token_ids`` [B, T] whose real
        lengths are ``lengths`` [B]; return the logits at each row's last real token, [B, V]."""

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Append ``token_ids`` [B, T] after each row's cached tokens; return logits [B, T, V]."""

    def truncate(self, lengths: torch.Tensor | int) -> None:
        """Roll each row back to ``lengths`` cached tokens (never forward); no cache copy."""

    def close(self) -> None:
        """Release the cache and any backend resources."""


def check_room(lengths: torch.Tensor, num_new: int, max_context: int) -> None:
    """Raise ``ContextOverflowError`` when appending ``num_new`` tokens would pass ``max_context``."""
    longest = int(lengths.max()) + num_new
    if longest > max_context:
        raise ContextOverflowError(
            f"appending {num_new} tokens would need {longest} positions; the engine holds {max_context}"
        )


def check_truncate(current: torch.Tensor, lengths: torch.Tensor | int) -> torch.Tensor:
    """Validate a truncate request against the current lengths; returns the new lengths [B]."""
    new = torch.as_tensor(lengths, dtype=torch.int64).expand_as(current).clone()
    if bool((new < 0).any()) or bool((new > current).any()):
        raise ValueError(f"truncate to {new.tolist()} is outside the cached lengths {current.tolist()}")
    return new


def check_prompt_lengths(lengths: torch.Tensor, batch: int, width: int) -> None:
    """Prefill lengths must give every one of ``batch`` rows 1 to ``width`` real tokens."""
    if lengths.shape != (batch,) or bool((lengths < 1).any()) or bool((lengths > width).any()):
        raise ValueError(f"prefill lengths {lengths.tolist()} must be {batch} values in [1, {width}]")
