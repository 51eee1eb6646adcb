"""The build pipeline behind ``specdec-build``: checkpoints in, a verified engine directory out.

Stages: load, export target, export draft, quantize, optimise, verify, write. Everything that can be
refused (an existing output directory, a draft with another vocabulary, a context or draft length the
model cannot take, an architecture the exporter cannot run) is refused before the first long stage.
The directory is assembled under ``<out>.partial`` and renamed into place only after it verified.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import onnxruntime as ort
import torch

from specdec_trt import __version__
from specdec_trt.build_engines.checkpoint import Checkpoint, load_checkpoint, read_header
from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_engines.manifest import ENGINE_DTYPES, MANIFEST_NAME, Manifest, ModelEntry, write_manifest
from specdec_trt.build_engines.model import DTYPES, CompactDecoder, ModelConfig
from specdec_trt.build_engines.onnx_export import INT4_BLOCK_SIZE, OPSET, check_exportable, export_onnx, quantize_int4
from specdec_trt.build_lock import build_lock
from specdec_trt.build_request import QUANTIZATIONS, BuildRequest
from specdec_trt.draft_spec import INT4, NONE
from specdec_trt.loading import check_same_vocabulary, model_spec
from specdec_trt.runtime.ort_engine import OrtEngine, session_options
from specdec_trt.runtime.torch_engine import TorchEngine

STAGES = ("load", "export target", "export draft", "quantize", "optimise", "verify", "write")
MAX_DRAFT_LEN_LIMIT = 32
VERIFY_TOLERANCE = {"float32": 1e-3, "float16": 5e-2}


class BuildError(ValueError):
    """The requested build cannot be done; nothing was written."""


def check_request(request: BuildRequest) -> tuple[ModelConfig, ModelConfig | None]:
    """Every refusal that needs no weights: returns the target's and the draft checkpoint's configs."""
    if request.dtype not in ENGINE_DTYPES:
        raise BuildError(f"dtype {request.dtype!r} is not supported: choose {' or '.join(ENGINE_DTYPES)}")
    for role, quantization in (("target", request.target_quantization), ("draft", request.draft_quantization)):
        if quantization not in QUANTIZATIONS:
            choices = " or ".join(QUANTIZATIONS)
            raise BuildError(f"{role} quantization {quantization!r} is not supported: choose {choices}")
    if request.draft_quantization != "none" and str(request.draft) in (INT4, NONE):
        raise BuildError(
            f"--draft-quantization applies to a draft checkpoint, not to --draft {request.draft}"
            + (" (already the target quantized to int4)" if str(request.draft) == INT4 else "")
        )
    if request.target_quantization == "int4" and str(request.draft) == INT4:
        raise BuildError(
            "the int4 self-draft of an int4 target would be the target itself: give a draft checkpoint, or "
            "--draft none (prompt lookup needs no draft engine)"
        )
    check_out(request.out, request.force)
    target_header = read_header(_target_path(request))
    target = target_header.config
    check_exportable(target)
    if not 1 <= request.max_draft_len <= MAX_DRAFT_LEN_LIMIT:
        raise BuildError(f"--max-draft-len must be in [1, {MAX_DRAFT_LEN_LIMIT}], got {request.max_draft_len}")
    if request.max_context > target.max_context:
        raise BuildError(f"--max-context {request.max_context} exceeds what the target supports ({target.max_context})")
    if request.max_context < request.max_draft_len + 2:
        raise BuildError(
            f"--max-context {request.max_context} leaves no room for a prompt and {request.max_draft_len} drafts"
        )
    draft = None
    if str(request.draft) not in (INT4, NONE):
        draft_header = read_header(request.draft)
        draft = draft_header.config
        check_exportable(draft)
        check_same_vocabulary(target_header, draft_header)
        if request.max_context > draft.max_context:
            raise BuildError(
                f"--max-context {request.max_context} exceeds what the draft supports ({draft.max_context})"
            )
    return target, draft


def check_out(out: Path, force: bool) -> None:
    """``out`` may be written: absent or empty, or (with ``force``) an engine directory to replace. A
    directory without a manifest may hold anything, so ``force`` never deletes one."""
    if out.exists() and not out.is_dir():
        raise BuildError(f"--out {out} is a file, not a directory: choose a directory path for --out")
    if not out.exists() or not any(out.iterdir()):
        return
    if not force:
        raise BuildError(f"{out} exists and is not empty: choose another --out or pass --force to replace it")
    if not (out / MANIFEST_NAME).is_file():
        raise BuildError(
            f"{out} holds no {MANIFEST_NAME}, so it is not an engine directory and --force will not delete it: "
            "choose another --out, or empty it yourself"
        )


def build(
    request: BuildRequest,
    on_stage: Callable[[str], None] = lambda stage: None,
    on_wait: Callable[[], None] = lambda: None,
) -> Manifest:
    """Build an engine directory; ``on_stage`` is called as each stage starts (for a progress bar), and
    ``on_wait`` if another build into the same directory makes this one wait for it to finish."""
    check_request(request)
    waited = []
    with build_lock(request.out, lambda: (waited.append(True), on_wait())), _terminate_as_interrupt():
        if waited:
            try:
                check_out(request.out, request.force)
            except BuildError as error:
                raise BuildError(f"another build wrote {request.out} while this one waited: {error}") from None
        staging = request.out.with_name(request.out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)  # left by a build that was killed
        try:
            manifest = _build_into(staging, request, on_stage)
            if request.out.exists():
                shutil.rmtree(request.out)
            staging.rename(request.out)
            return manifest
        finally:
            shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the build as Ctrl-C does, unwinding so that the staging directory is removed (in the
    main thread, unless the program handles SIGTERM itself)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _build_into(directory: Path, request: BuildRequest, on_stage: Callable[[str], None]) -> Manifest:
    dtype = DTYPES[request.dtype]
    on_stage("load")
    target = load_checkpoint(_target_path(request))
    draft = None if str(request.draft) in (INT4, NONE) else load_checkpoint(request.draft)
    target_model = _compact(target, request.max_context)
    draft_model = _compact(draft, request.max_context) if draft is not None else None
    on_stage("export target")
    export_onnx(target_model, directory / "raw" / "target.onnx", dtype)
    on_stage("export draft")
    if draft_model is not None:
        export_onnx(draft_model, directory / "raw" / "draft.onnx", dtype)
    on_stage("quantize")
    if request.draft == INT4:
        quantize_int4(directory / "raw" / "target.onnx", directory / "raw" / "draft.onnx")
    roles = ["target"] + ([] if request.draft == NONE else ["draft"])
    graphs = {role: directory / "raw" / f"{role}.onnx" for role in roles}
    quantized = {role for role in roles if getattr(request, f"{role}_quantization") == "int4"}
    for role in quantized:
        graphs[role] = directory / "raw" / f"{role}-int4.onnx"
        quantize_int4(directory / "raw" / f"{role}.onnx", graphs[role])
    on_stage("optimise")
    for role in roles:
        _optimise(graphs[role], directory / role / "model.onnx")
    shutil.rmtree(directory / "raw")
    on_stage("verify")
    int4 = f"int4-block{INT4_BLOCK_SIZE}"
    entries = {"target": _entry(request, target, "target", int4 if "target" in quantized else "none")}
    if draft is not None:
        entries["draft"] = _entry(request, draft, "draft", int4 if "draft" in quantized else "none")
    elif request.draft == INT4:
        entries["draft"] = _entry(request, target, "draft", int4)
    # A quantized graph cannot match the float model's logits: it must load and score every position.
    for role, model in (("target", target_model), ("draft", draft_model)):
        if role in entries:
            if model is None or role in quantized:
                _verify_runs(directory, entries[role])
            else:
                _verify(directory, entries[role], model, request)
    on_stage("write")
    tokenizer = target.tokenizer
    if tokenizer is not None:
        tokenizer.save_pretrained(directory / "tokenizer")
    # specdec-trt's own version from the package itself: it also runs from a source tree with no install.
    versions = {"specdec-trt": __version__} | {
        name: version(name) for name in ("torch", "onnx", "onnxruntime", "transformers")
    }
    kind = str(request.draft) if str(request.draft) in (INT4, NONE) else "model"
    return write_manifest(directory, entries["target"], entries.get("draft"), kind, versions)


def _target_path(request: BuildRequest) -> Path:
    return Path(request.target) if request.target is not None else default_model_path()


def _compact(checkpoint: Checkpoint, max_context: int) -> CompactDecoder:
    model = CompactDecoder(checkpoint.config, max_context)
    model.load_weights(checkpoint.state_dict)
    return model.eval()


def _optimise(source: Path, destination: Path) -> None:
    """Save ONNX Runtime's extended graph optimisations (hardware-independent) so loading needs none."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(destination)
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", destination.name + ".data"
    )
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])


def _entry(request: BuildRequest, checkpoint: Checkpoint, role: str, quantization: str) -> ModelEntry:
    config = checkpoint.config
    return ModelEntry(
        graph=f"{role}/model.onnx",
        dtype=request.dtype,
        quantization=quantization,
        max_context=request.max_context,
        max_draft_len=request.max_draft_len,
        opset=OPSET,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        eos_token_ids=list(config.eos_token_ids),
        source=str(checkpoint.source),
        architecture=json.loads(config.hf_config.to_json_string()),
    )


def _verify(directory: Path, entry: ModelEntry, model: CompactDecoder, request: BuildRequest) -> None:
    """An exported graph must give the compact model's logits: a prompt, then a full verify block (a
    vocabulary-pruned draft's -inf logits included)."""
    engine = OrtEngine(model_spec(directory, entry))
    reference = TorchEngine(model)
    generator = torch.Generator().manual_seed(0)
    prompt_length = min(12, entry.max_context - entry.max_draft_len - 1)  # check_request leaves room for 1
    prompt = torch.randint(0, entry.vocab_size, (1, prompt_length), generator=generator)
    block = torch.randint(0, entry.vocab_size, (1, request.max_draft_len + 1), generator=generator)
    lengths = torch.tensor([prompt.shape[1]])
    pairs = [
        (engine.prefill(prompt, lengths), reference.prefill(prompt, lengths)),
        (engine.forward(block), reference.forward(block)),
    ]
    error = max(_logit_error(ours, theirs.float()) for ours, theirs in pairs)
    if error > VERIFY_TOLERANCE[request.dtype]:
        role = entry.graph.split("/")[0]
        raise BuildError(f"the exported {role}'s logits differ from the model's by {error:.2e}: the export is wrong")


def _logit_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference of the finite logits; infinite where the -inf entries differ."""
    if not torch.equal(torch.isinf(ours), torch.isinf(theirs)):
        return float("inf")
    finite = torch.isfinite(theirs)
    return float((ours[finite] - theirs[finite]).abs().max())


def _verify_runs(directory: Path, entry: ModelEntry) -> None:
    """A quantized graph loads and scores a prompt and a full verify block: no NaN or +inf, and every
    position has a finite best score (a vocabulary-pruned model gives -inf outside its vocabulary)."""
    engine = OrtEngine(model_spec(directory, entry))
    logits = engine.prefill(torch.tensor([[1, 2, 3]]), torch.tensor([3]))
    logits = torch.cat([logits, engine.forward(torch.tensor([[4] * (entry.max_draft_len + 1)]))[0]])
    if not bool(logits.amax(-1).isfinite().all()):  # the maximum carries any NaN or +inf, and is -inf only if all are
        raise BuildError(f"the {entry.graph.split('/')[0]} graph produced non-finite logits")
