"""Which target a command or a server opens, as plain data: an engine directory on ONNX Runtime, a checkpoint on
the PyTorch engine, or the default engines (``specdec_trt.policy`` says where they live and when to build them).
Options that contradict each other are refused when the options are made. The engines' packages (torch, ONNX
Runtime) are imported only to open them, so that a command parses and refuses its options at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_engines.manifest import EngineDirectoryError
from specdec_trt.draft_spec import DraftSpec
from specdec_trt.validation import ConflictingOptionsError

if TYPE_CHECKING:
    from rich.console import Console

    from specdec_trt.loading import LoadedModels

DTYPE_NAMES = ("bfloat16", "float16", "float32")  # of the PyTorch engine: build_engines.model.DTYPES, without torch
ONNX_RUNTIME_UNUSED = ("device", "dtype", "max_context", "enforce_eager", "compile")  # PyTorch engine options


@dataclass(frozen=True)
class BackendOptions:
    """Which target to open: an engine directory on ONNX Runtime (``engines``), a checkpoint on the PyTorch
    engine (``target``; also the default model's checkpoint when only ``device`` is given), or, with neither,
    the default engines. The other fields tune one backend or the other; options of the other backend raise
    ``ConflictingOptionsError``, never silently ignored."""

    engines: Path | None = None
    target: Path | None = None
    device: str | None = None
    dtype: str | None = None
    max_context: int | None = None
    threads: int | None = None
    enforce_eager: bool | None = None
    compile: bool | None = None
    is_default: bool = False  # ``engines`` are the default engines, filled in by ``resolved``

    def __post_init__(self) -> None:
        if self.engines is not None and self.target is not None:
            raise ConflictingOptionsError("--engines and --target are alternatives: give one")
        wrong = () if self.on_pytorch else ONNX_RUNTIME_UNUSED
        given = [f"--{name.replace('_', '-')}" for name in wrong if getattr(self, name) is not None]
        if given:
            verb = "does" if len(given) == 1 else "do"
            raise ConflictingOptionsError(f"{', '.join(given)} {verb} not apply to ONNX Runtime engines")

    @property
    def on_pytorch(self) -> bool:
        """Whether the PyTorch engine runs (a checkpoint, or a torch device asked for)."""
        return self.target is not None or (self.engines is None and self.device is not None)

    def resolved(self, err: Console) -> BackendOptions:
        """These options with the default engines (built first if needed, shown on ``err``) where neither
        backend was named."""
        from specdec_trt.build_progress import default_engines_shown  # the build pipeline: torch, ONNX

        if self.on_pytorch or self.engines is not None:
            return self
        return replace(self, engines=default_engines_shown(err), is_default=True)

    def open(self, drafts: Sequence[DraftSpec], err: Console) -> LoadedModels:
        """Open the target and a drafter per draft (building the default engines first if needed, and again
        if the cached ones fail to open)."""
        import torch

        from specdec_trt.build_engines.model import DTYPES
        from specdec_trt.build_progress import default_engines_shown
        from specdec_trt.loading import open_checkpoints, open_engine_directory
        from specdec_trt.runtime.ort_engine import GraphMismatchError

        if self.on_pytorch:
            if self.threads:
                torch.set_num_threads(self.threads)
            return open_checkpoints(
                self.target or default_model_path(),
                drafts,
                self.device or "cpu",
                DTYPES[self.dtype or "float32"],
                self.max_context,
                cuda_graphs=False if self.enforce_eager else None,
                compiled=bool(self.compile),
            )
        directory = self.resolved(err).engines
        try:
            return open_engine_directory(directory, drafts, self.threads)
        except (EngineDirectoryError, GraphMismatchError) as error:
            if self.engines is not None and not self.is_default:
                raise
            default_engines_shown(err, broken=str(error))
            return open_engine_directory(directory, drafts, self.threads)
