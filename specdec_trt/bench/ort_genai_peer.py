"""onnxruntime-genai as a peer of specdec-bench: its own model builder run on our target's weights, then its own
generation loop (``og.Generator``), plain or with its n-gram prompt lookup, timed as ``TransformersRunner`` times
transformers.

The builder (``onnxruntime_genai.models.builder``, run as a subprocess) makes a CPU model at "fp32" or "int4"
(its int4: MatMulNBits weight-only, round-to-nearest, symmetric, blocks of 32 along the input dimension, and
int8 activations on the CPU, its ``accuracy_level`` 4; with tied embeddings the embedding table is quantized
alike). Its GGUF reader takes float16/float32 files only and fetches the config from the hub, so a GGUF target
(the default one is Q4_1) is first written out as a Hugging Face folder of the float32 tensors our engines run.
Builds go to the cache once, through a temporary sibling folder renamed into place.

onnxruntime-genai 0.18 also decodes speculatively: by n-gram prompt lookup (no drafter needed: ``NGRAM``
methods here) or with a draft model, a second builder output of the same vocabulary named in the target's
``genai_config.json`` (``model.draft``), which this peer does not build. onnxruntime-genai is optional:
``pip install 'specdec-trt[peers]'``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specdec_trt.bench.methods import PEERS_INSTALL, Method, Run, prompt_lookup_length
from specdec_trt.build_request import cache_root
from specdec_trt.sampling import SamplingParams

PRECISIONS = ("fp32", "int4")
CONFIG = "genai_config.json"
# Prompt lookup drafts what followed the most recent earlier occurrence of the last two tokens (onnxruntime-genai's
# ngram_size counts the drafted token too and matches exactly that length, with no shorter fallback).
LOOKUP_NGRAM = 3
MAX_DRAFTS = 16  # onnxruntime-genai's bound on speculative.max_draft_tokens
DRAFT_MODEL = (
    " (its draft-model decoding needs the draft built by its builder and named in the target's genai_config.json)"
)


def ort_genai_available() -> bool:
    """Whether onnxruntime-genai is installed (found without importing it)."""
    return importlib.util.find_spec("onnxruntime_genai") is not None


def require_ort_genai() -> None:
    """Refuse, in one line that names the fix, to run where onnxruntime-genai is not installed."""
    if not ort_genai_available():
        raise ValueError(f"onnxruntime-genai's peer needs onnxruntime-genai, which is not installed: {PEERS_INSTALL}")


def default_genai_dir(checkpoint: Path, precision: str) -> Path:
    """Where the build of ``checkpoint`` at ``precision`` is cached: beside our other peers' files, under
    ``cache_root`` (the root of the default engines)."""
    name = checkpoint.name if checkpoint.is_dir() else checkpoint.stem
    return cache_root() / "peers" / "onnxruntime-genai" / f"{name}-{precision}"


def build_genai_model(checkpoint: Path, precision: str, out: Path) -> Path:
    """``out``, holding onnxruntime-genai's CPU model of ``checkpoint`` (a Hugging Face folder or a GGUF file) at
    ``precision``; built when it has no ``genai_config.json``, reused otherwise.

    The builder runs in a subprocess: importing it in-process would put its own top-level modules
    (``builders``, ``quantization``, ``builder_config``) into ours and hold its torch model in our memory, and a
    subprocess is killed cleanly on an interrupt. Nothing is fetched: it reads local files only, offline. A failed
    or interrupted build leaves no ``out``: it is made in a temporary sibling folder, removed on any error, and
    renamed into place when done."""
    if precision not in PRECISIONS:
        raise ValueError(f"onnxruntime-genai precision {precision!r}: choose {' or '.join(PRECISIONS)}")
    if (out / CONFIG).is_file():
        return out
    require_ort_genai()
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise ValueError(f"{checkpoint} does not exist: give a Hugging Face checkpoint folder or a GGUF file")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.partial-") as scratch:
        source = checkpoint
        if checkpoint.is_file():
            source = Path(scratch) / "checkpoint"
            write_float32_checkpoint(checkpoint, source)
        built = Path(scratch) / "model"
        argv = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(built)]
        argv += ["-p", precision, "-e", "cpu", "-c", str(Path(scratch) / "cache"), "--extra_options", "hf_token=false"]
        offline = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run(argv, capture_output=True, text=True, env=offline, check=False)
        if done.returncode != 0 or not (built / CONFIG).is_file():
            lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()] or ["no output"]
            raise RuntimeError(f"onnxruntime-genai's builder failed on {checkpoint}: {lines[-1].strip()}")
        try:
            built.rename(out)
        except OSError:
            if not (out / CONFIG).is_file():  # not a concurrent build of the same model that finished first
                raise
    return out


def write_float32_checkpoint(gguf: Path, out: Path) -> None:
    """``gguf`` as a Hugging Face folder (safetensors, config, tokenizer) of the float32 tensors that our engines
    load from it: transformers' dequantization, as ``load_checkpoint`` does it."""
    from transformers import AutoModelForCausalLM

    from specdec_trt.build_engines.checkpoint import load_tokenizer, load_transformers_model

    tokenizer = load_tokenizer(gguf)
    if tokenizer is None:
        raise ValueError(f"{gguf} holds no tokenizer, which onnxruntime-genai's builder needs")
    loaded = load_transformers_model(gguf)
    config = loaded.config
    del config.quantization_config  # transformers refuses to save a GGUF-loaded model; the tensors are plain
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def search_options(params: SamplingParams, max_length: int) -> dict[str, Any]:
    """``GeneratorParams.set_search_options`` for ``params``: every option that changes the tokens is given, so
    that none comes from the search defaults the builder copied from the checkpoint's generation config. Greedy
    is the argmax; sampling is onnxruntime-genai's own, with top_k 0 and top_p 1 off as ours. ``min_length``
    stays 0: onnxruntime-genai reaches it by masking EOS, which would change the tokens; ``ignore_eos`` is
    ``OrtGenaiRunner.run``'s."""
    if params.min_p:
        raise ValueError("onnxruntime-genai has no min-p filter: give min_p 0")
    options: dict[str, Any] = {
        "max_length": max_length,
        "min_length": 0,
        "num_beams": 1,
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "do_sample": not params.greedy,
    }
    if not params.greedy:
        options |= {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
        if params.seed is not None:
            options["random_seed"] = params.seed
    return options


class OrtGenaiRunner:
    """onnxruntime-genai's generation loop on one built model folder, on the CPU with ``threads`` intra-op
    threads (an overlay of the decoder's session options in genai_config.json). One ``og.Model`` serves every
    request: each run makes its own ``og.Generator``, so every prompt prefills into an empty KV cache."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        require_ort_genai()
        import onnxruntime_genai as og

        if not (Path(model_dir) / CONFIG).is_file():
            raise ValueError(f"{model_dir} is not an onnxruntime-genai model folder: it has no {CONFIG}")
        config = og.Config(str(model_dir))
        config.clear_providers()  # the CPU execution provider, whatever the folder was built for
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.context_length = int(json.loads((Path(model_dir) / CONFIG).read_text())["model"]["context_length"])

    def run(self, method: Method, prompt_ids: list[int], params: SamplingParams) -> tuple[Run, list[int]]:
        """Generate once; the run's figures and the generated token ids (an EOS included, as ours).

        The generator stops at EOS without putting it in its sequence: with ``ignore_eos`` the EOS is appended
        (one pass, as any token) and generation goes on. ``rounds`` are the target's passes after the prompt's
        (plain: one per token after the first; lookup: its verify and re-anchor passes and its plain steps, from
        its statistics, which leave out the passes of replaying the history after an appended EOS)."""
        import onnxruntime_genai as og

        lookup = prompt_lookup_length(method, MAX_DRAFTS, DRAFT_MODEL)
        max_length = len(prompt_ids) + params.max_new_tokens
        if not prompt_ids or max_length > self.context_length:
            raise ValueError(
                f"onnxruntime-genai needs a prompt of 1 token or more and at most {self.context_length} positions "
                f"for the prompt and the new tokens, not {len(prompt_ids)} + max_new_tokens {params.max_new_tokens}"
            )
        generator_params = og.GeneratorParams(self.model)
        generator_params.set_search_options(**search_options(params, max_length))
        if lookup is not None:
            generator_params.set_speculative_options(ngram_size=LOOKUP_NGRAM, max_draft_tokens=lookup)
        tokens: list[int] = []
        start = first_at = time.perf_counter()
        generator = og.Generator(self.model, generator_params)
        generator.append_tokens(prompt_ids)
        while len(tokens) < params.max_new_tokens:
            if generator.is_done():  # at an EOS: max_length is never reached before max_new_tokens
                if not params.ignore_eos:
                    break
                generator.append_tokens(tokens[-1:])
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            if len(tokens) == 1:
                first_at = time.perf_counter()
        total_s = time.perf_counter() - start
        if lookup is None:
            run = Run(len(tokens), total_s, first_at - start, rounds=len(tokens) - 1, accepted_tokens=0)
            return run, tokens
        stats = generator.get_speculative_stats()
        run = Run(
            generated_tokens=len(tokens),
            total_s=total_s,
            ttft_s=first_at - start,
            rounds=int(stats["target_forward_passes"] + stats["standard_fallback_steps"]),
            accepted_tokens=int(stats["draft_tokens_accepted"]),
            drafted_tokens=int(stats["draft_tokens_proposed"]),
        )
        return run, tokens
