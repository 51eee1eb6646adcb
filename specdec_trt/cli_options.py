"""What the commands share on their command lines: the backend options (which models to open, and how),
the draft-length and number-list types, and the default engines built on first use."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from specdec_trt.build import PRESETS, STAGES, BuildRequest, build, default_engine_dir
from specdec_trt.build_engines.checkpoint import default_model_path
from specdec_trt.build_engines.manifest import MANIFEST_NAME, EngineDirectoryError, Manifest, read_manifest
from specdec_trt.build_engines.model import DTYPES
from specdec_trt.build_lock import build_lock
from specdec_trt.decoder import AUTO, DraftLength, default_draft_length
from specdec_trt.draft_spec import ENGINE, LOOKUP_FIRST, NGRAM, DraftSpec
from specdec_trt.loading import LoadedModels, open_checkpoints, open_engine_directory
from specdec_trt.runtime.ort_engine import GraphMismatchError
from specdec_trt.validation import MAX_SEED, InvalidValueError, check_threads

MAX_DRAFT_LENGTH = 64  # the most drafts per round a command line may ask for
DEBUG_ENV = "SPECDEC_DEBUG"
# What a user's input or environment can cause: our own errors are ValueError subclasses (our TypeErrors
# too), UnicodeDecodeError is undecodable input, OSError a path that is missing, unreadable or unwritable.
USER_ERRORS = (ValueError, OSError)


class Command(click.Command):
    """A click command whose user errors end in one line, ``Error: ...`` with exit status 1, never a
    traceback; ``--debug`` (or ``SPECDEC_DEBUG=1``) lets the traceback through for a bug report."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("context_settings", {"help_option_names": ["-h", "--help"], "show_default": True})
        super().__init__(*args, **kwargs)
        self.params.append(
            click.Option(
                ["--debug"],
                is_flag=True,
                expose_value=False,
                is_eager=True,
                callback=_remember_debug,
                help=f"Show the full traceback of an error (for a bug report); {DEBUG_ENV}=1 does the same.",
            )
        )

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as error:
            if ctx.meta.get(DEBUG_ENV) or os.environ.get(DEBUG_ENV, "0") not in ("", "0"):
                raise
            raise click.ClickException(describe(error)) from error


def _remember_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    ctx.meta[DEBUG_ENV] = value


def describe(error: BaseException) -> str:
    """One line for a user error: its message, or for an OSError the path, the reason and the fix."""
    if isinstance(error, OSError) and error.strerror:
        where = f"{error.filename}: " if error.filename is not None else ""
        return f"{where}{error.strerror.lower()}: check the path and its permissions"
    return " ".join(str(error).split()) or type(error).__name__


class ThreadCount(click.ParamType):
    """A number of CPU threads, from 1 to this machine's cores (more only take turns on them)."""

    name = "INTEGER"

    def convert(self, value, param, ctx) -> int:
        try:
            count = int(value)
        except ValueError:
            self.fail(f"{value!r} is not an integer", param, ctx)
        try:
            return check_threads(count, os.cpu_count() or 1)
        except InvalidValueError as error:
            self.fail(str(error), param, ctx)


class FiniteFloat(click.FloatRange):
    """A ``click.FloatRange`` that also refuses inf and nan."""

    def convert(self, value, param, ctx) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


SEED = click.IntRange(0, MAX_SEED)  # what torch's generators take

# What engines with a draft run by default, with the draft length chosen every round: prompt lookup where the
# text repeats itself, the engines' own draft elsewhere (docs/BENCHMARKS.md compares it with each alone).
ENGINES_DEFAULT_DRAFT = LOOKUP_FIRST + ENGINE


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
        if not numbers or any(not (math.isfinite(n) and n >= minimum) for n in numbers):
            raise click.BadParameter(f"{value!r}: give one or more finite values, each >= {minimum}")
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
    is_default: bool = False  # ``engines`` are the default engines, filled in by ``resolved``

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
        directory = self.resolved(err).engines
        try:
            return open_engine_directory(directory, drafts, self.threads)
        except (EngineDirectoryError, GraphMismatchError) as error:
            if self.engines is not None and not self.is_default:
                raise
            default_engines(err, broken=str(error))
            return open_engine_directory(directory, drafts, self.threads)

    def resolved(self, err: Console) -> BackendOptions:
        """These options with the default engines (built if needed) where neither backend was named."""
        if self.on_pytorch or self.engines is not None:
            return self
        return replace(self, engines=default_engines(err), is_default=True)


def default_draft(
    backend: BackendOptions, draft: str | None, num_draft_tokens: DraftLength | None
) -> tuple[DraftSpec, DraftLength | None]:
    """The draft a command opens (``--draft``, or by default lookup-first with auto for engines that have
    a draft of their own, else prompt lookup) and its draft length if already decided; ``backend`` must be
    resolved. A draft length without a draft is a usage error."""
    spec = DraftSpec.parse(draft)
    if draft is None:
        own = backend.engines is not None and read_manifest(backend.engines, verify_files=False).draft is not None
        spec = DraftSpec.parse(ENGINES_DEFAULT_DRAFT if own else NGRAM)
        if own and num_draft_tokens is None:
            num_draft_tokens = AUTO
    if not spec.drafts and num_draft_tokens:
        raise click.UsageError(f"-k {num_draft_tokens} needs a draft: --draft none is plain decoding")
    return spec, num_draft_tokens


def draft_length_for(loaded: LoadedModels, spec: DraftSpec, num_draft_tokens: DraftLength | None) -> DraftLength:
    """``num_draft_tokens``, or the default for the opened target (0 without a draft)."""
    if num_draft_tokens is not None:
        return num_draft_tokens
    return default_draft_length(loaded.target) if spec.drafts else 0


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
            type=ThreadCount(),
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
    names = [field.name for field in fields(BackendOptions) if field.name != "is_default"]

    @functools.wraps(command)
    def wrapper(**kwargs):
        backend = BackendOptions(**{name: kwargs.pop(name) for name in names})
        backend.check()
        return command(backend=backend, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def default_engines(err: Console, broken: str | None = None) -> Path:
    """The default engines, built into the cache directory on first use, and built again (saying why) when
    the cached ones cannot be used: another schema version, an edited manifest, or ``broken`` (why opening
    them failed). Concurrent first uses build once: the others wait for the build, then use its engines."""
    directory = default_engine_dir()
    problem = broken or _unusable(directory)
    if problem is None:
        return directory

    def wait() -> None:
        err.print(f"Another process is building the default engines into {directory}; waiting for it…")

    with build_lock(directory, wait):
        problem = broken or _unusable(directory)
        if problem is not None:
            err.print(f"Building the default engines into {directory} ({problem})…")
            build_with_progress(BuildRequest(out=directory, force=True, **PRESETS["smollm2-135m"]), err)
    return directory


def _unusable(directory: Path) -> str | None:
    """Why the cached default engines cannot be used (None: their manifest says they can)."""
    if not (directory / MANIFEST_NAME).is_file():
        return "first use only"
    try:
        read_manifest(directory, verify_files=False)
    except EngineDirectoryError as error:
        return f"the cached ones are unusable: {error}"
    return None


def build_with_progress(request: BuildRequest, err: Console) -> Manifest:
    """Build an engine directory under a progress bar of its stages (saying so if another build of the
    same directory makes it wait)."""
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

        def on_wait() -> None:
            progress.console.print(f"Another specdec-build is writing {request.out}; waiting for it to finish…")

        manifest = build(request, on_stage, on_wait)
        progress.update(task, completed=len(STAGES), description="done")
    return manifest
