"""Decoders for the benchmark scripts that share one opened target: each with its own drafter (or none), no
prefix cache and no store of earlier requests, as a single prompt runs cold. One target serves them all, since
a second set of ONNX Runtime sessions would leave its threads spinning beside the first's."""

from __future__ import annotations

import dataclasses

from specdec_trt import SpeculativeDecoder
from specdec_trt.draft_spec import DraftLength
from specdec_trt.loading import LoadedModels
from specdec_trt.stats import GenerationStats


def decoder_on(loaded: LoadedModels, drafter: str | None, num_draft_tokens: DraftLength) -> SpeculativeDecoder:
    """A cold decoder over ``loaded``'s target with its drafter labelled ``drafter`` (None: plain decoding), its
    profile loaded where the engine directory keeps one."""
    models = dataclasses.replace(loaded, drafters={drafter: loaded.drafters[drafter]} if drafter else {})
    return SpeculativeDecoder.from_loaded(models, num_draft_tokens, prefix_cache=False, draft_store=False)


def decode_tokens_per_s(stats: GenerationStats) -> float:
    """Tokens after the first per second after it: llama-bench's tg, the prompt's prefill excluded."""
    return (stats.generated_tokens - 1) / (stats.total_s - stats.time_to_first_token_s)
