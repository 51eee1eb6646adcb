"""llama.cpp as a peer of specdec-bench: llama.cpp's own ``llama-server``, built from its current source
(``specdec_trt.bench.llama_cpp_bin``), on one GGUF: plain, each of its n-gram speculative types, and a 4-bit
draft model. One server process per configuration, each with one slot. A speculative configuration keeps
state across requests (``ngram-mod``'s hash pool is shared by every request a server sees), so each of its
runs gets a fresh server, warmed up by a short request, as each of our runs starts from a cold decoder;
plain decoding keeps nothing and keeps its server.

The GGUF sets the class of weights: an F32 rewrite of our weights (``gguf_f32``) in float32 runs, the shipped
4-bit GGUF in 4-bit runs. Prompts go to ``/completion`` as token ids (the GGUF's vocabulary is our
tokenizer's) with its prompt cache off, so every run prefills the whole prompt, as our decoder does. The
figures are the server's own timings of the prompt and of the generation: HTTP adds nothing to the peer.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from specdec_trt.bench.methods import LLAMA_CPP, OWN_LENGTHS, Method, Run
from specdec_trt.bench.servers import free_port, llama_server_argv, running
from specdec_trt.sampling import SamplingParams

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")  # llama.cpp's n-gram drafters, at their defaults
MODEL_DRAFT = "Q4_1 draft"  # llama.cpp's draft-model speculation, on the shipped 4-bit GGUF of the same model
SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]  # ours filters in this order too (temperature: see below)
WARM_UP_PROMPT = [1, 2, 3, 4]  # shorter than any n-gram type's key: it leaves nothing to draft from


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """``/completion``'s sampling fields for ``params``. Temperature 0 is llama.cpp's greedy sampler (the
    argmax); otherwise its chain runs top-k, top-p, min-p, then temperature (ours divides by the temperature
    first, so with top_p < 1 or min_p > 0 and temperature != 1 the two distributions differ). Every filter is
    given, since the server's defaults (top-k 40, top-p 0.95, min-p 0.05) would filter."""
    if params.greedy:
        return {"temperature": 0.0}
    fields = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
    fields |= {"min_p": params.min_p, "samplers": SAMPLERS}
    return fields | ({} if params.seed is None else {"seed": params.seed})


def methods_for(lengths: tuple, model_draft: bool) -> list[Method]:
    """llama.cpp's methods: plain, each n-gram type, and with ``model_draft`` the draft model at each fixed
    draft length of ``lengths``."""
    methods = [Method(LLAMA_CPP, None)] + [Method(LLAMA_CPP, t, OWN_LENGTHS) for t in NGRAM_TYPES]
    if model_draft:
        methods += [Method(LLAMA_CPP, MODEL_DRAFT, k) for k in lengths if not isinstance(k, str)]
    return methods


class LlamaServerRunner:
    """llama-server (``binary``) on ``gguf`` with ``threads`` threads and ``n_ctx`` positions; ``draft_gguf``
    is the draft model's file for MODEL_DRAFT methods. Servers' output goes to ``logs``; ``close`` stops
    them all."""

    def __init__(
        self, binary: Path, gguf: Path, threads: int, n_ctx: int, logs: Path, draft_gguf: Path | None = None
    ) -> None:
        for path in (binary, gguf, draft_gguf):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"llama.cpp's peer needs {path}, which is not a file")
        self.binary, self.gguf, self.draft_gguf = Path(binary), Path(gguf), draft_gguf
        self.threads, self.n_ctx, self.logs = threads, n_ctx, logs
        self._servers: dict[tuple, tuple[ExitStack, httpx.Client]] = {}

    def arguments(self, method: Method) -> tuple[str, ...]:
        """The server options that make ``method``."""
        if method.family != LLAMA_CPP:
            raise ValueError(f"llama.cpp's runner runs llama.cpp's methods, not {method.name}")
        if method.draft is None:
            return ()
        if method.draft in NGRAM_TYPES and method.num_draft_tokens == OWN_LENGTHS:
            return ("--spec-type", method.draft)
        k = method.num_draft_tokens
        if method.draft == MODEL_DRAFT and self.draft_gguf is not None and isinstance(k, int) and k >= 1:
            return ("--spec-type", "draft-simple", "-md", str(self.draft_gguf), "--spec-draft-n-max", str(k))
        raise ValueError(f"llama.cpp's runner has no method {method.name!r} here (draft model: {self.draft_gguf})")

    def client(self, method: Method, fresh: bool = False) -> httpx.Client:
        """A client of the server for ``method``, started on first use, and again when ``fresh``."""
        options = self.arguments(method)
        if fresh and options in self._servers:
            self._servers.pop(options)[0].close()
        if options not in self._servers:
            stack = ExitStack()
            port = free_port()
            argv = llama_server_argv(self.binary, self.gguf, port, self.threads, 1, self.n_ctx, options)
            log = self.logs / f"llama-server-{'-'.join(options).replace('/', '_') or 'plain'}.log"
            server = stack.enter_context(running(method.name, argv, port, "/health", log))
            client = stack.enter_context(httpx.Client(base_url=server.url, timeout=600))
            client.post("/completion", json={"prompt": WARM_UP_PROMPT, "n_predict": 2}).raise_for_status()
            self._servers[options] = (stack, client)
        return self._servers[options][1]

    def run(self, method: Method, prompt_ids: list[int], params: SamplingParams) -> tuple[Run, list[int]]:
        """Generate once with an empty cache; the run's figures and the generated token ids."""
        if not prompt_ids or len(prompt_ids) + params.max_new_tokens > self.n_ctx:
            raise ValueError(
                f"llama.cpp needs a prompt of 1 token or more and at most n_ctx {self.n_ctx} positions for the "
                f"prompt and the new tokens, not {len(prompt_ids)} + max_new_tokens {params.max_new_tokens}"
            )
        body = {"prompt": prompt_ids, "n_predict": params.max_new_tokens, "ignore_eos": params.ignore_eos}
        body |= {"cache_prompt": False, "return_tokens": True, **sampling_fields(params)}
        response = self.client(method, fresh=method.draft is not None).post("/completion", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"llama-server answered {response.status_code}: {response.text[:500]}")
        answer = response.json()
        tokens, timings = answer["tokens"], answer["timings"]
        accepted = timings.get("draft_n_accepted", 0)
        run = Run(
            generated_tokens=len(tokens),
            total_s=(timings["prompt_ms"] + timings["predicted_ms"]) / 1e3,
            ttft_s=timings["prompt_ms"] / 1e3,
            rounds=len(tokens) - 1 - accepted,
            accepted_tokens=accepted,
            drafted_tokens=timings.get("draft_n", 0) if method.draft is not None else None,  # absent when 0
        )
        return run, tokens

    def close(self) -> None:
        """Stop every server this runner started."""
        while self._servers:
            self._servers.popitem()[1][0].close()
