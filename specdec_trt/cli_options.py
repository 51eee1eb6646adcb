"""Click plumbing the commands share: the command class that turns user errors into one line, the parameter
types (draft lengths, threads, finite floats, number lists) and the decorator that fills ``BackendOptions``."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import click

from specdec_trt.backend import DTYPE_NAMES, BackendOptions
from specdec_trt.draft_spec import AUTO, DraftLength
from specdec_trt.policy import MAX_DRAFT_LENGTH, DraftLengthWithoutDraftError
from specdec_trt.validation import MAX_SEED, ConflictingOptionsError, InvalidValueError, check_threads

DEBUG_ENV = "SPECDEC_DEBUG"
# What a user's input or environment can cause: our own errors are ValueError subclasses (our TypeErrors
# too), UnicodeDecodeError is undecodable input, OSError a path that is missing, unreadable or unwritable.
USER_ERRORS = (ValueError, OSError)


class Command(click.Command):
    """A click command whose user errors end in one line, ``Error: ...`` with exit status 1, never a
    traceback (options that conflict are usage errors, exit status 2); ``--debug`` (or ``SPECDEC_DEBUG=1``)
    lets the traceback of the others through for a bug report."""

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
        except DraftLengthWithoutDraftError as error:
            message = f"-k {error.num_draft_tokens} needs a draft: --draft none is plain decoding"
            raise click.UsageError(message, ctx) from error
        except ConflictingOptionsError as error:
            raise click.UsageError(str(error), ctx) from error
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


SEED = click.IntRange(0, MAX_SEED)  # an unsigned 64-bit integer


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
            type=click.Choice(DTYPE_NAMES),
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
        backend = BackendOptions(**{name: kwargs.pop(name) for name in names})  # a conflict is a usage error
        return command(backend=backend, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper
