"""Sampling parameters and batched logits warping.

``BatchSampler`` holds per-row parameters as tensors, so one call warps a whole batch with no Python loop
over rows or the vocabulary. The warping order is Hugging Face's: temperature, top-k, top-p, min-p. A seeded
row samples with its own noise, keyed by its seed and the token's position (``seeded_noise``); the other rows
share torch's global generator.
Greedy rows (temperature 0) become one-hot distributions on the argmax, which lets the rejection sampler
treat them as ordinary rows; a batch of greedy rows only skips building them (``BatchSampler.draw``,
``rejection.greedy_verify``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec_trt.runtime.transfer import to_device
from specdec_trt.seeded_noise import SeededNoise
from specdec_trt.validation import (
    MAX_INT64,
    MAX_SEED,
    InvalidTypeError,
    InvalidValueError,
    check_bounded,
    check_flag,
    check_integer,
)

PREFIX = "invalid sampling parameters: "


# The largest temperature float32 rounds to 0 (half its smallest subnormal; the tie goes to the even 0). The
# sampler divides by float32 temperatures, so every temperature up to this one is greedy, its limit.
LARGEST_GREEDY_TEMPERATURE = 2.0**-150


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy decoding (the default); ``top_k=0`` and
    ``top_p=1`` and ``min_p=0`` switch those filters off. ``stop`` strings end generation and are not
    included in the text; ``seed`` makes sampling reproducible."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        """Refuse, with one line naming the field, any value that cannot mean what the field says."""
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            raise InvalidValueError(f"{PREFIX}stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        checks = (
            lambda: check_integer("max_new_tokens", self.max_new_tokens, 1, MAX_INT64),
            lambda: check_bounded("temperature", self.temperature, lambda t: t >= 0, ">= 0 (0 means greedy)"),
            lambda: check_bounded("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1] (1 disables it)"),
            lambda: check_integer("top_k", self.top_k, 0, MAX_INT64),
            lambda: check_bounded("min_p", self.min_p, lambda p: 0 <= p < 1, "in [0, 1) (0 disables it)"),
            lambda: self.seed is None or check_integer("seed", self.seed, 0, MAX_SEED),
            lambda: check_flag("ignore_eos", self.ignore_eos),
        )
        problems = []
        for check in checks:
            try:
                check()
            except (InvalidValueError, InvalidTypeError) as error:
                problems.append(error)
        if problems:
            kind = InvalidTypeError if any(isinstance(p, InvalidTypeError) for p in problems) else InvalidValueError
            raise kind(PREFIX + "; ".join(map(str, problems)))
        for name in ("max_new_tokens", "top_k", "seed"):  # NumPy integers become Python's
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one that float32, the sampler's precision, rounds to 0 (its limit is greedy)."""
        return self.temperature <= LARGEST_GREEDY_TEMPERATURE


def seeded_noise(params: SamplingParams, device: torch.device | str) -> SeededNoise | None:
    """The request's own noise when it samples with a seed; None for greedy or unseeded requests."""
    return None if params.seed is None or params.greedy else SeededNoise(params.seed, device)


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """Index of the maximum over the last dimension (the first one on ties, as torch's). On the CPU it runs
    NumPy's vectorised kernel, many times faster than torch's on one thread."""
    if scores.device.type == "cpu":
        return torch.from_numpy(scores.detach().numpy().argmax(-1))
    return scores.argmax(-1)


def race(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax(probs / exponentials) over the last dimension, a sample of the (possibly
    unnormalised) distribution ``probs`` [..., V] when ``exponentials`` are independent Exp(1) numbers."""
    return argmax(probs / exponentials)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the token whose cumulative-probability interval holds ``u`` times the row's
    total mass (so rows need not be normalised). probs [..., V], u [...] -> ids [...]."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)


class BatchSampler:
    """Per-row sampling parameters and seeded noise for one batch of requests."""

    def __init__(
        self,
        params: Sequence[SamplingParams],
        device: torch.device | str = "cpu",
        noises: Sequence[SeededNoise | None] | None = None,
        positions: Sequence[int] | None = None,
    ) -> None:
        """``noises``: each row's own (kept by its request across rounds; default: fresh ones from the seeds).
        ``positions``: each row's position of its next token in its sequence (what seeded noise is keyed by)."""
        self.device = torch.device(device)
        self.params = list(params)

        def column(name: str, dtype: torch.dtype) -> torch.Tensor:  # copied as a kernel is queued: no host sync
            return to_device(torch.tensor([getattr(p, name) for p in self.params], dtype=dtype), self.device)

        self.temperature = column("temperature", torch.float32)
        self.top_k = column("top_k", torch.int64)
        self.top_p = column("top_p", torch.float32)
        self.min_p = column("min_p", torch.float32)
        greedy = [p.greedy for p in self.params]
        self.greedy = to_device(torch.tensor(greedy), self.device)
        self.all_greedy, self._any_greedy = all(greedy), any(greedy)
        sampled = [p for p, g in zip(self.params, greedy) if not g]
        self._needs_sort = any(p.top_k > 0 or p.top_p < 1 for p in sampled)
        self._needs_min_p = any(p.min_p > 0 for p in sampled)
        self.noises = list(noises) if noises is not None else [seeded_noise(p, self.device) for p in self.params]
        self.positions = list(positions) if positions is not None else [0] * len(self.params)
        self.seeded_rows = [row for row, noise in enumerate(self.noises) if noise is not None]

    def __len__(self) -> int:
        return len(self.params)

    def subset(self, rows: Sequence[int]) -> BatchSampler:
        """The sampler of some of the rows (their own parameters, noise and positions), in that order."""
        return BatchSampler(
            [self.params[r] for r in rows],
            self.device,
            [self.noises[r] for r in rows],
            [self.positions[r] for r in rows],
        )

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distributions [B, T, V] from float32 logits [B, T, V]."""
        if self.all_greedy:
            return _one_hot_argmax(logits)
        per_row = (slice(None), None, None)
        # Shifting by the row maximum first keeps huge logits finite when divided by a small temperature.
        # Every step after the first works in place: on a CPU each fresh vocabulary-sized tensor of a
        # multi-token verify costs more than the arithmetic.
        scores = logits - logits.amax(-1, keepdim=True)
        scores.div_(torch.where(self.greedy, 1.0, self.temperature)[per_row])
        if self._needs_sort:
            scores = _top_k_top_p(scores, self.top_k[per_row], self.top_p[per_row])
        probs = scores.softmax(-1)
        if self._needs_min_p:
            floor = self.min_p[per_row] * probs.amax(-1, keepdim=True)
            probs.masked_fill_(probs < floor, 0.0)
            probs.div_(probs.sum(-1, keepdim=True))
        if self._any_greedy:
            probs = torch.where(self.greedy[per_row], _one_hot_argmax(logits), probs)
        return probs

    def noise(self, step: int, count: int, vocab: int) -> torch.Tensor:
        """The seeded rows' noise [len(seeded_rows), count, vocab] for the ``count`` positions from each row's
        next position plus ``step``."""
        rows = []
        for row in self.seeded_rows:
            self.noises[row].forget_before(self.positions[row])
            rows.append(self.noises[row].exponentials(self.positions[row] + step, count, vocab))
        return torch.stack(rows)

    def sample(self, probs: torch.Tensor, step: int = 0) -> torch.Tensor:
        """One token per row from distributions [B, V] for each row's next position plus ``step``: a seeded row
        runs the exponential race on its noise there, the others sample with the global generator."""
        if self.all_greedy:
            return argmax(probs)
        if len(self.seeded_rows) == len(self):
            return race(probs, self.noise(step, 1, probs.shape[-1])[:, 0])
        tokens = sample_from(probs, torch.rand(len(self), device=self.device))
        if self.seeded_rows:
            rows = to_device(torch.tensor(self.seeded_rows), self.device)
            tokens[rows] = race(probs[rows], self.noise(step, 1, probs.shape[-1])[:, 0]).to(tokens.device)
        return tokens

    def draw(self, logits: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row from logits [B, V] (for each row's next position plus ``step``), and the warped
        distributions [B, V] it was drawn from; when every row is greedy, the argmax and None (the one-hot
        distributions are never needed)."""
        if self.all_greedy:
            return argmax(logits), None
        probs = self.probs(logits.unsqueeze(1)).squeeze(1)
        return self.sample(probs, step), probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logits).scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)


# Widths of the top slice of each row's scores that top-k and top-p look at first, widest last; a batch whose kept
# tokens may lie outside them sorts the whole vocabulary. A small torch.topk costs a small fraction of a sort of
# a large vocabulary, and the nucleus of a chat model's next token usually lies within it.
CANDIDATE_WIDTHS = (64, 1024)


def _top_k_top_p(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask scores outside each row's top-k and then its top-p nucleus with -inf, as transformers'
    ``TopKLogitsWarper`` and ``TopPLogitsWarper`` do (ties at the k-th score are kept; a nucleus that ends
    among tied scores keeps those of lowest index, where transformers' order of ties is its sort's
    accident). ``top_k`` and ``top_p`` are per row [B, 1, 1]."""
    vocab = scores.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    for width in CANDIDATE_WIDTHS:
        if width < vocab:
            kept = _filter_among_top(scores, k, top_p, width)
            if kept is not None:
                return kept
    return _filter_sorted(scores, k, top_p)


def _filter_among_top(scores: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, width: int) -> torch.Tensor | None:
    """``_top_k_top_p`` from each row's ``width`` highest scores, or None where a kept token may lie outside them
    (a top-k past the width, a nucleus needing more mass than the candidates hold) or where the width cuts
    through tied scores. A token outside them counts only through the mass it adds below the candidates in
    top-p's ascending sum."""
    vocab = scores.shape[-1]
    index = scores.topk(width, -1).indices.sort(-1, descending=True).values
    # Descending by score, tied scores by index: ``_filter_sorted``'s order, so that a nucleus cutting through
    # tied scores keeps the same ones whichever path a batch takes.
    values, order = scores.gather(-1, index).sort(dim=-1, stable=True)
    top, index = values.flip(-1), index.gather(-1, order).flip(-1)
    limited = k < vocab
    if bool((limited & (k > width)).any()) or bool(((scores >= top[..., -1:]).sum(-1) > width).any()):
        return None  # a top-k past the candidates, or scores tied with the lowest candidate left out of them
    kth = top.gather(-1, (k.clamp(max=width) - 1).expand(*top.shape[:-1], 1))
    in_top_k = torch.where(limited, top >= kth, True)
    weights = (top - top[..., :1]).exp() * in_top_k
    candidates = weights.sum(-1, keepdim=True)
    total = candidates
    if not bool(limited.all()):  # rows without a top-k: the whole vocabulary's mass
        total = torch.where(limited, candidates, (scores - top[..., :1]).exp().sum(-1, keepdim=True))
    outside = (total - candidates) / total  # mass of the tokens outside the candidates (0 with a top-k)
    unfiltered = ~limited & (top_p >= 1)
    if bool((~unfiltered & (outside > 1 - top_p)).any()):
        return None  # a token outside the candidates is in some row's nucleus
    ascending = outside + (weights / total).flip(-1).cumsum(-1).flip(-1)  # top-p's ascending sum at each token
    keep = in_top_k & (ascending > 1 - top_p)
    keep[..., 0] = True  # always keep the most likely token
    masked = torch.full_like(scores, float("-inf")).scatter_(-1, index, top.masked_fill(~keep, float("-inf")))
    return torch.where(unfiltered, scores, masked)


def _filter_sorted(scores: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``_top_k_top_p`` over the whole sorted vocabulary."""
    vocab = scores.shape[-1]
    # Ascending, tied scores in descending index order (unlike torch's default sort, in a fixed order), so
    # that the first of tied best scores, argmax's choice, is the last to go.
    ascending, flipped = scores.flip(-1).sort(dim=-1, stable=True)
    order = vocab - 1 - flipped
    kth_largest = ascending.gather(-1, (vocab - k).expand(*scores.shape[:-1], 1))
    ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    cumulative = ascending.softmax(-1).cumsum(-1)
    drop = cumulative <= 1 - top_p
    drop[..., -1] = False  # always keep the most likely token
    ascending = ascending.masked_fill(drop, float("-inf"))
    return ascending.scatter(-1, order, ascending)
