"""Opening a target engine and its drafters from what the user names: an engine directory (ONNX Runtime) or
checkpoints (PyTorch). The Python API, specdec-run and specdec-bench all open their models here."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdec_trt.build_engines.checkpoint import Checkpoint, load_checkpoint, load_tokenizer, read_header
from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_engines.manifest import MANIFEST_NAME, Manifest, ModelEntry, read_manifest
from specdec_trt.build_engines.verified_files import VerifiedFiles
from specdec_trt.build_request import cache_root
from specdec_trt.draft_spec import ENGINE, INT4, LOOKUP_FIRST, NGRAM, DraftSpec
from specdec_trt.draft_store import DraftStore
from specdec_trt.drafting import Drafter, LookupFirstDrafter, ModelDrafter, PromptLookupDrafter
from specdec_trt.runtime.engine import Engine
from specdec_trt.runtime.ort_engine import OrtEngine, OrtModelSpec
from specdec_trt.runtime.torch_engine import TorchEngine
from specdec_trt.validation import InvalidValueError, check_threads

VERIFIED_FILES = "verified-files.json"  # in the cache directory: engine files checked and unchanged since


class VocabularyMismatchError(ValueError):
    """Target and draft do not share one vocabulary, so draft token ids would mean other tokens."""


@dataclass
class LoadedModels:
    """A target engine with one drafter per draft asked for, keyed by label ("ngram", "int4", "engine", a
    directory's name, "ngram+..."), and what callers need to know about them."""

    target: Engine
    tokenizer: PreTrainedTokenizerBase | None
    eos_token_ids: list[int]
    drafters: dict[str, Drafter] = field(default_factory=dict)
    target_checkpoint: Path | None = None  # the checkpoint the target was made from (transformers' peers load it)
    draft_checkpoints: dict[str, Path] = field(default_factory=dict)  # label -> checkpoint of a model draft
    engine_dir: Path | None = None  # the engine directory opened (None: checkpoints)
    threads: int | None = None  # ONNX Runtime's intra-op threads, for an engine directory

    @property
    def max_context(self) -> int:
        """The longest sequence the target and every drafter can follow."""
        limits = [self.target.max_context] + [d.max_context for d in self.drafters.values() if d.max_context]
        return min(limits)

    def only_drafter(self) -> Drafter | None:
        """The drafter of a single-draft load (None for plain decoding)."""
        if len(self.drafters) > 1:
            raise InvalidValueError(f"{len(self.drafters)} drafters were loaded; name the one you want")
        return next(iter(self.drafters.values()), None)


def check_same_vocabulary(target: Checkpoint, draft: Checkpoint) -> None:
    """Refuse a draft whose vocabulary (size, or token-to-id map when both have tokenizers) differs."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise VocabularyMismatchError(
            f"the draft {draft.source} has {draft.config.vocab_size} token ids but the target {target.source} "
            f"has {target.config.vocab_size}: pick a draft trained with the target's tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise VocabularyMismatchError(
                f"the draft {draft.source} and the target {target.source} have different tokenizers "
                "(same size, different token-to-id maps): pick a draft trained with the target's tokenizer"
            )


def usable_device(name: torch.device | str) -> torch.device:
    """The torch device called ``name``, or a ValueError when it is malformed or absent here."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise InvalidValueError(f"{name!r} is not a torch device (try cpu or cuda): {err}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidValueError(f"device {device} was asked for, but this torch build sees no CUDA device")
    return device


def open_checkpoints(
    target: str | Path | None,
    drafts: Sequence[DraftSpec],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_context: int | None = None,
    cuda_graphs: bool | None = None,
    compiled: bool = False,
) -> LoadedModels:
    """The target checkpoint (the embedded default model when None) on the PyTorch engine, and a drafter per
    draft: prompt lookup, or a draft checkpoint (each loaded once), alone or behind prompt lookup.
    ``cuda_graphs`` and ``compiled``: see ``TorchEngine``."""
    device = usable_device(device)
    target_path = Path(target) if target is not None else default_model_path()
    for spec in drafts:
        if spec.is_own:
            raise InvalidValueError(
                f"draft {str(spec)!r} names an engine directory's own draft; with a target checkpoint give a "
                "draft checkpoint, 'ngram' or 'none'"
            )
    paths = list(dict.fromkeys(spec.model_path for spec in drafts if spec.model_path is not None))
    header = read_header(target_path)
    for path in paths:  # refuse a mismatched draft before reading any weights
        check_same_vocabulary(header, read_header(path))
    checkpoint = load_checkpoint(target_path, dtype)
    engine = TorchEngine.from_checkpoint(checkpoint, max_context, device, cuda_graphs, compiled)
    models: dict[Path, ModelDrafter] = {}
    for path in paths:
        draft = load_checkpoint(path, dtype)
        context = min(engine.max_context, draft.config.max_context)
        models[path] = ModelDrafter(TorchEngine.from_checkpoint(draft, context, device, cuda_graphs, compiled))
    loaded = LoadedModels(engine, checkpoint.tokenizer, list(checkpoint.config.eos_token_ids))
    loaded.target_checkpoint = target_path
    for spec in drafts:
        model = None if spec.model_path is None else models[spec.model_path]
        _add(loaded, spec, None if model is None else spec.model_path.name, model, device)
        if model is not None:
            loaded.draft_checkpoints[spec.model_path.name] = spec.model_path
    return loaded


def open_engine_directory(
    directory: str | Path, drafts: Sequence[DraftSpec], threads: int | None = None
) -> LoadedModels:
    """Check an engine directory (schema, checksums) and open its target on ONNX Runtime, with a drafter per
    draft: prompt lookup, the directory's own draft ("engine", or "int4" when it is the target quantized),
    or the target of another engine directory with the same vocabulary; each alone or behind prompt lookup."""
    threads = check_threads(threads, os.cpu_count() or 1)
    directory = Path(directory)
    manifest = checked_manifest(directory)
    # ONNX Runtime's thread pool owns the cores; torch only samples here, and its own threads waking
    # beside ONNX Runtime's slow every step.
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(directory / "tokenizer") if (directory / "tokenizer").is_dir() else None
    target = OrtEngine(model_spec(directory, manifest.target), threads)
    loaded = LoadedModels(target, tokenizer, list(manifest.target.eos_token_ids))
    loaded.target_checkpoint = Path(manifest.target.source)
    loaded.engine_dir, loaded.threads = directory, threads or os.cpu_count() or 1
    own: ModelDrafter | None = None
    others: dict[Path, tuple[ModelDrafter, Path]] = {}  # other engine directories as drafts, each opened once
    for spec in drafts:
        model, label = None, None
        if spec.is_own:
            own = own or _own_drafter(directory, manifest, spec, target, threads)
            model, label = own, INT4 if manifest.draft_kind == INT4 else ENGINE
            if manifest.draft_kind != INT4:
                loaded.draft_checkpoints[label] = Path(manifest.draft.source)
        elif spec.model_path is not None:
            path = spec.model_path
            if path not in others:
                others[path] = _other_directory_drafter(path, manifest, tokenizer, threads)
            (model, source), label = others[path], path.name
            loaded.draft_checkpoints[label] = source
        _add(loaded, spec, label, model, target.device)
    return loaded


def load_engines(
    target: str | Path | None,
    draft: str | Path | DraftSpec | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_context: int | None = None,
    cuda_graphs: bool | None = None,
    compiled: bool = False,
) -> tuple[LoadedModels, TorchEngine, Drafter | None]:
    """``open_checkpoints`` with one draft: the load, its target engine and its drafter (None: plain)."""
    loaded = open_checkpoints(target, [DraftSpec.parse(draft)], device, dtype, max_context, cuda_graphs, compiled)
    return loaded, loaded.target, loaded.only_drafter()


def model_spec(directory: Path, entry: ModelEntry) -> OrtModelSpec:
    """The runtime's view of a manifest entry."""
    return OrtModelSpec(
        path=Path(directory) / entry.graph,
        num_layers=entry.num_layers,
        num_kv_heads=entry.num_kv_heads,
        head_dim=entry.head_dim,
        vocab_size=entry.vocab_size,
        max_context=entry.max_context,
        max_draft_len=entry.max_draft_len,
        dtype=entry.dtype,
    )


def _own_drafter(
    directory: Path, manifest: Manifest, spec: DraftSpec, target: OrtEngine, threads: int | None
) -> ModelDrafter:
    if manifest.draft is None:
        raise InvalidValueError(f"{directory} was built without a draft: --draft {spec} needs one (use ngram or none)")
    if spec.model == INT4 and manifest.draft_kind != INT4:
        raise InvalidValueError(f"{directory}'s draft is a {manifest.draft_kind} draft, not int4: use --draft {ENGINE}")
    engine = OrtEngine(model_spec(directory, manifest.draft), threads)
    # A self-draft shares the target's cache layout: it starts from the target's prompt cache and copies the
    # keys and values of later tokens from the target too, feeding only the newest one.
    return ModelDrafter(engine, cache_from=target if manifest.draft_kind == INT4 else None)


def checked_manifest(directory: Path) -> Manifest:
    """An engine directory's manifest with every file checked against it, files checked before and unchanged since
    not read again (the record in the cache directory)."""
    return read_manifest(directory, verified=VerifiedFiles(cache_root() / VERIFIED_FILES))


def _other_directory_drafter(
    path: Path, manifest: Manifest, tokenizer: PreTrainedTokenizerBase | None, threads: int | None
) -> tuple[ModelDrafter, Path]:
    """The target of another engine directory as a draft (and the checkpoint it was built from), after
    checking that it shares the vocabulary."""
    if not (path / MANIFEST_NAME).is_file():
        raise InvalidValueError(
            f"draft {path} is not an engine directory: with --engines a draft is 'engine', 'int4', 'ngram', "
            "'ngram+engine', another engine directory or 'none' (draft checkpoints go with --target)"
        )
    other = checked_manifest(path)
    other_tokenizer = load_tokenizer(path / "tokenizer") if (path / "tokenizer").is_dir() else None
    if other.target.vocab_size != manifest.target.vocab_size or (
        other_tokenizer is not None and tokenizer is not None and other_tokenizer.get_vocab() != tokenizer.get_vocab()
    ):
        raise VocabularyMismatchError(f"the engines in {path} do not share the target's vocabulary")
    return ModelDrafter(OrtEngine(model_spec(path, other.target), threads)), Path(other.target.source)


def _add(
    loaded: LoadedModels, spec: DraftSpec, label: str | None, model: ModelDrafter | None, device: torch.device
) -> None:
    """Name the drafter ``spec`` asks for (plain decoding adds none); two drafts under one name would be
    measured as one, so that is an error."""
    if not spec.drafts:
        return
    if model is None:
        label, drafter = NGRAM, PromptLookupDrafter(device=device, store=DraftStore())
    elif spec.lookup:
        label, drafter = LOOKUP_FIRST + label, LookupFirstDrafter(model, DraftStore())
    else:
        drafter = model
    if label in loaded.drafters:
        raise InvalidValueError(f"two drafts are named {label!r}: give each draft once, with distinct directory names")
    loaded.drafters[label] = drafter
