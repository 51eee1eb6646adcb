"""llama.cpp as a peer of specdec-bench: llama-cpp-python's ``Llama`` in-process on one GGUF, plain or with its
prompt-lookup draft (``LlamaPromptLookupDecoding``), timed as ``TransformersRunner`` times transformers.

The GGUF sets the class of weights: an F32 rewrite of our weights (``gguf_f32``) in float32 runs, the shipped
4-bit GGUF in 4-bit runs. Prompts go in as token ids (the GGUF's vocabulary is our tokenizer's), and every run
prefills into an empty KV cache, as our decoder does. A pass is one ``Llama.eval`` call: the prompt's, then one
per verify round (a token and its drafts). llama-cpp-python is optional: ``pip install 'specdec-trt[peers]'``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec_trt.bench.methods import PEERS_INSTALL, Method, Run, prompt_lookup_length
from specdec_trt.bench.servers import llama_cpp_available
from specdec_trt.sampling import SamplingParams

if TYPE_CHECKING:
    from llama_cpp import Llama


def require_llama_cpp() -> None:
    """Refuse, in one line that names the fix, to run llama.cpp where llama-cpp-python is not installed."""
    if not llama_cpp_available():
        raise ValueError(f"llama.cpp's peer needs llama-cpp-python, which is not installed: {PEERS_INSTALL}")


def sampling_arguments(params: SamplingParams) -> dict[str, Any]:
    """``Llama.generate``'s sampling arguments for ``params``. Temperature 0 is llama.cpp's greedy sampler (the
    argmax); otherwise its own chain runs: top-k, top-p, min-p, then temperature (ours divides by the
    temperature first, so with top_p < 1 or min_p > 0 and temperature != 1 the two distributions differ).
    ``Llama.generate``'s defaults (min_p 0.05, top_p 0.95, top_k 40) would filter, so each is given; its
    typical-p and repeat penalty are off by default."""
    if params.greedy:
        return {"temp": 0.0}
    return {
        "temp": params.temperature,
        "top_k": params.top_k,  # 0: off, as ours
        "top_p": params.top_p,
        "min_p": params.min_p,
    }


class LlamaCppRunner:
    """llama.cpp on one GGUF with ``threads`` threads (prompt and generation) and ``n_ctx`` positions.

    One ``Llama`` per draft configuration (plain, and each prompt-lookup length), opened on first use and kept:
    the weights are memory-mapped once by the OS; each holds its own KV cache, and a lookup one also keeps the
    logits of every position (n_ctx x vocabulary floats: llama-cpp-python samples each draft position)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        require_llama_cpp()
        if not Path(gguf).is_file():
            raise ValueError(f"llama.cpp's GGUF {gguf} is not a file")
        self.gguf = Path(gguf)
        self.threads = threads
        self.n_ctx = n_ctx
        self._models: dict[int | None, Llama] = {}  # by prompt-lookup draft length; None: plain
        self.evals = 0  # Llama.eval calls, on every model, since the runner was made

    def model(self, lookup: int | None) -> Llama:
        """The ``Llama`` for plain decoding (None) or prompt lookup of ``lookup`` drafts, opened once."""
        if lookup not in self._models:
            self._models[lookup] = self._open(lookup)
        return self._models[lookup]

    def _open(self, lookup: int | None) -> Llama:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = None if lookup is None else LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        # Prompt lookup verifies its drafts from the logits of every position: llama-cpp-python keeps them only
        # with logits_all (without it, its buffer holds n_batch positions and a longer sequence fails).
        llm = Llama(
            str(self.gguf),
            n_ctx=self.n_ctx,
            n_threads=self.threads,
            n_threads_batch=self.threads,
            draft_model=draft,
            logits_all=draft is not None,
            verbose=False,
        )
        evaluate = llm.eval

        def counted(tokens: Sequence[int]) -> None:
            self.evals += 1
            evaluate(tokens)

        llm.eval = counted  # generate() evaluates through self.eval: one call per pass
        return llm

    def run(self, method: Method, prompt_ids: list[int], params: SamplingParams) -> tuple[Run, list[int]]:
        """Generate once from an empty KV cache; the run's figures and the generated token ids."""
        import llama_cpp

        lookup = prompt_lookup_length(method)
        if not prompt_ids or len(prompt_ids) + params.max_new_tokens > self.n_ctx:
            raise ValueError(
                f"llama.cpp needs a prompt of 1 token or more and at most n_ctx {self.n_ctx} positions for the "
                f"prompt and the new tokens, not {len(prompt_ids)} + max_new_tokens {params.max_new_tokens}"
            )
        llm = self.model(lookup)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        llm.set_seed(llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed)
        llm.reset()  # no tokens kept: generate() finds no prefix to reuse and prefills the whole prompt
        evals_before = self.evals
        tokens: list[int] = []
        start = first_at = time.perf_counter()
        stream = llm.generate(prompt_ids, **sampling_arguments(params))
        for token in stream:  # generate() never ends by itself: it yields until it is left
            if not tokens:
                first_at = time.perf_counter()
            tokens.append(token)
            # The end-of-generation tokens llama.cpp's own completions stop at (EOS among them), kept as ours is.
            end = not params.ignore_eos and llama_cpp.llama_vocab_is_eog(vocab, token)
            if end or len(tokens) == params.max_new_tokens:
                break
        total_s = time.perf_counter() - start
        stream.close()
        rounds = self.evals - evals_before - 1
        run = Run(
            generated_tokens=len(tokens),
            total_s=total_s,
            ttft_s=first_at - start,
            rounds=rounds,
            accepted_tokens=len(tokens) - 1 - rounds,  # beyond one token a pass: accepted drafts (plain: 0)
        )
        return run, tokens
