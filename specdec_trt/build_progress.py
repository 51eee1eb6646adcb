"""Builds shown on a console: an engine build's stages under a progress bar, and the default engines that
``specdec_trt.policy`` decides to build, with a line saying why (or that another process is building them)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from specdec_trt.build_engines.manifest import Manifest
from specdec_trt.build_request import BuildRequest
from specdec_trt.policy import default_engines


def build_with_progress(request: BuildRequest, err: Console) -> Manifest:
    """Build an engine directory under a progress bar of its stages (saying so if another build of the
    same directory makes it wait)."""
    from specdec_trt.build import STAGES, build  # the export pipeline: only when something is built

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("build", total=len(STAGES) + 1)

        def on_stage(stage: str) -> None:
            progress.update(task, completed=STAGES.index(stage), description=stage)

        def on_wait() -> None:
            progress.console.print(f"Another specdec-build is writing {request.out}; waiting for it to finish…")

        manifest = build(request, on_stage, on_wait)
        progress.update(task, completed=len(STAGES), description="profile")
        profile_built(request.out)
        progress.update(task, completed=len(STAGES) + 1, description="done")
    return manifest


def profile_built(directory: Path) -> None:
    """Time the engines just built with their default drafter, at every number of rows a decoder runs, and keep
    the profile beside them (``specdec_trt.profile_cache``): later decoders on this machine start from it."""
    from specdec_trt.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder.from_engines(directory)
    try:
        decoder.profile()
    finally:
        decoder.close()


def default_engines_shown(err: Console, broken: str | None = None) -> Path:
    """The default engines' directory, built first where the policy says so (``broken``: why opening the
    cached ones failed), telling ``err`` why, under a progress bar."""

    def build_them(request: BuildRequest, why: str) -> None:
        err.print(f"Building the default engines into {request.out} ({why})…")
        build_with_progress(request, err)

    def wait(directory: Path) -> None:
        err.print(f"Another process is building the default engines into {directory}; waiting for it…")

    return default_engines(build_them, wait, broken)
