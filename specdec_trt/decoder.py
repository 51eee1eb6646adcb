"""SpeculativeDecoder: prefill, then draft -> verify -> accept rounds, with streaming and stop rules.

Cache invariant between rounds, per row: the target cache holds the committed sequence except its last
token; the draft cache holds a prefix of it (all but the last two after a drafting round, fewer after
plain rounds), which ``ModelDrafter`` completes when it next drafts. A round feeds the target
``[last committed token, d_1 .. d_k]`` in one verify pass, keeps the accepted prefix plus one target
token, and rolls both caches back by moving their length pointers.

``num_draft_tokens="auto"`` (``AUTO``) decides every round from the acceptance and the costs measured so
far (``specdec_trt.schedule``) whether to draft, and a model draft then drafts until one more token is
expected to add less than it costs, judged from its own confidence as calibrated on earlier rounds (or,
with ``draft_confidence_threshold``, until its confidence falls below that). A drafter with two parts (prompt
lookup first, a model where it finds nothing) gets one such controller per part, as their acceptance and
costs differ. A fixed integer drafts exactly that many tokens per round.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdec_trt.build_engines.manifest import read_manifest
from specdec_trt.draft_spec import ENGINE, NGRAM, NONE, DraftSpec
from specdec_trt.drafting import LOOKUP, Draft, Drafter, StopRule, confidence_below
from specdec_trt.loading import LoadedModels, open_checkpoints, open_engine_directory
from specdec_trt.rejection import greedy_verify, rejection_sample
from specdec_trt.runtime.engine import ContextOverflowError, Engine
from specdec_trt.runtime.transfer import HostCopy, to_device
from specdec_trt.sampling import BatchSampler, SamplingParams
from specdec_trt.schedule import DraftLengthController
from specdec_trt.stats import GenerationStats
from specdec_trt.text import TextTracker

Prompt = str | Sequence[int]
DraftLength = int | str  # a number of drafts per round, or AUTO
DEFAULT_NUM_DRAFT_TOKENS = 5
AUTO = "auto"
# Longest draft "auto" may choose on an engine without a verify-width limit (the PyTorch engine). It is
# also what the context check reserves, so it stays modest: past 8 drafts, even at acceptance 0.9, a
# draft token adds under 0.05 expected tokens per round.
AUTO_MAX_DRAFT_TOKENS = 8


def check_context(prompt_tokens: int, max_new_tokens: int, draft_tokens: int, max_context: int) -> None:
    """Refuse, before any work, a request whose prompt, new tokens and up to ``draft_tokens`` drafts in a
    round would pass ``max_context``."""
    needed = prompt_tokens + max_new_tokens + draft_tokens
    if needed > max_context:
        raise ContextOverflowError(
            f"the prompt's {prompt_tokens} tokens + max_new_tokens {max_new_tokens} + up to {draft_tokens} draft "
            f"tokens need {needed} positions, more than the max context {max_context}: shorten the prompt or "
            "lower max_new_tokens"
        )


def default_draft_length(target: Engine) -> int:
    """``DEFAULT_NUM_DRAFT_TOKENS``, or fewer when the target's verify pass was built for fewer."""
    built_for = target.max_draft_len
    return DEFAULT_NUM_DRAFT_TOKENS if built_for is None else min(DEFAULT_NUM_DRAFT_TOKENS, built_for)


def check_draft_length(gamma: DraftLength, built_for: int | None) -> None:
    """Refuse a fixed draft length past the ``built_for`` drafts an engine's verify pass takes (None: any)."""
    if gamma != AUTO and built_for is not None and gamma > built_for:
        raise ValueError(
            f"num_draft_tokens={gamma} exceeds the {built_for} drafts the engine was built for: ask for fewer "
            "or rebuild with specdec-build --max-draft-len"
        )


def check_num_draft_tokens(value: object) -> DraftLength:
    """``value`` if it is an integer >= 0 or "auto", else a ValueError saying what is accepted."""
    if value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError(f"num_draft_tokens must be an integer >= 0 or {AUTO!r}, got {value!r}")


@dataclass
class GenerationOutput:
    """One request's result. ``finish_reason`` is "stop" (EOS or a stop string) or "length"."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


class _Request:
    """One row of a batch: its committed sequence, its text and when it stops."""

    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, tracker: TextTracker, eos: frozenset[int]
    ) -> None:
        self.sequence = list(prompt_ids)
        self.params = params
        self.tracker = tracker
        self.eos = frozenset() if params.ignore_eos else eos
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.generated)

    def extend(self, tokens: Iterable[int]) -> None:
        """Commit tokens in order until one ends the request (EOS, a stop string, max_new_tokens)."""
        for token in tokens:
            if self.finished:
                return
            self.generated.append(token)
            self.sequence.append(token)
            if token in self.eos or self.tracker.add(token):
                self.finish_reason = "stop"
            elif self.remaining == 0:
                self.finish_reason = "length"

    def output(self) -> GenerationOutput:
        self.stats.generated_tokens = len(self.generated)
        return GenerationOutput(self.tracker.text, list(self.generated), self.finish_reason or "length", self.stats)


class GenerationStream:
    """Iterates over text pieces as tokens are accepted; ``output`` holds the full result afterwards."""

    def __init__(self, rounds: Iterator[list[_Request]]) -> None:
        self._rounds = rounds
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[str]:
        shown = 0
        for (request,) in self._rounds:
            text = request.tracker.stable_text(request.finished)
            if len(text) > shown:
                yield text[shown:]
                shown = len(text)
        self.output = request.output()


class SpeculativeDecoder:
    """Lossless speculative decoding over a target engine and a drafter.

    ``num_draft_tokens=0`` (or no drafter) is plain target-only decoding on the same engine: the baseline;
    ``"auto"`` picks the draft length each round (see the module docstring). ``draft_confidence_threshold``
    replaces auto's cost-aware stop with a fixed cut-off (as transformers' ``assistant_confidence_threshold``):
    a model draft's rounds run up to the limit and end after a token the draft gave less than this probability
    in every row (0: never); prompt lookup's rounds draft the length auto chooses.
    A decoder runs one generation (or batch) at a time: its engines hold that batch's KV caches.
    """

    def __init__(
        self,
        target: Engine,
        drafter: Drafter | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        eos_token_ids: Iterable[int] = (),
        num_draft_tokens: DraftLength = DEFAULT_NUM_DRAFT_TOKENS,
        draft_confidence_threshold: float | None = None,
    ) -> None:
        check_num_draft_tokens(num_draft_tokens)
        if draft_confidence_threshold is not None and not 0 <= draft_confidence_threshold <= 1:
            raise ValueError(f"draft_confidence_threshold must be in [0, 1], got {draft_confidence_threshold!r}")
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        eos = set(eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 0
        self.draft_confidence_threshold = draft_confidence_threshold
        limits = [target.max_context, drafter.max_context if drafter is not None else None]
        self.max_context = min(limit for limit in limits if limit is not None)

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | DraftSpec | None = NGRAM,
        *,
        num_draft_tokens: DraftLength = DEFAULT_NUM_DRAFT_TOKENS,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_context: int | None = None,
        draft_confidence_threshold: float | None = None,
        cuda_graphs: bool | None = None,
        compiled: bool = False,
    ) -> SpeculativeDecoder:
        """Load checkpoints (directories or GGUF files) onto PyTorch engines. ``target=None`` is the
        embedded SmolLM2-135M-Instruct; ``draft`` is a checkpoint, "ngram" (prompt lookup), "ngram+" before a
        checkpoint, or None. On a CUDA device the engines replay their steps from CUDA graphs unless
        ``cuda_graphs=False``; ``compiled=True`` runs them through ``torch.compile`` (see ``TorchEngine``)."""
        check_num_draft_tokens(num_draft_tokens)  # before loading anything
        spec = DraftSpec.parse(draft)
        loaded = open_checkpoints(target, [spec], device, dtype, max_context, cuda_graphs, compiled)
        return cls.from_loaded(loaded, num_draft_tokens, draft_confidence_threshold)

    @classmethod
    def from_engines(
        cls,
        directory: str | Path,
        draft: str | Path | DraftSpec | None = None,
        *,
        num_draft_tokens: DraftLength | None = None,
        threads: int | None = None,
        draft_confidence_threshold: float | None = None,
    ) -> SpeculativeDecoder:
        """Open an engine directory built by ``specdec-build`` on ONNX Runtime (its manifest and checksums
        are checked first). ``draft``: None (the directory's own draft if it was built with one, else plain
        decoding), "engine", "ngram", "ngram+engine", another engine directory, or "none".
        ``num_draft_tokens`` defaults to 5, or the engine's max draft length when that is smaller; "auto"
        chooses up to the engine's max draft length each round."""
        if num_draft_tokens is not None:
            check_num_draft_tokens(num_draft_tokens)  # before loading anything
        directory = Path(directory)
        if draft is None:
            draft = ENGINE if read_manifest(directory, verify_files=False).draft is not None else NONE
        loaded = open_engine_directory(directory, [DraftSpec.parse(draft)], threads)
        gamma = default_draft_length(loaded.target) if num_draft_tokens is None else num_draft_tokens
        return cls.from_loaded(loaded, gamma, draft_confidence_threshold)

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModels,
        num_draft_tokens: DraftLength = DEFAULT_NUM_DRAFT_TOKENS,
        draft_confidence_threshold: float | None = None,
    ) -> SpeculativeDecoder:
        """A decoder over models opened by ``specdec_trt.loading`` with at most one draft."""
        return cls(
            loaded.target,
            loaded.only_drafter(),
            loaded.tokenizer,
            loaded.eos_token_ids,
            num_draft_tokens,
            draft_confidence_threshold,
        )

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt, or a token-id prompt checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as a list of token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.target.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return ids

    def apply_chat_template(self, message: str) -> str:
        """Wrap a user message in the tokenizer's chat template, ready for the assistant's answer."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )

    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, num_draft_tokens: DraftLength | None = None
    ) -> GenerationOutput:
        """Generate one completion."""
        return self.generate_batch([prompt], params, num_draft_tokens)[0]

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        num_draft_tokens: DraftLength | None = None,
    ) -> list[GenerationOutput]:
        """Generate completions for a batch; each request keeps its own parameters and seed."""
        requests, sampler, gamma = self._prepare(prompts, params, num_draft_tokens)
        for _ in self._rounds(requests, sampler, gamma):
            pass
        return [request.output() for request in requests]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, num_draft_tokens: DraftLength | None = None
    ) -> GenerationStream:
        """Generate one completion, yielding text as it is accepted (iterate the returned stream)."""
        requests, sampler, gamma = self._prepare([prompt], params, num_draft_tokens)
        return GenerationStream(self._rounds(requests, sampler, gamma))

    def close(self) -> None:
        """Release the engines' caches."""
        self.target.close()
        engine = getattr(self.drafter, "engine", None)
        if engine is not None:
            engine.close()

    def _prepare(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        num_draft_tokens: DraftLength | None,
    ) -> tuple[list[_Request], BatchSampler, DraftLength]:
        """Validate everything before any work: the draft length, the parameters, prompts and context."""
        if isinstance(prompts, str) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        gamma = check_num_draft_tokens(self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens)
        if gamma and self.drafter is None:
            raise ValueError(f"num_draft_tokens={gamma!r} needs a drafter; this decoder has none (use 0)")
        check_draft_length(gamma, self.target.max_draft_len)
        params = SamplingParams() if params is None else params
        param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} sampling parameters for {len(prompts)} prompts")
        reach = self.max_auto_draft if gamma == AUTO else gamma
        requests = []
        for prompt, p in zip(prompts, param_list):
            ids = self.tokenize(prompt)
            check_context(len(ids), p.max_new_tokens, reach, self.max_context)
            requests.append(_Request(ids, p, TextTracker(self.tokenizer, p.stop), self.eos_token_ids))
        return requests, BatchSampler(param_list, self.target.device), gamma

    @property
    def max_auto_draft(self) -> int:
        """Longest draft "auto" may choose: the engine's verify limit, else ``AUTO_MAX_DRAFT_TOKENS``."""
        built_for = self.target.max_draft_len
        return AUTO_MAX_DRAFT_TOKENS if built_for is None else built_for

    def _rounds(self, requests: list[_Request], sampler: BatchSampler, gamma: DraftLength) -> Iterator[list[_Request]]:
        """Run a batch to completion, yielding after the first token and after every round."""
        start = time.perf_counter()
        prompts, lengths = _right_pad([r.sequence for r in requests])
        logits = self.target.prefill(prompts, lengths)
        first = sampler.draw(logits)[0].tolist()
        prefill_s = time.perf_counter() - start
        for request, token in zip(requests, first):
            request.stats.prefill_s = prefill_s
            request.extend([token])
        yield requests  # the first token streams before the draft's own prefill
        tick = time.perf_counter()  # not `start`: the consumer of the first token may have paused us
        if gamma:
            self.drafter.begin(prompts, lengths)
        draft_prefill_s = time.perf_counter() - tick
        draft_s = verify_s = 0.0
        schedules: dict[str, DraftLengthController] = {}  # with auto: one per part of the drafter
        while not all(r.finished for r in requests):
            # Finished rows stay in the batch, frozen: they re-run the same positions and are ignored.
            active = [not r.finished for r in requests]
            usable = max(r.remaining for r in requests if not r.finished) - 1
            sequences = [r.sequence for r in requests]
            schedule, part = None, None
            if gamma == AUTO:
                part = self.drafter.part(sequences)
                if part not in schedules:
                    schedules[part] = DraftLengthController(self.max_auto_draft, len(requests))
                schedule = schedules[part]
            num_drafts = schedule.choose(active, usable) if schedule else min(gamma, usable)
            tick = time.perf_counter()
            draft = self._draft(sequences, num_drafts, sampler, self._stop_rule(schedule, part, active))
            tock = time.perf_counter()
            # Queued now, read after the round's sync: reading the confidences would otherwise sync again.
            confidence = None if draft.confidence is None else HostCopy(draft.confidence.float())
            self.target.truncate(torch.tensor([len(s) - 1 for s in sequences]))
            last = to_device(torch.tensor([s[-1:] for s in sequences]), self.target.device)
            target_logits = self.target.forward(torch.cat([last, draft.token_ids.to(last.device)], 1))
            if sampler.all_greedy:
                output, num_accepted = greedy_verify(draft.token_ids, target_logits)
            else:
                target_probs = sampler.probs(target_logits)
                output, num_accepted = rejection_sample(draft.token_ids, draft.probs, target_probs, sampler.generators)
            rows = torch.cat([output, num_accepted[:, None]], 1).tolist()  # the round's one host sync
            output, num_accepted = [row[:-1] for row in rows], [row[-1] for row in rows]
            done = time.perf_counter()
            draft_s, verify_s = draft_s + tock - tick, verify_s + done - tock
            if schedule:
                judged = None if confidence is None else confidence.get().numpy()
                schedule.observe(draft.num_tokens, num_accepted, active, tock - tick, done - tock, judged)
            for request, row, accepted in zip(requests, output, num_accepted):
                if not request.finished:
                    request.stats.record_round(draft.num_tokens, accepted)
                    request.extend(row[: accepted + 1])
            yield requests
        total_s = time.perf_counter() - start
        for request in requests:
            stats = request.stats
            stats.draft_prefill_s, stats.draft_s, stats.verify_s, stats.total_s = (
                draft_prefill_s,
                draft_s,
                verify_s,
                total_s,
            )

    def _stop_rule(
        self, schedule: DraftLengthController | None, part: str | None, active: list[bool]
    ) -> StopRule | None:
        """Fixed gamma: none (exactly gamma drafts, no confidence). Auto: the controller's cost-aware stop, or
        the fixed cut-off ``draft_confidence_threshold`` for a model draft (a probability threshold means
        nothing for prompt lookup's rounds, which then draft the chosen length)."""
        if schedule is None:
            return None
        if self.draft_confidence_threshold is None:
            return schedule.stop_rule(active)
        return None if part == LOOKUP else confidence_below(self.draft_confidence_threshold)

    def _draft(
        self, sequences: list[list[int]], num_drafts: int, sampler: BatchSampler, stop_rule: StopRule | None
    ) -> Draft:
        if num_drafts <= 0:
            return Draft(torch.zeros(len(sequences), 0, dtype=torch.int64, device=self.target.device), None)
        return self.drafter.propose(sequences, num_drafts, sampler, stop_rule)


def _right_pad(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in sequences])
    width = int(lengths.max())
    padded = torch.tensor([s + [s[-1]] * (width - len(s)) for s in sequences])
    return padded, lengths
