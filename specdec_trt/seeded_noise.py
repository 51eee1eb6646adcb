"""The randomness of a seeded request, keyed by its seed and each token's position.

A seeded request samples its token at sequence position t as argmax(p / E_t), where E_t holds one Exp(1)
number per vocabulary entry from a generator keyed by (seed, t) alone: the exponential race (Gumbel-max), an
exact sample of p. A model draft guesses position t with the same E_t, and the target's token there is
argmax(p / E_t) whatever was drafted, so a seeded request's text depends on the request alone (not on draft
lengths, the drafter, timing or the batch) and equals its text with no drafts at all.

The numbers come from NumPy's generator on the host, so they are the same on every device.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec_trt.runtime.transfer import to_device


class SeededNoise:
    """Exp(1) noise [V] per sequence position for one request, each position's drawn once and kept until the
    request commits past it."""

    def __init__(self, seed: int, device: torch.device | str) -> None:
        self.seed = seed
        self.device = torch.device(device)
        self._kept: dict[tuple[int, int], torch.Tensor] = {}

    def forget_before(self, position: int) -> None:
        """Drop the noise of positions before ``position``, the request's next token: it never goes back."""
        self._kept = {key: noise for key, noise in self._kept.items() if key[0] >= position}

    def exponentials(self, start: int, count: int, vocab: int) -> torch.Tensor:
        """Noise [count, vocab] of positions ``start`` .. ``start + count - 1``."""
        rows = [self._at(position, vocab) for position in range(start, start + count)]
        return torch.stack(rows) if rows else torch.empty(0, vocab, device=self.device)

    def _at(self, position: int, vocab: int) -> torch.Tensor:
        key = (position, vocab)
        if key not in self._kept:
            draws = np.random.default_rng([self.seed, position]).standard_exponential(vocab, dtype=np.float32)
            self._kept[key] = to_device(torch.from_numpy(draws), self.device)
        return self._kept[key]


def race(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """argmax(probs / exponentials) over the last dimension: with Exp(1) noise, a sample of the (possibly
    unnormalised) distribution ``probs`` [..., V]."""
    return (probs / exponentials).argmax(-1)
