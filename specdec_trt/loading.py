"""Building engines and drafters from checkpoint paths (what ``from_pretrained`` and the CLI use)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdec_trt.build_engines.checkpoint import (
    Checkpoint,
    default_model_path,
    load_checkpoint,
    load_tokenizer,
    read_header,
)
from specdec_trt.build_engines.manifest import Manifest, ModelEntry, read_manifest
from specdec_trt.drafting import Drafter, LookupFirstDrafter, ModelDrafter, PromptLookupDrafter
from specdec_trt.runtime.ort_engine import OrtEngine, OrtModelSpec
from specdec_trt.runtime.torch_engine import TorchEngine

DRAFT_NONE = ("none", "")
DRAFT_NGRAM = "ngram"
DRAFT_FROM_ENGINES = "engine"
LOOKUP_FIRST = "ngram+"  # "ngram+<model draft>": prompt lookup where it matches, that model elsewhere


def split_lookup_first(draft: str | Path | None) -> tuple[bool, str | Path | None]:
    """("ngram+X" -> (True, "X")); any other draft name is returned as it is, with False."""
    if draft is not None and str(draft).startswith(LOOKUP_FIRST):
        model = str(draft).removeprefix(LOOKUP_FIRST)
        if not model or model in (*DRAFT_NONE, DRAFT_NGRAM):
            raise ValueError(f"draft {str(draft)!r}: after 'ngram+' name the model that drafts where lookup fails")
        return True, model
    return False, draft


class VocabularyMismatchError(ValueError):
    """Target and draft do not share one vocabulary, so draft token ids would mean other tokens."""


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
        raise ValueError(f"{name!r} is not a torch device (try cpu or cuda): {err}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but this torch build sees no CUDA device")
    return device


def load_engines(
    target: str | Path | None,
    draft: str | Path | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_context: int | None = None,
    cuda_graphs: bool | None = None,
    compiled: bool = False,
) -> tuple[Checkpoint, TorchEngine, Drafter | None]:
    """Load the target (the embedded default model when None) and the drafter: None or "none" for plain
    decoding, "ngram" for prompt lookup, else a draft checkpoint directory or GGUF file, which "ngram+" before
    it puts behind prompt lookup. ``cuda_graphs`` and ``compiled``: see ``TorchEngine`` (graphs are on by
    default on a CUDA device; compiling is off)."""
    device = usable_device(device)
    lookup, draft = split_lookup_first(draft)
    target_path = target if target is not None else default_model_path()
    draft_model = draft is not None and str(draft) not in (*DRAFT_NONE, DRAFT_NGRAM)
    if draft_model:  # refuse a mismatched draft before reading any weights
        check_same_vocabulary(read_header(target_path), read_header(draft))
    target_ck = load_checkpoint(target_path, dtype)
    draft_ck = load_checkpoint(draft, dtype) if draft_model else None
    drafter: Drafter | None = PromptLookupDrafter(device=device) if str(draft) == DRAFT_NGRAM else None
    target_engine = TorchEngine.from_checkpoint(target_ck, max_context, device, cuda_graphs, compiled)
    if draft_ck is not None:
        draft_context = min(target_engine.max_context, draft_ck.config.max_context)
        drafter = ModelDrafter(TorchEngine.from_checkpoint(draft_ck, draft_context, device, cuda_graphs, compiled))
        drafter = LookupFirstDrafter(drafter) if lookup else drafter
    return target_ck, target_engine, drafter


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


def load_engine_directory(
    directory: str | Path, draft: str | None = DRAFT_FROM_ENGINES, provider: str = "cpu", threads: int | None = None
) -> tuple[Manifest, PreTrainedTokenizerBase | None, OrtEngine, Drafter | None]:
    """Check an engine directory (schema, checksums) and open its engines on ONNX Runtime. ``draft`` is
    "engine" (the directory's own draft, if it was built with one), "ngram", "ngram+engine" (prompt lookup, the
    directory's draft where it finds nothing), or None / "none"."""
    directory = Path(directory)
    lookup, draft = split_lookup_first(draft)
    if lookup and draft != DRAFT_FROM_ENGINES:
        raise ValueError(f"draft 'ngram+{draft}' for an engine directory must be 'ngram+engine'")
    manifest = read_manifest(directory)
    # ONNX Runtime's thread pool owns the cores; torch only samples here, and its own threads waking
    # beside ONNX Runtime's slowed every step (measured: 34 vs 46 tok/s speculative on 2 cores).
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(directory / "tokenizer") if (directory / "tokenizer").is_dir() else None
    target = OrtEngine(model_spec(directory, manifest.target), provider, threads)
    drafter: Drafter | None = None
    if draft == DRAFT_NGRAM:
        drafter = PromptLookupDrafter()
    elif draft == DRAFT_FROM_ENGINES and manifest.draft is not None:
        draft_engine = OrtEngine(model_spec(directory, manifest.draft), provider, threads)
        # A self-draft shares the target's cache layout: it starts from the target's prompt cache (measured
        # on SmolLM2: 3 ms instead of a 700 ms int4 prefill of 380 tokens, with acceptance as high or higher),
        # and copies the keys and values of later tokens from the target too, feeding only the newest one.
        drafter = ModelDrafter(draft_engine, cache_from=target if manifest.draft_kind == "int4" else None)
        drafter = LookupFirstDrafter(drafter) if lookup else drafter
    elif lookup:
        raise ValueError(f"{directory} was built without a draft: 'ngram+engine' needs one (or use 'ngram')")
    elif draft not in (None, DRAFT_FROM_ENGINES, *DRAFT_NONE):
        raise ValueError(f"draft {draft!r} for an engine directory must be 'engine', 'ngram', 'ngram+engine' or 'none'")
    return manifest, tokenizer, target, drafter
