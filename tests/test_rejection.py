"""The rejection sampler alone, on hand-built tensors (CPU): greedy rows, exact acceptance rates and
output distributions (Leviathan et al. 2023), the q = 0 guard, g = 0, seeds and the output contract."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from specdec_trt import rejection
from specdec_trt.rejection import coupled_verify, greedy_verify, recovery_distribution, rejection_sample
from specdec_trt.sampling import race, sample_from

VOCAB = 8
# A target p and a draft q that disagree a lot, with p > 0 = q and q > 0 = p both present.
P = torch.tensor([0.30, 0.05, 0.20, 0.00, 0.15, 0.10, 0.20, 0.00])
Q = torch.tensor([0.05, 0.30, 0.00, 0.25, 0.15, 0.05, 0.10, 0.10])


def one_hot(ids: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, vocab).float()


def random_dists(*shape: int, generator: torch.Generator, sharpness: float = 2.0) -> torch.Tensor:
    return (sharpness * torch.randn(*shape, generator=generator)).softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per distribution of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of token samples against ``probs`` [V] (need not be normalised); fails outright
    if any sample is outside the vocabulary or has zero probability."""
    assert ((samples >= 0) & (samples < probs.numel())).all()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled zero-probability tokens: {counts[~support]}"
    expected = probs.double()[support] / probs.double()[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def binomial_pvalue(successes: torch.Tensor, probability: float) -> float:
    return float(stats.binomtest(int(successes.sum()), successes.numel(), probability).pvalue)


def assert_output_contract(
    output: torch.Tensor, num_accepted: torch.Tensor, drafts: torch.Tensor, vocab: int = VOCAB
) -> None:
    batch, gamma = drafts.shape
    assert output.dtype == torch.int64 and output.shape == (batch, gamma + 1)
    assert num_accepted.shape == (batch,) and not num_accepted.is_floating_point()
    assert ((num_accepted >= 0) & (num_accepted <= gamma)).all()
    positions = torch.arange(gamma + 1)
    accepted = positions < num_accepted[:, None]
    emitted = positions == num_accepted[:, None]
    assert torch.equal(output[:, :gamma][accepted[:, :gamma]], drafts[accepted[:, :gamma]])
    final = output[emitted]
    assert ((final >= 0) & (final < vocab)).all()
    assert (output[positions > num_accepted[:, None]] == -1).all()


# --- greedy rows -----------------------------------------------------------------------------------


def greedy_batch(batch: int, gamma: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target argmax ids [B, g+1] and one-hot target probabilities [B, g+1, V]."""
    argmax = torch.randint(VOCAB, (batch, gamma + 1), generator=torch.Generator().manual_seed(seed))
    return argmax, one_hot(argmax)


@pytest.mark.parametrize("draft_kind", ["none", "one-hot", "soft"])
def test_greedy_matching_drafts_are_all_accepted_with_argmax_bonus(draft_kind: str) -> None:
    batch, gamma = 6, 4
    argmax, target = greedy_batch(batch, gamma, seed=0)
    drafts = argmax[:, :gamma]
    generator = torch.Generator().manual_seed(1)
    draft_probs = {
        "none": None,
        "one-hot": one_hot(drafts),
        "soft": 0.5 * one_hot(drafts) + 0.5 * random_dists(batch, gamma, VOCAB, generator=generator),
    }[draft_kind]
    for seed in range(5):
        output, num_accepted = rejection_sample(drafts, draft_probs, target, torch.Generator().manual_seed(seed))
        assert torch.equal(num_accepted, torch.full((batch,), gamma))
        assert torch.equal(output, argmax)


@pytest.mark.parametrize("gamma", [0, 1, 4])
def test_greedy_verify_equals_rejection_sampling_of_one_hot_distributions(gamma: int) -> None:
    """The all-greedy shortcut gives what the general sampler gives on the one-hot distributions greedy rows
    become, row for row: drafts that match the target's argmax for a random number of positions, then not."""
    batch = 200
    generator = torch.Generator().manual_seed(30 + gamma)
    logits = torch.randn(batch, gamma + 1, VOCAB, generator=generator)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :gamma].clone()
    first_miss = torch.randint(gamma + 1, (batch,), generator=generator)  # gamma: every draft matches
    for row, miss in enumerate(first_miss.tolist()):
        if miss < gamma:
            drafts[row, miss] = (argmax[row, miss] + 1 + torch.randint(VOCAB - 1, (), generator=generator)) % VOCAB
            drafts[row, miss + 1 :] = torch.randint(VOCAB, (gamma - miss - 1,), generator=generator)
    output, num_accepted = greedy_verify(drafts, logits)
    expected_output, expected_accepted = rejection_sample(drafts, None, one_hot(argmax), torch.Generator())
    assert torch.equal(num_accepted, first_miss)
    assert torch.equal(num_accepted, expected_accepted)
    assert torch.equal(output, expected_output)
    assert_output_contract(output, num_accepted, drafts)


@pytest.mark.parametrize("draft_kind", ["none", "soft"])
def test_greedy_first_mismatch_is_replaced_by_target_argmax(draft_kind: str) -> None:
    gamma = 5
    batch = gamma + 1  # row i mismatches first at position i; the last row matches everywhere
    argmax, target = greedy_batch(batch, gamma, seed=2)
    drafts = argmax[:, :gamma].clone()
    for row in range(gamma):
        drafts[row, row] = (argmax[row, row] + 1) % VOCAB
        rest = torch.randint(VOCAB, (gamma - row - 1,), generator=torch.Generator().manual_seed(row))
        drafts[row, row + 1 :] = rest
    generator = torch.Generator().manual_seed(3)
    draft_probs = None if draft_kind == "none" else random_dists(batch, gamma, VOCAB, generator=generator)
    for seed in range(5):
        output, num_accepted = rejection_sample(drafts, draft_probs, target, torch.Generator().manual_seed(seed))
        assert num_accepted.tolist() == list(range(gamma)) + [gamma]
        for row in range(batch):
            assert torch.equal(output[row, : row + 1], argmax[row, : row + 1])
            assert (output[row, row + 1 :] == -1).all()


def test_mixed_greedy_and_sampled_rows_in_one_batch() -> None:
    """Greedy rows stay exact while sampled rows in the same call keep the target's distribution."""
    copies, gamma = 25_000, 2
    generator = torch.Generator().manual_seed(4)
    sampled_target = torch.cat([P[None], random_dists(2, VOCAB, generator=generator)])
    greedy_argmax = torch.tensor([2, 6, 1])
    dense_q = random_dists(gamma, VOCAB, generator=generator, sharpness=1.0)  # q > 0 for every token
    kinds = [
        # (target [g+1, V], draft q [g, V], drafted tokens or None to sample them from q)
        (one_hot(greedy_argmax), one_hot(greedy_argmax[:gamma]), greedy_argmax[:gamma]),  # greedy, all match
        (one_hot(greedy_argmax), dense_q, torch.tensor([2, 5])),  # greedy, mismatch at 1
        (sampled_target, torch.stack([Q, Q]), None),  # sampled
        (one_hot(greedy_argmax), dense_q, torch.tensor([3, 6])),  # greedy, mismatch at 0
    ]
    target = torch.cat([t.expand(copies, -1, -1) for t, _, _ in kinds]).contiguous()
    draft_probs = torch.cat([q.expand(copies, -1, -1) for _, q, _ in kinds]).contiguous()
    drafts = draw(draft_probs, generator)
    for kind, (_, _, fixed) in enumerate(kinds):
        if fixed is not None:
            drafts[kind * copies : (kind + 1) * copies] = fixed
    # interleave the kinds so every kind sits next to every other
    order = torch.randperm(len(drafts), generator=generator)
    output, num_accepted = rejection_sample(drafts[order], draft_probs[order], target[order], generator)
    kind_of = order // copies
    assert_output_contract(output, num_accepted, drafts[order])

    assert torch.equal(output[kind_of == 0], greedy_argmax.expand(copies, -1))
    assert (num_accepted[kind_of == 1] == 1).all()
    assert torch.equal(output[kind_of == 1], torch.tensor([2, 6, -1]).expand(copies, -1))
    assert (num_accepted[kind_of == 3] == 0).all()
    assert (output[kind_of == 3, 0] == greedy_argmax[0]).all() and (output[kind_of == 3, 1:] == -1).all()
    sampled = kind_of == 2
    assert chi_square_pvalue(output[sampled, 0], P) > 1e-3
    assert binomial_pvalue(num_accepted[sampled] >= 1, float(torch.minimum(P, Q).sum())) > 1e-3


# --- all accepted / none accepted ---------------------------------------------------------------------


def test_all_accepted_when_p_equals_q_and_bonus_is_drawn_from_last_target_position() -> None:
    rows, gamma = 50_000, 3
    generator = torch.Generator().manual_seed(5)
    q = random_dists(gamma, VOCAB, generator=generator).expand(rows, -1, -1)
    bonus = torch.tensor([0.0, 0.1, 0.4, 0.0, 0.2, 0.05, 0.25, 0.0])
    target = torch.cat([q, bonus.expand(rows, 1, -1)], dim=1)
    drafts = draw(q, generator)
    output, num_accepted = rejection_sample(drafts, q, target, generator)
    assert (num_accepted == gamma).all()
    assert torch.equal(output[:, :gamma], drafts)
    assert chi_square_pvalue(output[:, gamma], bonus) > 1e-3


def test_all_accepted_for_deterministic_drafts_with_target_probability_one() -> None:
    rows, gamma = 20_000, 2
    drafts = torch.tensor([4, 1]).expand(rows, -1)
    bonus = torch.tensor([0.1, 0.0, 0.3, 0.3, 0.0, 0.1, 0.2, 0.0])
    target = torch.cat([one_hot(drafts[0]), bonus[None]]).expand(rows, -1, -1)
    output, num_accepted = rejection_sample(drafts, None, target, torch.Generator().manual_seed(6))
    assert (num_accepted == gamma).all()
    assert chi_square_pvalue(output[:, gamma], bonus) > 1e-3


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_none_accepted_when_draft_token_has_zero_target_probability(with_draft_probs: bool) -> None:
    rows, gamma, drafted = 40_000, 3, 3  # P[3] == 0
    drafts = torch.full((rows, gamma), drafted)
    target = P.expand(rows, gamma + 1, -1)
    draft_probs = Q.expand(rows, gamma, -1) if with_draft_probs else None
    output, num_accepted = rejection_sample(drafts, draft_probs, target, torch.Generator().manual_seed(7))
    assert (num_accepted == 0).all()
    assert (output[:, 0] != drafted).all()
    assert (output[:, 1:] == -1).all()
    replacement = (P - Q).clamp(min=0) if with_draft_probs else P
    assert chi_square_pvalue(output[:, 0], replacement) > 1e-3


# --- deterministic drafts (draft_probs=None) ----------------------------------------------------------


def test_deterministic_drafts_accept_with_probability_p_and_replace_from_p_without_x() -> None:
    rows = 100_000
    drafts = torch.tensor([0, 2]).expand(rows, -1)  # P[0] = 0.3; then P2[2]
    p2 = torch.tensor([0.1, 0.1, 0.55, 0.05, 0.05, 0.05, 0.1, 0.0])
    target = torch.stack([P, p2, P]).expand(rows, -1, -1)
    output, num_accepted = rejection_sample(drafts, None, target, torch.Generator().manual_seed(8))
    assert_output_contract(output, num_accepted, drafts)

    assert binomial_pvalue(num_accepted >= 1, float(P[0])) > 1e-3
    first_accepted = num_accepted >= 1
    assert binomial_pvalue(num_accepted[first_accepted] == 2, float(p2[2])) > 1e-3

    rejected_first = num_accepted == 0
    assert (output[rejected_first, 0] != 0).all()
    without_x = P.clone()
    without_x[0] = 0
    assert chi_square_pvalue(output[rejected_first, 0], without_x) > 1e-3
    rejected_second = num_accepted == 1
    p2_without_x = p2.clone()
    p2_without_x[2] = 0
    assert chi_square_pvalue(output[rejected_second, 1], p2_without_x) > 1e-3
    # the emitted token is distributed as the target's at both positions
    assert chi_square_pvalue(output[:, 0], P) > 1e-3
    assert chi_square_pvalue(output[first_accepted, 1], p2) > 1e-3


def test_deterministic_drafts_per_row_acceptance_in_one_batched_call() -> None:
    """Different rows, different p(x): each row type accepts at its own rate p(x)."""
    copies = 20_000
    drafts = torch.arange(VOCAB).repeat_interleave(copies)[:, None]
    target = P.expand(len(drafts), 2, -1)
    output, num_accepted = rejection_sample(drafts, None, target, torch.Generator().manual_seed(9))
    for token in range(VOCAB):
        accepted = num_accepted[token * copies : (token + 1) * copies] == 1
        if P[token] == 0:
            assert not accepted.any()
        else:
            assert binomial_pvalue(accepted, float(P[token])) > 1e-3


# --- sampled drafts: acceptance rate and losslessness ---------------------------------------------------


def run_single_position(p: torch.Tensor, q: torch.Tensor, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft per row sampled from q, verified against p; the bonus distribution is uniform."""
    generator = torch.Generator().manual_seed(seed)
    draft_probs = q.expand(rows, 1, -1)
    drafts = draw(draft_probs, generator)
    bonus = torch.full_like(p, 1 / p.numel())
    target = torch.stack([p, bonus]).expand(rows, -1, -1)
    return rejection_sample(drafts, draft_probs, target, generator)


def peaked_pair(seed: int, vocab: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    p, q = random_dists(2, vocab, generator=generator, sharpness=1.5)
    return p, q


PAIRS = {"hand-built": (P, Q), "random V=16": peaked_pair(10), "q swapped with p": (Q, P)}


@pytest.mark.parametrize(("p", "q"), list(PAIRS.values()), ids=list(PAIRS))
def test_sampled_drafts_acceptance_rate_and_output_distribution(p: torch.Tensor, q: torch.Tensor) -> None:
    rows = 200_000
    output, num_accepted = run_single_position(p, q, rows, seed=11)
    assert binomial_pvalue(num_accepted == 1, float(torch.minimum(p, q).sum())) > 1e-3
    assert chi_square_pvalue(output[:, 0], p) > 1e-3


def test_negative_control_residual_without_subtracting_q_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    def target_only(
        num_accepted: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        num_drafts: torch.Tensor,
    ) -> torch.Tensor:
        return target_probs[torch.arange(len(num_accepted)), num_accepted]

    monkeypatch.setattr(rejection, "recovery_distribution", target_only)
    output, num_accepted = run_single_position(P, Q, 200_000, seed=11)
    assert binomial_pvalue(num_accepted == 1, float(torch.minimum(P, Q).sum())) > 1e-3  # the accept test is intact
    assert chi_square_pvalue(output[:, 0], P) < 1e-6


def test_sampled_drafts_two_positions_are_lossless() -> None:
    """Given the first draft was accepted, the second emitted token is distributed as the target's second
    distribution, and the bonus after two accepted drafts as the third."""
    rows = 200_000
    generator = torch.Generator().manual_seed(12)
    p, q = peaked_pair(13)
    p1, q1 = peaked_pair(14)
    p2 = peaked_pair(15)[0]
    draft_probs = torch.stack([q, q1]).expand(rows, -1, -1)
    target = torch.stack([p, p1, p2]).expand(rows, -1, -1)
    drafts = draw(draft_probs, generator)
    output, num_accepted = rejection_sample(drafts, draft_probs, target, generator)
    assert_output_contract(output, num_accepted, drafts, vocab=16)
    assert chi_square_pvalue(output[:, 0], p) > 1e-3
    assert chi_square_pvalue(output[num_accepted >= 1, 1], p1) > 1e-3
    assert chi_square_pvalue(output[num_accepted == 2, 2], p2) > 1e-3
    alpha0, alpha1 = float(torch.minimum(p, q).sum()), float(torch.minimum(p1, q1).sum())
    assert binomial_pvalue(num_accepted >= 1, alpha0) > 1e-3
    assert binomial_pvalue(num_accepted[num_accepted >= 1] == 2, alpha1) > 1e-3


# --- guards: q(x) = 0 and an empty residual ---------------------------------------------------------


def test_zero_draft_probability_for_drafted_token_is_guarded() -> None:
    rows = 2_000
    # Three row types, each drafting a token its q gives zero probability:
    # token 2 under Q: p > 0 = q, accepted (p/q is infinite);
    # token 3 under q_without_3: p = q = 0, rejected and replaced from max(0, p - q);
    # token 0 under an all-zero q: p > 0, accepted.
    q_without_3 = Q.clone()
    q_without_3[1] += q_without_3[3]
    q_without_3[3] = 0.0
    drafts = torch.tensor([2, 3, 0]).repeat(rows)[:, None]
    draft_probs = torch.stack([Q, q_without_3, torch.zeros(VOCAB)]).repeat(rows, 1)[:, None]
    target = P.expand(len(drafts), 2, -1)
    output, num_accepted = rejection_sample(drafts, draft_probs, target, torch.Generator().manual_seed(17))
    assert_output_contract(output, num_accepted, drafts)
    assert (num_accepted[0::3] == 1).all()
    assert (num_accepted[1::3] == 0).all()
    assert (num_accepted[2::3] == 1).all()
    replacements = output[1::3, 0]
    assert (P[replacements] > q_without_3[replacements]).all(), "the replacement comes from max(0, p - q)"
    assert chi_square_pvalue(replacements, (P - q_without_3).clamp(min=0)) > 1e-3


def test_residual_of_identical_p_and_q_is_finite_and_falls_back_to_p() -> None:
    rows, gamma = 1_000, 2
    generator = torch.Generator().manual_seed(18)
    q = random_dists(rows, gamma, VOCAB, generator=generator)
    target = torch.cat([q, random_dists(rows, 1, VOCAB, generator=generator)], dim=1)
    drafts = draw(q, generator)
    output, num_accepted = rejection_sample(drafts, q, target, generator)
    assert_output_contract(output, num_accepted, drafts)
    assert (num_accepted == gamma).all()

    # force the rejection branch that p == q makes (almost) impossible
    for position in range(gamma):
        forced = torch.full((rows,), position)
        recovery = recovery_distribution(forced, drafts, q, target, torch.full((rows,), gamma))
        assert torch.isfinite(recovery).all() and (recovery.sum(-1) > 0).all()
        torch.testing.assert_close(recovery, target[:, position])
        tokens = sample_from(recovery, torch.rand(rows, generator=generator))
        assert (target[torch.arange(rows), position, tokens] > 0).all()


def test_recovery_distribution_is_residual_at_rejection_and_target_after_full_acceptance() -> None:
    drafts = torch.tensor([[1, 3], [1, 3], [1, 3]])
    draft_probs = torch.stack([Q, P]).expand(3, -1, -1)
    bonus = torch.full((VOCAB,), 1 / VOCAB)
    target = torch.stack([P, Q, bonus]).expand(3, -1, -1)
    drafted = torch.tensor([2, 2, 2])
    recovery = recovery_distribution(torch.tensor([0, 1, 2]), drafts, draft_probs, target, drafted)
    torch.testing.assert_close(recovery[0], (P - Q).clamp(min=0))
    torch.testing.assert_close(recovery[1], (Q - P).clamp(min=0))
    torch.testing.assert_close(recovery[2], bonus)
    deterministic = recovery_distribution(torch.tensor([0, 1, 2]), drafts, None, target, drafted)
    expected = torch.stack([P, Q, bonus])
    expected[0, 1] = 0.0
    expected[1, 3] = 0.0
    torch.testing.assert_close(deterministic, expected)
    # A row that drafted fewer than the batch's widest: after its own drafts were all accepted, the bonus is
    # the target's distribution at its own next position, not a residual against the padding there.
    short = recovery_distribution(torch.tensor([1, 0]), drafts[:2], draft_probs[:2], target[:2], torch.tensor([1, 0]))
    torch.testing.assert_close(short, torch.stack([Q, P]))


def test_each_row_verifies_only_its_own_drafts() -> None:
    """Rows with per-row ``num_drafts``: padding is never accepted, and each row's output is what it gives alone
    at its own draft length (greedy exactly; sampled with deterministic drafts, the same accepted prefix)."""
    gamma, rows = 4, 2_000
    drafts, _, target = sampled_batch(rows, gamma, seed=26, deterministic=True)
    num_drafts = torch.arange(rows) % (gamma + 1)
    logits = target.log()
    output, num_accepted = greedy_verify(drafts, logits, num_drafts)
    assert (num_accepted <= num_drafts).all() and (num_accepted == num_drafts).any()
    for k in range(gamma + 1):
        row = torch.nonzero(num_drafts == k)[:, 0]
        alone, alone_accepted = greedy_verify(drafts[row, :k], logits[row, : k + 1])
        assert torch.equal(num_accepted[row], alone_accepted)
        assert torch.equal(output[row, : k + 1], alone) and (output[row, k + 1 :] == -1).all()
    sampled, sampled_accepted = rejection_sample(drafts, None, target, torch.Generator().manual_seed(27), num_drafts)
    assert (sampled_accepted <= num_drafts).all()
    assert (torch.bincount(sampled_accepted[num_drafts == gamma], minlength=gamma + 1) > 0).all()
    for k in range(gamma + 1):
        row = torch.nonzero(num_drafts == k)[:, 0]
        assert_output_contract(sampled[row, : k + 1], sampled_accepted[row], drafts[row, :k])
        assert (sampled[row, k + 1 :] == -1).all()


# --- g = 0 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_no_drafts_samples_from_first_target_position(with_draft_probs: bool) -> None:
    rows = 50_000
    drafts = torch.empty(rows, 0, dtype=torch.int64)
    draft_probs = torch.empty(rows, 0, VOCAB) if with_draft_probs else None
    target = P.expand(rows, 1, -1)
    output, num_accepted = rejection_sample(drafts, draft_probs, target, torch.Generator().manual_seed(19))
    assert output.shape == (rows, 1) and output.dtype == torch.int64
    assert (num_accepted == 0).all()
    assert chi_square_pvalue(output[:, 0], P) > 1e-3


# --- seeds -------------------------------------------------------------------------------------------


def sampled_batch(
    batch: int, gamma: int, seed: int, deterministic: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafts sampled from random q [B, g, V] and a target that agrees with them often enough for every
    number of accepted drafts to occur: p = 0.6 q + 0.4 noise, or 0.6 one-hot(x) + 0.4 noise for drafts
    that are treated as deterministic."""
    generator = torch.Generator().manual_seed(seed)
    draft_probs = random_dists(batch, gamma, VOCAB, generator=generator, sharpness=1.0)
    drafts = draw(draft_probs, generator)
    target = random_dists(batch, gamma + 1, VOCAB, generator=generator, sharpness=1.0)
    agreeing = one_hot(drafts) if deterministic else draft_probs
    target[:, :gamma] = 0.6 * agreeing + 0.4 * target[:, :gamma]
    return drafts, draft_probs, target


def test_single_generator_reproduces_outputs() -> None:
    drafts, draft_probs, target = sampled_batch(64, 4, seed=20)
    first = rejection_sample(drafts, draft_probs, target, torch.Generator().manual_seed(1))
    torch.rand(10)  # the global generator's state must not matter
    second = rejection_sample(drafts, draft_probs, target, torch.Generator().manual_seed(1))
    other = rejection_sample(drafts, draft_probs, target, torch.Generator().manual_seed(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], other[0]), "a different seed was meant to change some rows"


# --- coupled verification of seeded rows ----------------------------------------------------------------


def race_agreement(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax(p / E) = argmax(q / E)) for E iid Exp(1), exactly: both races pick x when E_x < E_y c_y for every
    other y, c_y = min(p_x / p_y, q_x / q_y); the minimum of E_y c_y is Exp(sum of 1 / c_y), and an Exp(1) number
    falls below an Exp(rate) one with probability 1 / (1 + rate)."""
    p, q = p.double(), q.double()
    total = 0.0
    for x in range(len(p)):
        if p[x] > 0 and q[x] > 0:
            others = torch.arange(len(p)) != x
            total += 1 / (1 + float(torch.maximum(p[others] / p[x], q[others] / q[x]).sum()))
    return total


def exponential_noise(*shape: int, seed: int) -> torch.Tensor:
    return torch.empty(*shape).exponential_(generator=torch.Generator().manual_seed(seed))


def test_coupled_verify_emits_the_targets_own_sample_whatever_was_drafted() -> None:
    """Drafts equal to the target's samples, the draft's own samples raced on the same noise, or random tokens:
    the output is the target's race up to and including the first draft that differs from it."""
    batch, gamma = 256, 4
    _, draft_probs, target = sampled_batch(batch, gamma, seed=24)
    noise = exponential_noise(batch, gamma + 1, VOCAB, seed=3)
    own = race(target, noise)
    kinds = {
        "the target's own": own[:, :gamma],
        "raced from q": race(draft_probs, noise[:, :gamma]),
        "random": torch.randint(VOCAB, (batch, gamma), generator=torch.Generator().manual_seed(4)),
    }
    positions = torch.arange(gamma + 1)
    for name, drafts in kinds.items():
        output, num_accepted = coupled_verify(drafts, target, noise)
        differs = drafts != own[:, :gamma]
        assert torch.equal(num_accepted, torch.where(differs.any(-1), differs.int().argmax(-1), gamma)), name
        kept = positions <= num_accepted[:, None]
        assert torch.equal(output[kept], own[kept]) and bool((output[~kept] == -1).all()), name
    assert bool((coupled_verify(kinds["the target's own"], target, noise)[1] == gamma).all())
    output, num_accepted = coupled_verify(own[:, :gamma], target, noise, torch.full((batch,), 2))
    assert bool((num_accepted == 2).all()) and torch.equal(output[:, :3], own[:, :3])


@pytest.mark.parametrize(("p", "q"), list(PAIRS.values()), ids=list(PAIRS))
def test_coupled_acceptance_is_the_races_agreement_and_the_output_is_p(p: torch.Tensor, q: torch.Tensor) -> None:
    """A draft raced from q on the target's noise is accepted when both races agree (``race_agreement``), never
    more often than rejection sampling's sum(min(p, q)), and the emitted token is still a sample of p. A
    deterministic draft x is accepted with probability p(x), as in rejection sampling."""
    rows = 100_000
    noise = exponential_noise(rows, 2, p.numel(), seed=12)
    target = torch.stack([p, torch.full_like(p, 1 / p.numel())]).expand(rows, -1, -1)
    output, num_accepted = coupled_verify(race(q, noise[:, :1]), target, noise)
    assert binomial_pvalue(num_accepted == 1, race_agreement(p, q)) > 1e-3
    assert race_agreement(p, q) <= float(torch.minimum(p, q).sum())
    assert chi_square_pvalue(output[:, 0], p) > 1e-3
    fixed = int(q.argmax())
    _, num_accepted = coupled_verify(torch.full((rows, 1), fixed), target, noise)
    assert binomial_pvalue(num_accepted == 1, float(p[fixed])) > 1e-3


# --- output contract ---------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 2, 5])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_output_contract(gamma: int, with_draft_probs: bool) -> None:
    drafts, draft_probs, target = sampled_batch(2_000, gamma, seed=24 + gamma, deterministic=not with_draft_probs)
    output, num_accepted = rejection_sample(
        drafts, draft_probs if with_draft_probs else None, target, torch.Generator().manual_seed(gamma)
    )
    assert_output_contract(output, num_accepted, drafts)
    assert num_accepted.dtype == torch.int64
    counts = torch.bincount(num_accepted, minlength=gamma + 1)
    assert (counts > 0).all(), f"every number of accepted drafts was meant to occur: {counts.tolist()}"
    emitted = output.gather(1, num_accepted[:, None])[:, 0]
    rows = torch.arange(len(drafts))
    assert (target[rows, num_accepted, emitted] > 0).all()
