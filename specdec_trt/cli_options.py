"""What the commands share on their command lines: the backend options (which models to open, and how),
the draft-length and number-list types, and the default engines built on first use."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from specdec_trt.build import PRESETS, STAGES, BuildRequest, build, default_engine_dir
from specdec_trt.build_engines.checkpoint import default_model_path
from specdec_trt.build_engines.manifest import SCHEMA_VERSION, Manifest, schema_version_of
from specdec_trt.build_engines.model import DTYPES
from specdec_trt.decoder import AUTO, DraftLength
from specdec_trt.draft_spec import DraftSpec
from specdec_trt.loading import LoadedModels, open_checkpoints, open_engine_directory

MAX_DRAFT_LENGTH = 64  # the most drafts per round a command line may ask for


class DraftLengthType(click.ParamType):
    """A number of drafts per round (an integer from 0 to ``MAX_DRAFT_LENGTH``) or "auto"."""

    name = "INTEGER|auto"

    def convert(self, value, param, ctx) -> DraftLength:
        text = str(value).strip()
        if text == AUTO:
            return AUTO
        if text.isascii() and text.isdigit() and int(text) <= MAX_DRAFT_LENGTH:
            return int(text)
        self.fail(
            f"{value!r} is neither a draft length (an integer from 0 to {MAX_DRAFT_LENGTH}) nor {AUTO!r}", param, ctx
        )


def number_list(kind: type, minimum: float):
    """A click callback parsing a comma-separated list of numbers >= minimum."""

    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple | None:
        if value is None:
            return None
        try:
            numbers = tuple(kind(item) for item in value.split(",") if item.strip())
        except ValueError as err:
            raise click.BadParameter(f"{value!r} is not a comma-separated list of {kind.__name__}s") from err
        if not numbers or any(not n >= minimum for n in numbers):
            raise click.BadParameter(f"{value!r}: give one or more values, each >= {minimum}")
        return tuple(dict.fromkeys(numbers))

    return parse


@dataclass(frozen=True)
class BackendOptions:
    """Which target to open: an engine directory on ONNX Runtime (``engines``), a checkpoint on the PyTorch
    engine (``target``; also the default model's checkpoint when only ``device`` is given), or, with neither,
    the default engines. The other fields tune one backend or the other."""

    engines: Path | None = None
    target: Path | None = None
    device: str | None = None
    dtype: str | None = None
    max_context: int | None = None
    threads: int | None = None
    enforce_eager: bool | None = None
    compile: bool | None = None

    @property
    def on_pytorch(self) -> bool:
        """Whether the PyTorch engine runs (a checkpoint, or a torch device asked for)."""
        return self.target is not None or (self.engines is None and self.device is not None)

    def check(self) -> None:
        """Options of the other backend are a usage error, never silently ignored."""
        if self.engines is not None and self.target is not None:
            raise click.UsageError("--engines and --target are alternatives: give one")
        wrong = () if self.on_pytorch else ("device", "dtype", "max_context", "enforce_eager", "compile")
        given = [f"--{name.replace('_', '-')}" for name in wrong if getattr(self, name) is not None]
        if given:
            verb = "does" if len(given) == 1 else "do"
            raise click.UsageError(f"{', '.join(given)} {verb} not apply to ONNX Runtime engines")

    def open(self, drafts: Sequence[DraftSpec], err: Console) -> LoadedModels:
        """Open the target and a drafter per draft (building the default engines first if needed)."""
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
        return open_engine_directory(self.resolved(err).engines, drafts, self.threads)

    def resolved(self, err: Console) -> BackendOptions:
        """These options with the default engines (built if needed) where neither backend was named."""
        if self.on_pytorch or self.engines is not None:
            return self
        return replace(self, engines=default_engines(err))


def backend_options(command: Callable) -> Callable:
    """Add the backend options to a click command, which receives them as one ``backend: BackendOptions``."""
    options = [
        click.option(
            "--engines",
            type=click.Path(exists=True, file_okay=False, path_type=Path),
            help="Engine directory built by specdec-build, run on ONNX Runtime (CPU). With neither --engines nor "
            "--target: the default engines (SmolLM2-135M-Instruct with its int4 self-draft), built on first use.",
        ),
        click.option(
            "--target",
            type=click.Path(exists=True, path_type=Path),
            help="Target checkpoint, run on the PyTorch engine: a Hugging Face directory (config.json + "
            "safetensors + tokenizer) or a .gguf file.",
        ),
        click.option(
            "--device",
            help="torch device for the PyTorch engine: cpu, cuda, cuda:1, ... Without --target it runs the "
            "default model's checkpoint. [default: cpu]",
        ),
        click.option(
            "--dtype",
            type=click.Choice(sorted(DTYPES)),
            help="Weight and KV dtype on the PyTorch engine. [default: float32]",
        ),
        click.option(
            "--max-context",
            type=click.IntRange(min=8),
            help="KV cache positions on the PyTorch engine; prompt + new tokens + draft tokens must fit. "
            "[default: the model's limit, at most 4096]",
        ),
        click.option(
            "--threads",
            type=click.IntRange(min=1),
            help="CPU threads: ONNX Runtime's intra-op pool, or torch's on the PyTorch engine. [default: one per core]",
        ),
        click.option(
            "--enforce-eager",
            is_flag=True,
            default=None,
            help="On a CUDA device: launch every kernel from Python instead of replaying CUDA graphs (slower; "
            "for debugging, as vLLM's --enforce-eager).",
        ),
        click.option(
            "--compile",
            is_flag=True,
            default=None,
            help="Compile the PyTorch engine's decoder layers with torch.compile, which fuses each layer's small "
            "kernels (faster steps on a GPU, after some seconds of compiling in the first steps).",
        ),
    ]
    names = [field.name for field in fields(BackendOptions)]

    @functools.wraps(command)
    def wrapper(**kwargs):
        backend = BackendOptions(**{name: kwargs.pop(name) for name in names})
        backend.check()
        return command(backend=backend, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def default_engines(err: Console) -> Path:
    """The default engines, built into the cache directory on first use, and again when the cached ones were
    built by a specdec-trt whose engine layout differs (another schema version)."""
    directory = default_engine_dir()
    version = schema_version_of(directory)
    if version != SCHEMA_VERSION:
        why = "first use only" if version is None else f"the cached ones have schema version {version}"
        err.print(f"Building the default engines into {directory} ({why})…")
        build_with_progress(BuildRequest(out=directory, force=True, **PRESETS["smollm2-135m"]), err)
    return directory


def build_with_progress(request: BuildRequest, err: Console) -> Manifest:
    """Build an engine directory under a progress bar of its stages."""
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("build", total=len(STAGES))

        def on_stage(stage: str) -> None:
            progress.update(task, completed=STAGES.index(stage), description=stage)

        manifest = build(request, on_stage)
        progress.update(task, completed=len(STAGES), description="done")
    return manifest
