"""SamplingParams validation, BatchSampler warping against transformers' own warpers, and sampling."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec_trt import sampling
from specdec_trt.sampling import BatchSampler, SamplingParams, argmax, race, sample_from
from specdec_trt.seeded_noise import SeededNoise

VOCAB = 50
LARGEST_U = 1.0 - 2.0**-24  # the largest float32 below 1: the top of torch.rand's range


# --- SamplingParams ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": "5"}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_invalid_params_raise_naming_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b") as info:
        SamplingParams(**kwargs)
    others = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "seed", "stop"} - {name}
    assert not any(f"{other} must" in str(info.value) for other in others)


def test_several_invalid_params_are_all_reported() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(temperature=-1.0, top_k=-2)
    assert "temperature" in str(info.value) and "top_k" in str(info.value)


def test_stop_string_becomes_tuple() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")


def test_defaults_are_greedy() -> None:
    params = SamplingParams()
    assert params.greedy
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.0, 0, 1.0, 0.0)
    assert params.seed is None and params.stop == ()
    assert not SamplingParams(temperature=0.7).greedy


def test_boundary_values_are_valid() -> None:
    params = SamplingParams(max_new_tokens=1, top_p=1.0, top_k=0, min_p=0.0, seed=0, temperature=0.0)
    assert params.seed == 0 and params.greedy


# --- BatchSampler.probs against transformers ---------------------------------------------------------


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers for one row's positions: logits [T, V] -> probabilities [T, V]."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    input_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(float(params.temperature))(input_ids, logits)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(input_ids, scores)
    if params.min_p > 0:
        scores = MinPLogitsWarper(params.min_p)(input_ids, scores)
    return scores.softmax(-1)


def random_logits(batch: int, positions: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(batch, positions, VOCAB, generator=generator)


def assert_matches_reference(probs: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams]) -> None:
    for row, row_params in enumerate(params):
        expected = reference_probs(logits[row], row_params)
        torch.testing.assert_close(probs[row], expected, atol=1e-6, rtol=0, msg=lambda m, row=row: f"row {row}: {m}")


SAME_PARAMS_CASES = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 1.8": SamplingParams(temperature=1.8),
    "top_k 1": SamplingParams(temperature=1.0, top_k=1),
    "top_k 5": SamplingParams(temperature=0.9, top_k=5),
    "top_k > vocab": SamplingParams(temperature=1.0, top_k=VOCAB + 30),
    "top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "top_p 0.5": SamplingParams(temperature=1.3, top_p=0.5),
    "top_p tiny": SamplingParams(temperature=1.0, top_p=0.01),
    "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "min_p 0.4": SamplingParams(temperature=0.6, min_p=0.4),
    "all combined": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    "all combined, tight": SamplingParams(temperature=1.5, top_k=8, top_p=0.6, min_p=0.2),
}


@pytest.mark.parametrize("params", list(SAME_PARAMS_CASES.values()), ids=list(SAME_PARAMS_CASES))
def test_probs_match_transformers_warpers(params: SamplingParams) -> None:
    batch = 4
    logits = random_logits(batch, 3, seed=11)
    probs = BatchSampler([params] * batch).probs(logits)
    assert probs.shape == logits.shape
    assert_matches_reference(probs, logits, [params] * batch)


LARGE_VOCAB = 3000  # past every candidate width but the whole vocabulary


def test_filters_over_a_large_vocabulary_match_transformers_from_the_top_candidates_or_the_whole_sort(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Top-k and top-p over 3,000 tokens, flat and peaked, as transformers' warpers give them (a nucleus ending
    among tied scores keeps as many, of lowest index): most batches from the top 64 or 1,024 scores, the
    others (a wide nucleus, a large k, a tie at the k-th score) from the whole sort; each path is taken."""
    sorted_batches = []
    whole_sort = sampling._filter_sorted
    monkeypatch.setattr(sampling, "_filter_sorted", lambda *a: sorted_batches.append(1) or whole_sort(*a))
    cases = [
        (SamplingParams(temperature=t, top_k=k, top_p=p), scale)
        for t, k, p, scale in itertools.product((0.5, 1.0), (0, 5, 64, 500), (1.0, 0.9, 0.3), (0.5, 8.0))
        if k or p < 1
    ]
    batches = 0
    for index, (params, scale) in enumerate(cases):
        generator = torch.Generator().manual_seed(index)
        logits = scale * torch.randn(2, 3, LARGE_VOCAB, generator=generator)
        logits[1, 0, :70] = logits[1, 0].max() + 1.0  # 70 tied best scores: a top-k below 70 keeps them all
        probs = BatchSampler([params] * 2).probs(logits)
        reference = torch.stack([reference_probs(logits[row], params) for row in range(2)])
        torch.testing.assert_close(probs[0], reference[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(probs[1, 1:], reference[1, 1:], atol=1e-6, rtol=0)
        # Among the ties a nucleus keeps as many as transformers does, those of lowest index.
        kept = probs[1, 0, :70] > 0
        assert int(kept.sum()) == int((reference[1, 0, :70] > 0).sum())
        assert bool(kept[: int(kept.sum())].all())
        batches += 1
    assert 0 < len(sorted_batches) < batches / 2, (len(sorted_batches), batches)


def test_top_k_keeps_ties_like_transformers() -> None:
    batch, top_k = 4, 7
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 3, (batch, 3, VOCAB), generator=generator).float()
    params = [SamplingParams(temperature=1.0, top_k=top_k)] * batch
    probs = BatchSampler(params).probs(logits)
    assert_matches_reference(probs, logits, params)
    kept = (probs > 0).sum(-1)
    assert (kept > top_k).any(), "the logits were meant to have ties at the k-th score"


def test_mixed_batch_each_row_matches_its_own_reference() -> None:
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3),  # greedy: filters are ignored
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.5, min_p=0.1),
        SamplingParams(temperature=0.9, top_k=12, top_p=0.85, min_p=0.02, seed=4),
        SamplingParams(temperature=1.0, top_k=VOCAB + 1),
    ]
    logits = random_logits(len(params), 4, seed=5)
    original = logits.clone()
    probs = BatchSampler(params).probs(logits)
    assert torch.equal(logits, original), "warping works in place on its own copies, never on the logits"
    assert_matches_reference(probs, logits, params)
    for row in (0, 3):
        one_hot = torch.nn.functional.one_hot(logits[row].argmax(-1), VOCAB).float()
        assert torch.equal(probs[row], one_hot)


def test_all_greedy_batch_is_exactly_one_hot_on_argmax() -> None:
    logits = random_logits(3, 5, seed=8)
    probs = BatchSampler([SamplingParams()] * 3).probs(logits)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


EXTREME_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.05),
    SamplingParams(temperature=2.0, top_k=3),
    SamplingParams(temperature=0.5, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.5, min_p=0.1),
]


def extreme_logits(scale: float) -> torch.Tensor:
    """Rows with huge spreads, -inf entries and a single finite entry, one copy per parameter set."""
    generator = torch.Generator().manual_seed(2)
    huge = scale * torch.randn(VOCAB, generator=generator)
    with_minus_inf = huge.clone()
    with_minus_inf[::3] = float("-inf")
    single_finite = torch.full((VOCAB,), float("-inf"))
    single_finite[17] = 0.0
    mostly_tied = torch.zeros(VOCAB)
    mostly_tied[5] = float("-inf")
    rows = torch.stack([huge, with_minus_inf, single_finite, mostly_tied])
    return rows.expand(len(EXTREME_PARAMS), -1, -1).clone()


def assert_valid_distributions(probs: torch.Tensor, logits: torch.Tensor) -> None:
    assert not probs.isnan().any()
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5, rtol=0)
    assert (probs[logits == float("-inf")] == 0).all()
    rows = probs.reshape(-1, probs.shape[-1])
    best = logits.reshape(-1, logits.shape[-1]).argmax(-1)
    assert (rows.gather(-1, best[:, None]) > 0).all(), "the most likely token must keep its mass"


@pytest.mark.parametrize("scale", [1e4, 1e30])
def test_probs_are_valid_for_extreme_logits(scale: float) -> None:
    logits = extreme_logits(scale)
    assert_valid_distributions(BatchSampler(EXTREME_PARAMS).probs(logits), logits)


def test_probs_are_valid_for_logits_near_float32_max() -> None:
    logits = extreme_logits(1e38)
    assert_valid_distributions(BatchSampler(EXTREME_PARAMS).probs(logits), logits)


# --- sample_from --------------------------------------------------------------------------------------


DISTRIBUTIONS = {
    "dense": [0.05, 0.2, 0.1, 0.3, 0.15, 0.02, 0.08, 0.1],
    "zeros at start": [0.0, 0.0, 0.25, 0.25, 0.1, 0.4],
    "zeros in middle": [0.3, 0.0, 0.0, 0.2, 0.0, 0.5],
    "zeros at end": [0.4, 0.1, 0.5, 0.0, 0.0],
    "zeros everywhere": [0.0, 0.6, 0.0, 0.0, 0.4, 0.0],
    "unnormalised": [3.0, 0.5, 0.0, 7.25, 1.0],
    "tiny mass": [2e-6, 0.0, 1e-6, 3e-6],
}


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of integer samples against the (possibly unnormalised) distribution ``probs``;
    fails outright if any sample has zero probability."""
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled zero-probability tokens: {counts[~support]}"
    expected = probs.double()[support] / probs.double()[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("values", list(DISTRIBUTIONS.values()), ids=list(DISTRIBUTIONS))
def test_sample_from_matches_distribution(values: list[float]) -> None:
    probs = torch.tensor(values)
    draws = 100_000
    u = torch.rand(draws, generator=torch.Generator().manual_seed(0))
    ids = sample_from(probs.expand(draws, -1), u)
    assert ids.shape == (draws,) and ids.dtype == torch.int64
    assert chi_square_pvalue(ids, probs) > 1e-3


@pytest.mark.parametrize("values", list(DISTRIBUTIONS.values()), ids=list(DISTRIBUTIONS))
def test_sample_from_never_picks_zero_probability_tokens_at_the_ends_of_u(values: list[float]) -> None:
    probs = torch.tensor(values)
    support = (probs > 0).nonzero().flatten()
    u = torch.tensor([0.0, 1e-30, 0.5, LARGEST_U])
    ids = sample_from(probs.expand(len(u), -1), u)
    assert probs[ids].gt(0).all()
    assert ids[0] == support[0] and ids[-1] == support[-1]


def test_sample_from_zero_probability_boundaries_between_tokens() -> None:
    """u exactly on a cumulative boundary lands on the next token with mass, never on a zero."""
    probs = torch.tensor([0.25, 0.0, 0.25, 0.0, 0.0, 0.5])
    ids = sample_from(probs.expand(3, -1), torch.tensor([0.25, 0.5, 0.75]))
    assert ids.tolist() == [2, 5, 5]


def test_sample_from_handles_leading_dimensions_and_per_row_distributions() -> None:
    generator = torch.Generator().manual_seed(1)
    probs = torch.rand(2, 3, 10, generator=generator)
    probs[probs < 0.5] = 0.0
    probs[..., 4] = 0.3  # every row keeps some mass
    u = torch.rand(2, 3, generator=generator)
    ids = sample_from(probs, u)
    assert ids.shape == (2, 3)
    for index in torch.cartesian_prod(torch.arange(2), torch.arange(3)).tolist():
        row = probs[tuple(index)]
        assert ids[tuple(index)] == sample_from(row, u[tuple(index)])
        assert row[ids[tuple(index)]] > 0


# --- seeded noise and BatchSampler.sample ---------------------------------------------------------


def test_seeded_noise_is_a_function_of_seed_and_position_alone() -> None:
    """Whatever positions were asked for before, and in whatever blocks, a position's noise is the same."""
    in_order = SeededNoise(7, "cpu").exponentials(0, 6, VOCAB)
    late = SeededNoise(7, "cpu")
    late.exponentials(4, 2, VOCAB)
    late.forget_before(4)
    assert torch.equal(late.exponentials(3, 3, VOCAB), in_order[3:])
    assert torch.equal(SeededNoise(7, "cpu").exponentials(5, 1, VOCAB)[0], in_order[5])
    assert not torch.equal(in_order[0], in_order[1]), "each position draws its own noise"
    assert not torch.equal(SeededNoise(8, "cpu").exponentials(0, 1, VOCAB)[0], in_order[0])
    assert (in_order > 0).all()


def test_the_race_samples_the_distribution_over_seeds() -> None:
    """argmax(p / E) with Exp(1) noise is an exact sample of p: chi-square over 20,000 seeds, unnormalised
    p with zeros included; the negative control, multiplying by the noise instead of dividing, is rejected."""
    probs = random_logits(1, 1, seed=13, scale=1.5)[0, 0].softmax(-1)
    probs[:3] = 0.0
    unnormalised = 3.0 * probs
    noise = torch.stack([SeededNoise(seed, "cpu").exponentials(0, 1, VOCAB)[0] for seed in range(20_000)])
    tokens = race(unnormalised.expand(len(noise), -1), noise)
    assert int((tokens < 3).sum()) == 0
    assert chi_square_pvalue(tokens, probs) > 1e-3
    assert chi_square_pvalue(race(unnormalised.expand(len(noise), -1), 1 / noise), probs) < 1e-6


def flat_probs(batch: int, seed: int) -> torch.Tensor:
    logits = random_logits(batch, 1, seed=seed, scale=0.3)[:, 0]
    return logits.softmax(-1)


def draw(sampler: BatchSampler, probs: torch.Tensor, steps: int) -> torch.Tensor:
    return torch.stack([sampler.sample(probs, step) for step in range(steps)], dim=1)


def test_same_seed_gives_same_tokens_across_samplers() -> None:
    params = [SamplingParams(temperature=1.0, seed=123), SamplingParams(temperature=0.8, top_k=20, seed=7)]
    probs = flat_probs(2, seed=0)
    first = draw(BatchSampler(params), probs, 40)
    torch.rand(100)  # the global generator's state must not matter
    second = draw(BatchSampler(params), probs, 40)
    assert torch.equal(first, second)
    assert first[0].unique().numel() > 10, "the draws were meant to vary from step to step"


def test_seeded_row_does_not_depend_on_other_rows() -> None:
    request = SamplingParams(temperature=1.0, seed=42)
    others = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.5), SamplingParams()]
    logits = random_logits(4, 1, seed=3, scale=0.3)
    solo = BatchSampler([request])
    alone = draw(solo, solo.probs(logits[1:2])[:, 0], 40)[0]
    batch = BatchSampler([others[0], request, others[1], others[2]])
    together = draw(batch, batch.probs(logits)[:, 0], 40)
    assert torch.equal(together[1], alone)
    assert alone.unique().numel() > 10, "the draws were meant to vary from step to step"
    assert torch.equal(together[3], logits[3, 0].argmax().expand(40)), "the greedy row samples its argmax"


def test_a_seeded_row_samples_by_its_position_not_by_what_it_drew_before() -> None:
    """Drawing at position 5 directly, or after drawing positions 0 to 4, gives the same token."""
    params = [SamplingParams(temperature=1.0, seed=3)] * 2
    probs = flat_probs(2, seed=5)
    walked = draw(BatchSampler(params), probs, 6)[:, 5]
    assert torch.equal(BatchSampler(params, positions=[5, 5]).sample(probs), walked)
    assert torch.equal(
        BatchSampler(params, positions=[2, 4]).sample(probs, step=1),
        draw(BatchSampler(params), probs, 6)[[0, 1], [3, 5]],
    )


def test_different_seeds_give_different_tokens() -> None:
    probs = flat_probs(1, seed=6)
    first = draw(BatchSampler([SamplingParams(temperature=1.0, seed=1)]), probs, 60)
    second = draw(BatchSampler([SamplingParams(temperature=1.0, seed=2)]), probs, 60)
    assert (first != second).float().mean() > 0.5


@pytest.mark.parametrize("temperature", [1e-300, 2.0**-150])
def test_a_temperature_float32_rounds_to_zero_is_greedy(temperature: float) -> None:
    """The sampler computes in float32: a temperature that rounds to 0 there must be greedy everywhere, not
    divided by 0 nor sampled at another temperature, whatever the seed and the rows beside it."""
    assert SamplingParams(temperature=temperature).greedy and not SamplingParams(temperature=2.0**-149).greedy
    logits = random_logits(4, 1, seed=12)[:, 0]
    for seed in range(8):
        rows = [SamplingParams(temperature=temperature, seed=seed), SamplingParams(temperature=1.0, seed=seed)] * 2
        tokens, probs = BatchSampler(rows).draw(logits)
        assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))
        assert torch.equal(probs[0::2], torch.nn.functional.one_hot(logits[0::2].argmax(-1), VOCAB).float())


def test_all_greedy_sample_is_argmax() -> None:
    probs = flat_probs(5, seed=9)
    sampler = BatchSampler([SamplingParams(seed=3)] * 5)
    assert torch.equal(sampler.sample(probs), probs.argmax(-1))


def test_argmax_is_torchs_including_the_first_of_ties() -> None:
    scores = random_logits(4, 3, seed=10)
    scores[0, 0, 2] = scores[0, 0, 5] = scores[0, 0].max() + 1.0  # a tie: the first index wins, as in torch
    scores[1, 1] = float("-inf")
    scores[1, 1, 3] = 0.0
    assert argmax(scores)[0, 0] == 2
    assert argmax(scores).dtype == torch.int64
    assert torch.equal(argmax(scores), scores.argmax(-1))
    assert torch.equal(argmax(scores[:, 1]), scores[:, 1].argmax(-1))  # a strided view


def test_draw_is_the_argmax_without_distributions_for_greedy_batches_else_a_sample_from_probs() -> None:
    logits = random_logits(3, 1, seed=11)[:, 0]
    token, probs = BatchSampler([SamplingParams()] * 3).draw(logits)
    assert probs is None and torch.equal(token, logits.argmax(-1))
    sampled = BatchSampler([SamplingParams(temperature=0.7, seed=s) for s in range(3)])
    token, probs = sampled.draw(logits)
    assert torch.equal(probs, sampled.probs(logits.unsqueeze(1)).squeeze(1))
    assert (probs.gather(1, token.unsqueeze(1)) > 0).all()


def test_batch_sample_matches_distribution() -> None:
    rows = 100_000
    params = SamplingParams(temperature=1.0, top_k=6)
    logits = random_logits(1, 1, seed=4)[:, 0].expand(rows, -1)
    sampler = BatchSampler([params] * rows)
    probs = sampler.probs(logits[:, None])[:, 0]
    torch.manual_seed(0)  # unseeded rows share the global generator
    tokens = sampler.sample(probs)
    assert chi_square_pvalue(tokens, probs[0]) > 1e-3
    assert int((probs[0] > 0).sum()) == 6
