"""The runners that time one generation of our methods and of transformers'.

"ours" methods run on our engines through ``SpeculativeDecoder`` (plain decoding is ``num_draft_tokens=0``
on the same target engine: the baseline). "transformers" methods are the peers on the same weights:
``generate``, assisted generation with ``assistant_model=`` and prompt lookup
(``prompt_lookup_num_tokens=``), timed through a streamer that sees every verify pass. The llama.cpp and
onnxruntime-genai peers have runners of their own modules (``llama_cpp_peer``, ``ort_genai_peer``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from specdec_trt.bench.methods import HEURISTIC, HEURISTIC_CONFIDENCE, HEURISTIC_START, Method, Run
from specdec_trt.bench.suites import BenchPrompt
from specdec_trt.build_engines.checkpoint import load_transformers_model
from specdec_trt.decoder import SpeculativeDecoder
from specdec_trt.draft_spec import NGRAM
from specdec_trt.loading import LoadedModels
from specdec_trt.runtime.engine import ContextOverflowError
from specdec_trt.sampling import SamplingParams


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run a block with torch's intra-op pool at ``count`` threads, then restore it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Reply(NamedTuple):
    """A warm decoder's answer to a conversation."""

    run: Run
    prompt_tokens: int
    token_ids: list[int]
    text: str


Converse = Callable[[list[dict[str, str]], SamplingParams], Reply]
"""Sends a conversation to a warm decoder."""


class OursRunner:
    """Our decoder over one target engine, with one drafter per draft label.

    ``torch_threads``: torch's pool size while generating: every core for PyTorch engines, 1 for ONNX
    Runtime engines (whose own pool owns the cores; torch only samples). ``run`` starts cold, as a single
    prompt does: no prefix cache, no store of earlier runs' text (a repeat would find its own last run's).
    ``warm`` keeps both across the calls of a workload, as a server does."""

    def __init__(self, models: LoadedModels, torch_threads: int) -> None:
        self._drafters = {None: None, **models.drafters}
        self._models = models
        self._decoders = {label: self._decoder(label, cold=True) for label in self._drafters}
        self._warm: dict[str | None, SpeculativeDecoder] = {}
        self.torch_threads = torch_threads

    def _decoder(self, label: str | None, cold: bool) -> SpeculativeDecoder:
        models = self._models
        return SpeculativeDecoder(
            models.target,
            self._drafters[label],
            models.tokenizer,
            models.eos_token_ids,
            prefix_cache=not cold,
            draft_store=not cold,
        )

    def encode(self, prompt: BenchPrompt) -> list[int]:
        """A suite prompt's token ids: chat prompts go through the tokenizer's chat template."""
        plain = self._decoders[None]
        return plain.tokenize(plain.apply_chat_template(prompt.prompt) if prompt.chat else prompt.prompt)

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation's token ids, through the tokenizer's chat template."""
        plain = self._decoders[None]
        return plain.tokenize(plain.apply_chat_template(messages))

    def run(self, method: Method, prompt_ids: list[int], params: SamplingParams) -> tuple[Run, list[int]]:
        """Generate once, cold; the run's figures and the generated token ids."""
        return self._generate(self._decoders[method.draft], method, prompt_ids, params)

    @contextlib.contextmanager
    def warm(self, method: Method) -> Iterator[Converse]:
        """A way to converse with ``method`` on a decoder that keeps its prefix cache and store across calls,
        reset before and after (the engines are shared with every other method)."""
        if method.draft not in self._warm:
            self._warm[method.draft] = self._decoder(method.draft, cold=False)
        decoder = self._warm[method.draft]
        decoder.reset_prefix_cache()

        def converse(messages: list[dict[str, str]], params: SamplingParams) -> Reply:
            prompt_ids = self.encode_messages(messages)
            try:
                run, tokens = self._generate(decoder, method, prompt_ids, params)
            except ContextOverflowError as error:
                outgrew = f"a conversation outgrew the context: {error}; make fewer calls or fewer new tokens"
                raise ValueError(outgrew) from error
            return Reply(run, len(prompt_ids), tokens, decoder.tokenizer.decode(tokens, skip_special_tokens=True))

        try:
            yield converse
        finally:
            decoder.reset_prefix_cache()

    def _generate(
        self, decoder: SpeculativeDecoder, method: Method, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[Run, list[int]]:
        with torch_threads(self.torch_threads):
            output = decoder.generate(prompt_ids, params, method.num_draft_tokens)
        s = output.stats
        run = Run(
            generated_tokens=s.generated_tokens,
            total_s=s.total_s,
            ttft_s=s.prefill_s,
            rounds=s.rounds,
            accepted_tokens=s.accepted_tokens,
            drafted_tokens=s.drafted_tokens,
            drafted_per_position=list(s.drafted_per_position),
            accepted_per_position=list(s.accepted_per_position),
            draft_s=s.draft_s,
            draft_prefill_s=s.draft_prefill_s,
            verify_s=s.verify_s,
            cached_prompt_tokens=s.cached_prompt_tokens,
            store_drafted_tokens=s.store_drafted_tokens,
            store_accepted_tokens=s.store_accepted_tokens,
        )
        return run, output.token_ids


class _PassTimer(BaseStreamer):
    """Receives the prompt, then the tokens of every target forward: counts passes and stamps the first."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersRunner:
    """transformers' own ``generate`` on the same weights: plain, with an assistant model, or prompt lookup.

    Assisted generation drafts a constant ``num_draft_tokens`` per round (no heuristic schedule, no
    confidence cut-off) so that it is compared with our decoder at the same gamma; with HEURISTIC it runs
    transformers' own schedule and confidence cut-off at their defaults, restarted for every request
    (the "heuristic" schedule would otherwise carry its draft length from one request to the next)."""

    def __init__(
        self, model: PreTrainedModel, assistants: dict[str, PreTrainedModel], threads: int, eos_token_ids: Sequence[int]
    ) -> None:
        self.model = model
        self.assistants = assistants
        self.threads = threads
        self.eos_token_ids = list(eos_token_ids)

    @classmethod
    def open(
        cls,
        target: Path,
        assistants: dict[str, Path],
        device: str,
        dtype: torch.dtype,
        threads: int,
        eos_token_ids: Sequence[int],
    ) -> TransformersRunner:
        """transformers' models on the target's checkpoint (and each draft checkpoint, as assistants)."""
        if not target.exists():
            raise ValueError(
                f"transformers' peers need the target's checkpoint, {target}, which is not there: "
                "give --hf-target or --no-peers"
            )

        def load(path: Path) -> PreTrainedModel:
            return load_transformers_model(path, dtype).to(device)

        return cls(load(target), {label: load(p) for label, p in assistants.items()}, threads, eos_token_ids)

    @torch.inference_mode()
    def run(self, method: Method, prompt_ids: list[int], params: SamplingParams) -> tuple[Run, list[int]]:
        """Generate once; the run's figures and the generated token ids."""
        kwargs: dict = {
            "max_new_tokens": params.max_new_tokens,
            "eos_token_id": None if params.ignore_eos else self.eos_token_ids,
            "pad_token_id": self.eos_token_ids[0] if self.eos_token_ids else 0,
            "do_sample": not params.greedy,
        }
        if not params.greedy:
            kwargs |= {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
            if params.min_p:
                kwargs["min_p"] = params.min_p
            torch.manual_seed(params.seed or 0)
        if method.draft == NGRAM:
            if not method.is_fixed:
                raise ValueError(f"transformers' prompt lookup has no {method.num_draft_tokens!r} schedule")
            kwargs["prompt_lookup_num_tokens"] = method.num_draft_tokens
        elif method.draft is not None:
            config = self.assistants[method.draft].generation_config
            if method.num_draft_tokens == HEURISTIC:
                config.num_assistant_tokens = HEURISTIC_START
                config.num_assistant_tokens_schedule = HEURISTIC
                config.assistant_confidence_threshold = HEURISTIC_CONFIDENCE
            else:
                config.num_assistant_tokens = method.num_draft_tokens
                config.num_assistant_tokens_schedule = "constant"
                config.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = self.assistants[method.draft]
        timer = _PassTimer()
        inputs = torch.tensor([prompt_ids], device=self.model.device)
        with torch_threads(self.threads):
            start = time.perf_counter()
            output = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), streamer=timer, **kwargs)
            total_s = time.perf_counter() - start
        generated = output[0, len(prompt_ids) :].tolist()
        passes = timer.calls - 1
        run = Run(
            generated_tokens=len(generated),
            total_s=total_s,
            ttft_s=(timer.first_token_at or start + total_s) - start,
            rounds=passes,
            accepted_tokens=len(generated) - passes,
        )
        return run, generated
