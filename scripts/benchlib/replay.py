"""Speculative decoding replayed on a recorded output: draft lengths compared without timing noise.

Greedy output does not depend on the drafter, so one plain greedy continuation fixes every round a drafter
would see: a round proposes up to k tokens after the committed text, keeps the prefix that equals the
recorded continuation, and commits one token more. A drafter is replayed from what it would propose after
each committed length: prompt lookup computes it on the spot; a model draft's greedy proposals, with its
confidence in each token, are recorded once per committed length (``record_model_chains``), the way the
decoder's self-draft computes them. Each round is then priced by timed draft and verify steps, and the
decoder's own ``DraftLengthController`` is fed each round's drafts, acceptances, confidences and price as
the decoder feeds it, so auto and every fixed length are compared on identical rounds.

Sampled output does not depend on the drafter either, in distribution: rejection sampling emits every token
from the target's own distribution p. Given the token y it emits at a drafted position, the draft token
there was accepted with probability min(p(y), q(y)) / p(y) (q: the distribution the draft sampled from),
and when it was rejected it was a sample of norm(max(0, q - p)), never y. So a plain sampled continuation
replays a sampled model draft exactly in distribution (``record_sampled_chains``): each drafted position is
accepted on a coin with that probability, one uniform number per position of the continuation shared by
every draft length compared. Prompt lookup's drafts are deterministic (q one-hot), so its coin is simply
whether it drafted y.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from benchlib.timing import step_seconds, step_seconds_by_width
from specdec_trt.costs import Costs
from specdec_trt.draft_length import AcceptanceEvidence, DraftLengthController
from specdec_trt.drafting import LOOKUP, MODEL, DraftPlan, PromptLookupDrafter, StopRule
from specdec_trt.runtime.engine import Engine
from specdec_trt.runtime.ort_engine import OrtEngine
from specdec_trt.sampling import BatchSampler, SamplingParams, sample_from

FIXED_LENGTHS = (1, 2, 3, 4, 6, 8)  # the fixed draft lengths auto is compared with
COST_CONTEXTS = (100, 500, 1000, 1500, 2000)  # cached tokens at which steps are timed


@dataclass(frozen=True)
class Proposal:
    """A round's drafted tokens and, where the drafter reports it, its confidence in each."""

    tokens: np.ndarray
    confidence: np.ndarray | None = None


@dataclass(frozen=True)
class Round:
    """One replayed round: ``context`` committed tokens before it, the ``part`` of the drafter that drafted,
    ``drafted`` tokens of which ``accepted`` were accepted (one more token is committed after them)."""

    context: int
    part: str
    proposal: Proposal
    accepted: int

    @property
    def drafted(self) -> int:
        return len(self.proposal.tokens)


Proposer = Callable[[np.ndarray, int, StopRule | None], Proposal]
"""(committed tokens, tokens wanted, stop rule) -> proposal. As a drafter does, a proposal with confidences
ends after the first token at which the stop rule (given by auto, else None) ends the round."""
Price = Callable[[Round], tuple[float, float]]  # round -> (draft seconds, verify seconds)


def lookup_proposer(drafter: PromptLookupDrafter) -> Proposer:
    """Prompt lookup's proposals, made by ``drafter`` itself (with its confidence and stop under auto)."""

    def propose(committed: np.ndarray, length: int, stop: StopRule | None) -> Proposal:
        plan = DraftPlan(drafter.parts([committed]), {} if stop is None else {LOOKUP: stop})
        draft = drafter.propose([0], [committed], [length], None, plan)
        drafted = int(draft.num_drafts[0])
        confidence = None if draft.confidence is None else draft.confidence[0, :drafted].numpy()
        return Proposal(draft.token_ids[0, :drafted].numpy(), confidence)

    return propose


def replay_rounds(
    prompt: list[int], output: list[int], propose: Callable[[np.ndarray, int], tuple[str, Proposal]]
) -> Iterator[Round]:
    """The rounds of the recorded generation ``output`` after ``prompt``. ``propose(committed, usable)`` gives
    the round's drafting part and proposal, at most ``usable`` tokens (the tokens still needed, less the
    target's own)."""
    sequence = np.asarray(prompt + output)
    position, end = len(prompt) + 1, len(sequence)  # the first token comes from the prefill
    while position < end:
        part, proposal = propose(sequence[:position], end - position - 1)
        accepted = 0
        tokens = proposal.tokens
        while accepted < len(tokens) and tokens[accepted] == sequence[position + accepted]:
            accepted += 1
        yield Round(position, part, proposal, accepted)
        position += accepted + 1


def position_counts(rounds: Sequence[Round], positions: int) -> tuple[list[int], list[int]]:
    """Drafted and accepted tokens at each of the first ``positions`` draft positions over ``rounds``, as the
    decoder's ``drafted_per_position`` and ``accepted_per_position`` count them."""
    drafted = [sum(r.drafted > i for r in rounds) for i in range(positions)]
    return drafted, [sum(r.accepted > i for r in rounds) for i in range(positions)]


def fixed_length_rounds(prompt: list[int], output: list[int], propose: Proposer, k: int, part: str) -> list[Round]:
    """The rounds of ``output`` when ``propose`` (the drafter's ``part``) drafts ``k`` tokens a round."""
    return list(
        replay_rounds(prompt, output, lambda committed, usable: (part, propose(committed, min(k, usable), None)))
    )


def generation_seconds(
    prompt: list[int],
    output: list[int],
    parts: dict[str, Proposer],
    part_of: Callable[[np.ndarray], str],
    price: Price,
    k: int | None,
    max_draft: int,
) -> float:
    """Priced seconds of one recorded generation when the drafter's ``parts`` (chosen each round by
    ``part_of(committed)``) draft ``k`` tokens a round (0: plain decoding), or, for ``k=None``, as many as
    the decoder's auto controllers choose (one per part, as in the decoder), each part given the
    controller's cost-aware stop rule."""
    costs = Costs(packed=False)  # one row: packed or padded, its pass computes its own drafts
    controllers: dict[str, DraftLengthController] = {}
    evidence: dict[str, AcceptanceEvidence] = {}  # the one row's, per part

    def propose(committed: np.ndarray, usable: int) -> tuple[str, Proposal]:
        part = part_of(committed)
        if k is not None:
            length = min(k, usable)
            return part, parts[part](committed, length, None) if length else Proposal(committed[:0])
        controller = controllers.setdefault(part, DraftLengthController(max_draft, costs))
        row = evidence.setdefault(part, controller.evidence())
        (length,) = controller.plan([row], usable)
        if not length:
            return part, Proposal(committed[:0])
        return part, parts[part](committed, length, controller.stop_rule([0], [row]))

    total = 0.0
    for round_ in replay_rounds(prompt, output, propose):
        draft_s, verify_s = price(round_)
        if k is None:
            confidence = round_.proposal.confidence
            judged = None if confidence is None else confidence[None]
            controller = controllers[round_.part]
            costs.verify.add(1, round_.drafted, verify_s)
            if round_.drafted:
                controller.drafting.add(1, round_.drafted, draft_s)
            controller.observe(round_.drafted, [round_.accepted], [evidence[round_.part]], judged)
        total += draft_s + verify_s
    return total


def speedups_by_length(
    prompt: list[int],
    output: list[int],
    parts: dict[str, Proposer],
    part_of: Callable[[np.ndarray], str],
    price: Price,
    max_draft: int,
) -> dict[str, float]:
    """One generation's priced speedup over plain decoding for each of ``FIXED_LENGTHS`` ("k=N") and auto."""

    def seconds(k: int | None) -> float:
        return generation_seconds(prompt, output, parts, part_of, price, k, max_draft)

    plain = seconds(0)
    return {"auto" if k is None else f"k={k}": plain / seconds(k) for k in (*FIXED_LENGTHS, None)}


def auto_against_fixed(per_prompt: Sequence[dict[str, float]]) -> dict:
    """From each prompt's ``speedups_by_length``: the median speedup of each length over the prompts, the best
    fixed length (chosen after the fact), and auto's median over that best one's."""
    medians = {name: float(np.median([speedups[name] for speedups in per_prompt])) for name in per_prompt[0]}
    best = max((name for name in medians if name != "auto"), key=medians.__getitem__)
    return {"median_speedup": medians, "best_fixed": best, "auto_over_best": medians["auto"] / medians[best]}


def speedup_table(by_suite: dict[str, dict]) -> str:
    """``auto_against_fixed`` of each suite as a text table."""
    names = [f"k={k}" for k in FIXED_LENGTHS] + ["auto"]
    lines = [f"{'suite':14s} " + " ".join(f"{n:>6s}" for n in names) + "  auto / best fixed"]
    for suite, figures in by_suite.items():
        cells = " ".join(f"{figures['median_speedup'][n]:6.3f}" for n in names)
        lines.append(f"{suite:14s} {cells}  {figures['auto_over_best']:.3f} ({figures['best_fixed']})")
    return "\n".join(lines)


def stopped(proposal: Proposal, stop: StopRule | None) -> Proposal:
    """The proposal cut after the first token at which ``stop`` ends the round (that token kept), as the
    model drafter does; unchanged without a rule."""
    if stop is None:
        return proposal
    for i, confidence in enumerate(proposal.confidence):
        if stop(torch.tensor([confidence]), [0], np.array([True])):
            return Proposal(proposal.tokens[: i + 1], proposal.confidence[: i + 1])
    return proposal


@dataclass(frozen=True)
class ModelChains:
    """A model draft's greedy proposals after each committed length of one sequence: row i holds the draft's
    tokens and confidences after ``first + i`` committed tokens, up to ``max_draft`` or the tokens left."""

    first: int
    tokens: list[list[int]]
    confidence: list[list[float]]

    def proposer(self) -> Proposer:
        """Proposals as the recorded draft makes them."""

        def propose(committed: np.ndarray, length: int, stop: StopRule | None) -> Proposal:
            if not length:
                return Proposal(committed[:0])
            i = len(committed) - self.first
            proposal = Proposal(np.asarray(self.tokens[i][:length]), np.asarray(self.confidence[i][:length]))
            return stopped(proposal, stop)

        return propose


def fork(draft: OrtEngine, target: OrtEngine, lengths: Sequence[int]) -> None:
    """Start a batch of ``len(lengths)`` rows on ``draft`` (the target's cache layout: a self-draft) from
    slot 0 of ``target``: row r holds its first ``lengths[r]`` tokens, copied, with no prefill of its own."""
    for slot in [s for s in range(draft.num_slots) if draft.occupied(s)]:
        draft.release(slot)
    draft.reserve(len(lengths))
    for slot, length in enumerate(lengths):
        draft.admit(slot)
        draft.copy_from(target, slot, length, source_slot=0)


def record_model_chains(
    target: OrtEngine, draft: OrtEngine, sequence: list[int], first: int, max_draft: int, rows: int = 4
) -> ModelChains:
    """The greedy proposals of a self-draft (``draft`` with ``target``'s cache layout) after every committed
    length of ``sequence`` from ``first`` on that leaves a token to draft, ``rows`` lengths at a time. As in
    the decoder, the draft attends to the target's keys and values of the committed tokens except the
    newest, which it feeds itself, then its own drafts. Confidence: the draft's softmax probability of each
    drafted token, rounded to 6 decimals."""
    end = len(sequence)
    target.prefill(torch.tensor([sequence]), torch.tensor([end]))
    lengths = list(range(first, end - 1))
    tokens: list[list[int]] = []
    confidence: list[list[float]] = []
    for start in range(0, len(lengths), rows):
        chunk = lengths[start : start + rows]
        depths = [min(max_draft, end - length - 1) for length in chunk]
        fork(draft, target, [length - 1 for length in chunk])
        fed = torch.tensor([[sequence[length - 1]] for length in chunk])
        drafted, probability = [], []
        for _ in range(max(depths)):
            logits = draft.forward(fed)[:, 0]
            fed = logits.argmax(-1, keepdim=True)
            drafted.append(fed[:, 0])
            probability.append(logits.float().softmax(-1).gather(1, fed)[:, 0])
        drafted_rows, probability_rows = torch.stack(drafted, 1).tolist(), torch.stack(probability, 1).tolist()
        for depth, row_tokens, row_probability in zip(depths, drafted_rows, probability_rows):
            tokens.append(row_tokens[:depth])
            confidence.append([round(p, 6) for p in row_probability[:depth]])
    return ModelChains(first, tokens, confidence)


Continuation = Callable[[int, int, int], Iterator[float]]
"""(committed length, depth, rejected token) -> the draft's raw probability of each token it drafts after it."""
UNJUDGED = -1  # a token drafted after a rejected one: the verifier never judges it, only its count matters


@dataclass(frozen=True)
class SampledChains:
    """A sampled model draft along one sampled sequence: row i is the round after ``first + i`` committed
    tokens, one entry per draft depth (up to ``max_draft`` or the tokens left). ``tokens``: the sequence's own
    next tokens, which are the drafts where they were accepted; ``accept``: the chance min(1, q(y) / p(y))
    that the draft there was accepted, given that the sequence goes on with that token y; ``confidence``: q(y),
    the draft's confidence as the decoder's drafter reports it (``drawn_confidence``); ``rejected`` and
    ``rejected_confidence``: a draft token drawn as a rejected one is distributed (norm(max(0, q - p)); -1 where
    no draft can be rejected) and q of it."""

    first: int
    tokens: list[list[int]]
    accept: list[list[float]]
    confidence: list[list[float]]
    rejected: list[list[int]]
    rejected_confidence: list[list[float]]

    def proposer(self, uniform: np.ndarray, after_rejected: Continuation | None = None) -> Proposer:
        """Proposals as the sampled draft makes them: its draft of position t is accepted when ``uniform[t]``
        is below the acceptance chance there. Drafts after a rejected one are never judged; a stop rule
        still reads their confidence, which ``after_rejected`` gives (without a rule they are only counted)."""

        def propose(committed: np.ndarray, length: int, stop: StopRule | None) -> Proposal:
            if stop is not None and after_rejected is None:
                raise ValueError("a stop rule reads the drafts after a rejected one: give after_rejected")
            start, i = len(committed), len(committed) - self.first
            tokens: list[int] = []
            confidence: list[float] = []

            def ends(token: int, value: float) -> bool:
                tokens.append(token)
                confidence.append(value)
                stops = stop is not None and stop(torch.tensor([value]), [0], np.array([True]))
                return stops or len(tokens) == length

            for depth in range(length):
                if uniform[start + depth] < self.accept[i][depth]:
                    if ends(self.tokens[i][depth], self.confidence[i][depth]):
                        break
                    continue
                if ends(self.rejected[i][depth], self.rejected_confidence[i][depth]):
                    break
                if stop is None:
                    tokens += [UNJUDGED] * (length - len(tokens))
                    break
                for value in after_rejected(start, depth, self.rejected[i][depth]):
                    if ends(UNJUDGED, value):
                        break
                break
            return Proposal(np.asarray(tokens, np.int64), None if stop is None else np.asarray(confidence))

        return propose


def record_sampled_chains(
    target: OrtEngine,
    draft: OrtEngine,
    sequence: list[int],
    first: int,
    max_draft: int,
    params: SamplingParams,
    generator: torch.Generator,
    rows: int = 4,
) -> SampledChains:
    """A self-draft's sampled drafting along the sampled ``sequence``, after every committed length from
    ``first`` on that leaves a token to draft, ``rows`` lengths at a time, fed as ``record_model_chains``
    feeds it but always on the sequence's own tokens. ``params`` warp the target's and the draft's logits as
    the decoder warps them; ``generator`` draws the rejected tokens. Leaves the target holding the sequence
    but its last token. Probabilities are rounded to 6 decimals."""
    end = len(sequence)
    sampler = BatchSampler([params])
    width = (target.max_draft_len or 0) + 1
    logits = [target.prefill(torch.tensor([sequence[:first]]), torch.tensor([first]))]
    for start in range(first, end - 1, width):
        logits.append(target.forward(torch.tensor([sequence[start : min(start + width, end - 1)]]))[0])
    target_probs = sampler.probs(torch.cat(logits)[None])[0]  # row t - first: the target's p of token t
    lengths = list(range(first, end - 1))
    names = ("tokens", "accept", "confidence", "rejected", "rejected_confidence")
    fields: dict[str, list[list]] = {name: [] for name in names}
    for begin in range(0, len(lengths), rows):
        chunk = lengths[begin : begin + rows]
        depths = [min(max_draft, end - length - 1) for length in chunk]
        fork(draft, target, [length - 1 for length in chunk])
        fed = torch.tensor([[sequence[length - 1]] for length in chunk])
        per_depth = []
        for depth in range(max(depths)):
            draft_logits = draft.forward(fed)[:, 0].float()
            positions = [min(length + depth, end - 1) for length in chunk]  # rows past their depth: ignored
            y = torch.tensor([sequence[t] for t in positions])[:, None]
            p, q = target_probs[torch.tensor(positions) - first], sampler.probs(draft_logits[None])[0]
            residual = (q - p).clamp_(min=0)
            rejected = sample_from(residual, torch.rand(len(chunk), generator=generator))
            rejected = torch.where(residual.sum(-1) > 0, rejected, UNJUDGED)
            accept = (q.gather(1, y) / p.gather(1, y)).clamp(max=1)[:, 0]
            rejected_confidence = q.gather(1, rejected.clamp(min=0)[:, None])[:, 0]
            per_depth.append((y[:, 0], accept, q.gather(1, y)[:, 0], rejected, rejected_confidence))
            fed = y
        columns = [torch.stack(column, 1) for column in zip(*per_depth)]  # per field: [rows, max depth]
        for name, column in zip(names, columns):
            values = (column if column.dtype == torch.int64 else column.round(decimals=6)).tolist()
            fields[name] += [row[:depth] for row, depth in zip(values, depths)]
    return SampledChains(first, **fields)


def sampled_continuation(
    target: OrtEngine, draft: OrtEngine, sequence: list[int], params: SamplingParams, seed: int
) -> Continuation:
    """The self-draft going on after a rejected draft token on the sampled ``sequence``: for the round after
    L committed tokens that drafted the sequence's own tokens up to ``depth`` and then ``token``, the draft's
    confidence in each token it samples next (q of it), one at a time. Each (L, depth) samples with its own seed
    derived from ``seed``, so the answer does not depend on the order of the calls. The target's cache is
    filled with the sequence on the first call."""
    prefilled = False

    def after_rejected(length: int, depth: int, token: int) -> Iterator[float]:
        nonlocal prefilled
        if not prefilled:
            target.prefill(torch.tensor([sequence[:-1]]), torch.tensor([len(sequence) - 1]))
            prefilled = True
        fork(draft, target, [length - 1])
        draft.forward(torch.tensor([sequence[length - 1 : length + depth]]))
        sampler = BatchSampler([replace(params, seed=(seed * 1_000_003 + length) * 64 + depth)])
        fed = torch.tensor([[token]])
        for step in itertools.count():
            logits = draft.forward(fed)[:, 0].float()
            drafted, probs = sampler.draw(logits, step)
            yield float(probs[0, drafted[0]])
            fed = drafted[:, None]

    return after_rejected


@dataclass(frozen=True)
class StepPrices:
    """Seconds of the steps a round takes, timed at ``contexts`` cached tokens and interpolated between:
    ``verify[w]``, the target's pass of w new tokens; ``draft``, one model-draft step (a model-drafted
    round of g tokens takes g of them; a prompt-lookup round drafts for free)."""

    contexts: tuple[int, ...]
    verify: dict[int, list[float]]
    draft: list[float] | None = None

    def __call__(self, round_: Round) -> tuple[float, float]:
        verify = float(np.interp(round_.context, self.contexts, self.verify[round_.drafted + 1]))
        if round_.part != MODEL or not round_.drafted:
            return 0.0, verify
        if self.draft is None:
            raise ValueError("a model-drafted round needs draft step prices")
        return round_.drafted * float(np.interp(round_.context, self.contexts, self.draft)), verify


def measure_step_prices(
    target: Engine, draft: Engine | None, max_width: int, contexts: Sequence[int], repeats: int
) -> StepPrices:
    """Time the target's passes of 1 to ``max_width`` new tokens (widths interleaved) and, given a ``draft``,
    its one-token step, after each of ``contexts`` cached tokens."""
    widths = range(1, max_width + 1)
    verify: dict[int, list[float]] = {width: [] for width in widths}
    drafting: list[float] = []
    for context in contexts:
        for width, seconds in step_seconds_by_width(target, context, widths, repeats).items():
            verify[width].append(seconds)
        if draft is not None:
            drafting.append(step_seconds(draft, context, 1, repeats))
    return StepPrices(tuple(contexts), verify, drafting if draft is not None else None)
