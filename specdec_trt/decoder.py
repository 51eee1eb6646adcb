"""SpeculativeDecoder: the public API. Load models once, then generate, stream or submit from any thread.

Every call is a client of one ``Scheduler`` (continuous batching, one engine thread): concurrent calls share
the running batch, and no interleaving of calls can mix two requests' state. ``num_draft_tokens`` is a
number of drafts per round (0: plain decoding on the same engine, the baseline) or "auto" (``AUTO``), which
chooses each round's draft length for the most tokens per second of the whole batch
(``specdec_trt.planner``); a model draft then drafts until one more token is expected to add less than it
costs, judged from its own confidence as calibrated on earlier rounds (or, with
``draft_confidence_threshold``, until its confidence falls below that).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdec_trt.draft_spec import AUTO, DraftLength, DraftSpec
from specdec_trt.drafting import Drafter
from specdec_trt.loading import LoadedModels, open_checkpoints, open_engine_directory
from specdec_trt.policy import DEFAULT_DRAFT, DEFAULT_NUM_DRAFT_TOKENS, choose_draft, draft_length_for
from specdec_trt.policy import default_draft_length as default_draft_length  # re-exported: callers name it here
from specdec_trt.prefill import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_CHUNK_ROUNDS, PrefillPolicy
from specdec_trt.profile import EngineProfile, profiled_rows
from specdec_trt.profile_cache import ProfileCache, profile_key
from specdec_trt.request import GenerationOutput, RequestHandle
from specdec_trt.runtime.engine import ContextOverflowError, Engine
from specdec_trt.sampling import SamplingParams
from specdec_trt.scheduler import Scheduler
from specdec_trt.user_text import check_text
from specdec_trt.validation import (
    InvalidTypeError,
    InvalidValueError,
    check_integer,
    check_prompt_type,
    check_token_ids,
    is_integer,
)

Prompt = str | Sequence[int]
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


def check_draft_length(gamma: DraftLength, built_for: int | None) -> None:
    """Refuse a fixed draft length past the ``built_for`` drafts an engine's verify pass takes (None: any)."""
    if gamma != AUTO and built_for is not None and gamma > built_for:
        raise InvalidValueError(
            f"num_draft_tokens={gamma} exceeds the {built_for} drafts the engine was built for: ask for fewer "
            "or rebuild with specdec-build --max-draft-len"
        )


def check_num_draft_tokens(value: object) -> DraftLength:
    """``value`` if it is an integer >= 0 or "auto", else a ValueError saying what is accepted."""
    if value == AUTO or (is_integer(value) and value >= 0):
        return value if value == AUTO else int(value)
    raise InvalidValueError(f"num_draft_tokens must be an integer >= 0 or {AUTO!r}, got {value!r}")


def check_confidence_threshold(threshold: float | None) -> float | None:
    """``threshold`` if it is None or a probability, else a ValueError saying what is accepted."""
    if threshold is not None and not 0 <= threshold <= 1:
        raise InvalidValueError(f"draft_confidence_threshold must be in [0, 1], got {threshold!r}")
    return threshold


CONTENT_MARK = ("\ue000", "\ue001")  # private-use characters around a message's index while the template renders


class GenerationStream:
    """Iterates over text pieces as tokens are accepted; ``output`` holds the full result afterwards. The
    request runs from the call that made the stream, whether or not it is being iterated."""

    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[str]:
        yield from self.handle
        self.output = self.handle.output

    def cancel(self) -> None:
        self.handle.cancel()


class SpeculativeDecoder:
    """Lossless speculative decoding over a target engine and a drafter.

    ``num_draft_tokens=0`` (or no drafter) is plain target-only decoding on the same engine: the baseline;
    ``"auto"`` picks the draft length each round (see the module docstring). ``draft_confidence_threshold``
    replaces auto's cost-aware stop with a fixed cut-off (as transformers' ``assistant_confidence_threshold``):
    a model draft's rounds run up to the limit and end after a token the draft drew with less than this
    probability in every row (from its warped distribution where the row samples; 0: never); prompt lookup's
    rounds draft the length auto chooses. ``max_batch_size``, ``max_queue``, ``prefill_chunk``,
    ``prefill_chunk_rounds`` and ``prefix_cache`` (on: a request whose prompt starts as an earlier one's reuses
    its keys and values, ``specdec_trt.prefix_cache``) and ``draft_store`` (on: ended requests' text goes to the
    store that prompt lookup also drafts from) set up its ``Scheduler``. ``draft``: what the drafter was
    opened as (the constructors fill it in). The decoder owns its engines: while it serves, nothing else may run them.
    """

    def __init__(
        self,
        target: Engine,
        drafter: Drafter | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        eos_token_ids: Iterable[int] = (),
        num_draft_tokens: DraftLength = DEFAULT_NUM_DRAFT_TOKENS,
        draft_confidence_threshold: float | None = None,
        *,
        max_batch_size: int | None = None,
        max_queue: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefill_chunk_rounds: float | None = DEFAULT_PREFILL_CHUNK_ROUNDS,
        prefix_cache: bool = True,
        draft_store: bool = True,
        draft: DraftSpec | None = None,
    ) -> None:
        check_num_draft_tokens(num_draft_tokens)
        check_confidence_threshold(draft_confidence_threshold)
        self.target = target
        self.drafter = drafter
        self.draft = draft  # what the drafter was opened as, where the decoder was told (None: not told)
        self.tokenizer = tokenizer
        eos = set(eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 0
        self.scheduler = Scheduler(
            target,
            drafter,
            tokenizer,
            self.eos_token_ids,
            self.max_auto_draft,
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            prefill=PrefillPolicy(prefill_chunk, prefill_chunk_rounds),
            draft_confidence_threshold=draft_confidence_threshold,
            prefix_cache=prefix_cache,
            draft_store=draft_store,
        )
        self.max_context = self.scheduler.max_context
        self.profiles: ProfileCache | None = None  # where this decoder's engine profile is kept, if anywhere
        self.profiled = False  # whether its cost models were seeded by a profile of its engines
        self._longest_token_chars: int | None = None  # of the vocabulary's token strings, read on first use

    @property
    def draft_confidence_threshold(self) -> float | None:
        """The fixed confidence cut-off of "auto"'s model drafts (None: auto's cost-aware stop)."""
        return self.scheduler.planner.confidence_threshold

    @draft_confidence_threshold.setter
    def draft_confidence_threshold(self, threshold: float | None) -> None:
        self.scheduler.planner.confidence_threshold = check_confidence_threshold(threshold)

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | DraftSpec | None = DEFAULT_DRAFT,
        *,
        num_draft_tokens: DraftLength | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_context: int | None = None,
        draft_confidence_threshold: float | None = None,
        cuda_graphs: bool | None = None,
        compiled: bool = False,
        **scheduling,
    ) -> SpeculativeDecoder:
        """Load checkpoints (directories or GGUF files) onto PyTorch engines. ``target=None`` is the
        embedded SmolLM2-135M-Instruct; ``draft`` is a checkpoint, "ngram" (prompt lookup), "ngram+" before a
        checkpoint, or "none" (or None: plain decoding); "default" and ``num_draft_tokens=None`` are the
        defaults of ``specdec_trt.policy`` (prompt lookup, 5 drafts a round), as specdec-run --target opens. On
        a CUDA device the engines replay their steps from CUDA graphs unless ``cuda_graphs=False``;
        ``compiled=True`` runs them through ``torch.compile`` (see ``TorchEngine``). ``scheduling``: see
        ``from_loaded``."""
        if num_draft_tokens is not None:
            check_num_draft_tokens(num_draft_tokens)  # before loading anything
        if max_context is not None:
            check_integer("max_context", max_context, 1)
        spec, gamma = choose_draft(None, draft, num_draft_tokens)
        loaded = open_checkpoints(target, [spec], device, dtype, max_context, cuda_graphs, compiled)
        return cls.from_loaded(loaded, gamma, draft_confidence_threshold, draft=spec, **scheduling)

    @classmethod
    def from_engines(
        cls,
        directory: str | Path,
        draft: str | Path | DraftSpec | None = DEFAULT_DRAFT,
        *,
        num_draft_tokens: DraftLength | None = None,
        threads: int | None = None,
        draft_confidence_threshold: float | None = None,
        **scheduling,
    ) -> SpeculativeDecoder:
        """Open an engine directory built by ``specdec-build`` on ONNX Runtime (its manifest and checksums
        are checked first). ``draft``: "engine" (the directory's own draft), "ngram", "ngram+engine", another
        engine directory, or "none" (or None: plain decoding); "default" and ``num_draft_tokens=None`` are the
        defaults of ``specdec_trt.policy``, as specdec-run --engines opens: "ngram+engine" with "auto" for a directory
        built with a draft, else "ngram"; a fixed draft length defaults to 5, or the engine's max draft length
        when that is smaller. "auto" chooses up to the engine's max draft length each round. ``scheduling``:
        see ``from_loaded``."""
        if num_draft_tokens is not None:
            check_num_draft_tokens(num_draft_tokens)  # before loading anything
        spec, gamma = choose_draft(Path(directory), draft, num_draft_tokens)
        loaded = open_engine_directory(directory, [spec], threads)
        return cls.from_loaded(loaded, gamma, draft_confidence_threshold, draft=spec, **scheduling)

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModels,
        num_draft_tokens: DraftLength | None = None,
        draft_confidence_threshold: float | None = None,
        *,
        draft: DraftSpec | None = None,
        **scheduling,
    ) -> SpeculativeDecoder:
        """A decoder over models opened by ``specdec_trt.loading`` with at most one draft, ``draft`` being what
        they were opened with (kept as ``decoder.draft``). ``num_draft_tokens=None`` is the policy's fixed
        default for the opened target (0 without a drafter). ``scheduling``: ``max_batch_size``,
        ``max_queue``, ``prefill_chunk``, ``prefill_chunk_rounds``, ``prefix_cache``, ``draft_store`` (see
        ``Scheduler``)."""
        drafter = loaded.only_drafter()
        decoder = cls(
            loaded.target,
            drafter,
            loaded.tokenizer,
            loaded.eos_token_ids,
            draft_length_for(loaded.target, drafter is not None, num_draft_tokens),
            draft_confidence_threshold,
            draft=draft,
            **scheduling,
        )
        if loaded.engine_dir is not None and loaded.threads is not None:
            key = profile_key(loaded.threads, next(iter(loaded.drafters), "none"), decoder.max_auto_draft)
            decoder.profiles = ProfileCache(loaded.engine_dir, key)
            profile = decoder.profiles.load(profiled_rows(decoder.scheduler.max_batch_size))
            if profile is not None:
                decoder.scheduler.seed(profile)
                decoder.profiled = True
        return decoder

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt, or a token-id prompt checked against the vocabulary."""
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        check_prompt_type(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidValueError("this model has no tokenizer: pass the prompt as a list of token ids")
            self._check_length(check_text(prompt, "the prompt"))
            ids = self.tokenizer.encode(prompt)
        else:
            ids = check_token_ids(prompt, self.target.vocab_size)
        if not ids:
            raise InvalidValueError("the prompt is empty: give at least one token")
        return ids

    def _check_length(self, text: str) -> None:
        """Refuse, before tokenizing it, a text whose length alone shows that it cannot fit the context: no token
        spells more characters than the vocabulary's longest token string, so it holds at least that many fewer
        tokens than characters (a megabyte of text is refused at once, not after seconds of tokenizing)."""
        if self._longest_token_chars is None:
            self._longest_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        fewest = -(-len(text) // self._longest_token_chars)
        if fewest > self.max_context:
            raise ContextOverflowError(
                f"the prompt's {len(text)} characters make at least {fewest} tokens, more than the max context "
                f"{self.max_context}: shorten the prompt"
            )

    def tokenize_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the chat template, each message's content tokenized as text: a
        control token's spelling inside it ("<|im_end|>") stays text, so no content can end its message or open
        another role's. The template's own markers are its control tokens, as ``tokenize`` gives them. A
        conversation that spells no control token is tokenized whole, as ``tokenize`` would."""
        controls = [token.content for token in self.tokenizer.added_tokens_decoder.values()]
        if not any(control in message["content"] for message in messages for control in controls):
            return self.tokenize(self.apply_chat_template(messages))
        marks = [f"{CONTENT_MARK[0]}{i}{CONTENT_MARK[1]}" for i in range(len(messages))]
        rendered = self.apply_chat_template([dict(m) | {"content": mark} for m, mark in zip(messages, marks)])
        self._check_length(rendered + "".join(m["content"] for m in messages))
        ids = self.tokenizer.encode("")  # what the tokenizer puts first (a BOS), as ``tokenize`` would
        rest = rendered
        for mark, message in zip(marks, messages):
            template, found, rest = rest.partition(mark)
            if not found:
                raise InvalidValueError("this model's chat template rewrites the messages' content: send a prompt")
            ids += self.tokenizer.encode(template, add_special_tokens=False)
            ids += self.tokenizer.encode(message["content"], add_special_tokens=False, split_special_tokens=True)
        ids += self.tokenizer.encode(rest, add_special_tokens=False)
        return ids

    def apply_chat_template(self, message: str | Sequence[dict[str, str]]) -> str:
        """Wrap a user message (or a conversation of ``{"role", "content"}`` messages) in the tokenizer's chat
        template, ready for the assistant's answer."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise InvalidValueError("this model's tokenizer has no chat template")
        messages = [{"role": "user", "content": message}] if isinstance(message, str) else list(message)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, num_draft_tokens: DraftLength | None = None
    ) -> GenerationOutput:
        """Generate one completion."""
        return self.generate_batch([prompt], params, num_draft_tokens)[0]

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        num_draft_tokens: DraftLength | Sequence[DraftLength] | None = None,
    ) -> list[GenerationOutput]:
        """Generate completions for several prompts at once; each request keeps its own parameters and seed
        (``params`` and ``num_draft_tokens``: one for all, or one per request)."""
        return [handle.result() for handle in self.submit_batch(prompts, params, num_draft_tokens)]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, num_draft_tokens: DraftLength | None = None
    ) -> GenerationStream:
        """Generate one completion, yielding text as it is accepted (iterate the returned stream)."""
        return GenerationStream(self.submit(prompt, params, num_draft_tokens))

    def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, num_draft_tokens: DraftLength | None = None
    ) -> RequestHandle:
        """Start one request and return at once: iterate the handle for text (``for`` or ``async for``),
        ``cancel()`` it, or wait for its ``result()``."""
        return self.submit_batch([prompt], params, num_draft_tokens)[0]

    def submit_batch(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        num_draft_tokens: DraftLength | Sequence[DraftLength] | None = None,
    ) -> list[RequestHandle]:
        """Start several requests at once (all of them or, on an error, none); ``params`` and
        ``num_draft_tokens`` are one for all or one per request."""
        return self.scheduler.submit(self._prepare(prompts, params, num_draft_tokens))

    def profile(self) -> EngineProfile:
        """Time the engines at the numbers of rows this decoder runs (``specdec_trt.profile``), seed the cost models
        with the timings and keep them beside the engines, for every later decoder of this directory on this
        machine; only while no request is in flight. Without a profile a decoder starts from the planner's prior
        and learns from its own rounds."""
        profile = self.scheduler.profile(profiled_rows(self.scheduler.max_batch_size))
        self.profiled = True
        if self.profiles is not None:
            self.profiles.save(profile)
        return profile

    def reset_prefix_cache(self) -> None:
        """Release the keys and values kept for later requests and forget earlier requests' text: the next
        request starts as on a fresh decoder (requests in flight are not touched)."""
        self.scheduler.reset_prefix_cache()

    def close(self) -> None:
        """Finish the requests in flight, stop the engine thread and release the engines' caches."""
        self.scheduler.close()
        self.target.close()
        engine = getattr(self.drafter, "engine", None)
        if engine is not None:
            engine.close()

    @property
    def slot_cache_bytes(self) -> int:
        """Bytes of keys and values one slot holds in the target's and the draft model's caches: every slot holds
        the full context, so ``max_batch_size`` slots take at most that many times this."""
        draft = getattr(self.drafter, "engine", None)
        return self.target.slot_cache_bytes + (0 if draft is None else draft.slot_cache_bytes)

    def draft_reserve(self, num_draft_tokens: DraftLength | None = None) -> int:
        """Positions a request's rounds may draft into past its prompt and new tokens: its draft length, or
        for "auto" the longest draft auto may choose (None: this decoder's default draft length)."""
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        return self.max_auto_draft if k == AUTO else k

    def _prepare(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        num_draft_tokens: DraftLength | Sequence[DraftLength] | None,
    ) -> list[tuple[list[int], SamplingParams, DraftLength]]:
        """Validate everything before any work: the draft lengths, the parameters, prompts and context."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise InvalidValueError("prompts must be a non-empty list of prompts")
        params = SamplingParams() if params is None else params
        param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if not isinstance(param_list, (list, tuple)) or any(not isinstance(p, SamplingParams) for p in param_list):
            raise InvalidTypeError(
                f"params must be a SamplingParams (or one per prompt), got {type(params).__name__}: "
                "pass SamplingParams(...), e.g. SamplingParams(**your_dict)"
            )
        gamma = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        gammas = list(gamma) if isinstance(gamma, (list, tuple)) else [gamma] * len(prompts)
        if len(param_list) != len(prompts) or len(gammas) != len(prompts):
            raise InvalidValueError(
                f"got {len(param_list)} sampling parameters and {len(gammas)} draft lengths for {len(prompts)} prompts"
            )
        requests = []
        for prompt, p, k in zip(prompts, param_list, gammas):
            k = check_num_draft_tokens(k)
            if k and self.drafter is None:
                raise InvalidValueError(f"num_draft_tokens={k!r} needs a drafter; this decoder has none (use 0)")
            check_draft_length(k, self.target.max_draft_len)
            if p.stop and self.tokenizer is None:
                raise InvalidValueError("stop strings need a tokenizer; this model has none")
            ids = self.tokenize(prompt)
            check_context(len(ids), p.max_new_tokens, self.draft_reserve(k), self.max_context)
            requests.append((ids, p, k))
        return requests

    @property
    def max_auto_draft(self) -> int:
        """Longest draft "auto" may choose: the engine's verify limit, else ``AUTO_MAX_DRAFT_TOKENS``."""
        built_for = self.target.max_draft_len
        return AUTO_MAX_DRAFT_TOKENS if built_for is None else built_for
