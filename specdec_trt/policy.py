"""The defaults, decided in one place for the Python API and every command: which draft a decoder opens, how
many tokens it drafts a round, and where the default engines live and when they must be built again.

- Draft: lookup-first ("ngram+engine") for an engine directory with a draft of its own, prompt lookup ("ngram")
  otherwise, on both backends.
- Draft length: "auto" for that default lookup-first draft; otherwise ``DEFAULT_NUM_DRAFT_TOKENS``, at most what
  the target's verify pass was built for; 0 without a draft. A draft length without a draft is an error.
- Default engines: the smollm2-135m preset, built into the cache directory on first use and rebuilt when the
  cached ones cannot be used.

Nothing here prints: callers show what they are told through callbacks and return values.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_engines.manifest import MANIFEST_NAME, EngineDirectoryError, read_manifest
from specdec_trt.build_lock import build_lock
from specdec_trt.build_request import PRESETS, BuildRequest, cache_root
from specdec_trt.draft_spec import AUTO, ENGINE, LOOKUP_FIRST, NGRAM, DraftLength, DraftSpec
from specdec_trt.validation import ConflictingOptionsError

if TYPE_CHECKING:
    from specdec_trt.runtime.engine import Engine

DEFAULT_NUM_DRAFT_TOKENS = 5  # a fixed draft length where "auto" is not the default
MAX_DRAFT_LENGTH = 64  # the most drafts per round a command line or a server request may ask for
# What engines with a draft of their own run by default, with the draft length chosen every round: prompt lookup
# where the text repeats itself, the engines' own draft elsewhere (docs/BENCHMARKS.md compares it with each alone).
ENGINES_DEFAULT_DRAFT = LOOKUP_FIRST + ENGINE
ENGINES_DEFAULT_DRAFT_LENGTH: DraftLength = AUTO
DEFAULT_PRESET = "smollm2-135m"  # what the default engines are built from
DEFAULT_DRAFT = "default"  # a draft argument that asks for the draft chosen here


class DraftLengthWithoutDraftError(ConflictingOptionsError):
    """A draft length above 0 was asked for together with plain decoding (no draft)."""

    def __init__(self, num_draft_tokens: DraftLength) -> None:
        super().__init__(f"num_draft_tokens={num_draft_tokens!r} needs a draft: draft 'none' is plain decoding")
        self.num_draft_tokens = num_draft_tokens


def has_own_draft(directory: Path) -> bool:
    """Whether an engine directory was built with a draft of its own (its manifest says so)."""
    return read_manifest(directory, verify_files=False).draft is not None


def choose_draft(
    engines: Path | None, draft: str | Path | DraftSpec | None, num_draft_tokens: DraftLength | None
) -> tuple[DraftSpec, DraftLength | None]:
    """The draft a decoder opens on ``engines`` (an engine directory; None: a checkpoint) and its draft length
    where this choice already decides it (None: ``draft_length_for`` decides once the target is open).
    ``draft`` ``DEFAULT_DRAFT`` is the default draft, which comes with "auto" when it is lookup-first; None and
    "none" are plain decoding."""
    if draft == DEFAULT_DRAFT:
        own = engines is not None and has_own_draft(engines)
        draft = ENGINES_DEFAULT_DRAFT if own else NGRAM
        if own and num_draft_tokens is None:
            num_draft_tokens = ENGINES_DEFAULT_DRAFT_LENGTH
    spec = DraftSpec.parse(draft)
    if not spec.drafts and num_draft_tokens:
        raise DraftLengthWithoutDraftError(num_draft_tokens)
    return spec, num_draft_tokens


def default_draft_length(target: Engine) -> int:
    """``DEFAULT_NUM_DRAFT_TOKENS``, or fewer when the target's verify pass was built for fewer."""
    built_for = target.max_draft_len
    return DEFAULT_NUM_DRAFT_TOKENS if built_for is None else min(DEFAULT_NUM_DRAFT_TOKENS, built_for)


def draft_length_for(target: Engine, drafts: bool, num_draft_tokens: DraftLength | None) -> DraftLength:
    """``num_draft_tokens``, or the default for the opened ``target`` (0 when nothing ``drafts``)."""
    if num_draft_tokens is not None:
        return num_draft_tokens
    return default_draft_length(target) if drafts else 0


def is_engines_default(draft: str | DraftSpec, num_draft_tokens: DraftLength) -> bool:
    """Whether a drafter (a label such as "ngram+int4", or a spec) and its draft length are what an engine
    directory with a draft of its own opens by default, whatever its own draft is called."""
    spec, default = DraftSpec.parse(draft), DraftSpec.parse(ENGINES_DEFAULT_DRAFT)
    return spec.lookup == default.lookup and spec.is_own and num_draft_tokens == ENGINES_DEFAULT_DRAFT_LENGTH


def default_engine_dir() -> Path:
    """Where the default engines live, under the cache root (``$SPECDEC_CACHE`` or ~/.cache/specdec-trt)."""
    return cache_root() / "engines" / DEFAULT_PRESET


def cached_engines_problem(directory: Path) -> str | None:
    """Why the cached default engines in ``directory`` cannot be used (None: their manifest says they can, and
    where they were built from the preset's model, they were built with its context and draft length: an older
    release's are rebuilt)."""
    if not (directory / MANIFEST_NAME).is_file():
        return "first use only"
    try:
        built = read_manifest(directory, verify_files=False).target
    except EngineDirectoryError as error:
        return f"the cached ones are unusable: {error}"
    preset = PRESETS[DEFAULT_PRESET]
    if built.source != str(preset["target"] or default_model_path()):
        return None  # engines of another model put in place of the default ones: used as they are
    for name in ("max_context", "max_draft_len"):
        if getattr(built, name) != preset[name]:
            return f"the cached ones have {name} {getattr(built, name)}, the {DEFAULT_PRESET} preset {preset[name]}"
    return None


def default_engines(
    build: Callable[[BuildRequest, str], object], on_wait: Callable[[Path], None], broken: str | None = None
) -> Path:
    """The default engines' directory, built on first use and built again when the cached ones cannot be used
    (another schema version, an edited manifest, or ``broken``: why opening them failed). ``build(request,
    why)`` builds them; ``on_wait(directory)`` tells that another process is building them, which this one
    waits for before using its engines, so concurrent first uses build once."""
    directory = default_engine_dir()
    if (broken or cached_engines_problem(directory)) is None:
        return directory
    with build_lock(directory, lambda: on_wait(directory)):
        problem = broken or cached_engines_problem(directory)
        if problem is not None:
            build(BuildRequest(out=directory, force=True, **PRESETS[DEFAULT_PRESET]), problem)
    return directory
