"""Loading what a benchmark compares: our target and drafters, and transformers' models on the same weights.

Two backends, as in specdec-run: an engine directory on ONNX Runtime, or checkpoints on the PyTorch
engine (any torch device, which is how the benchmark runs on CUDA). A draft is named by the user:
"ngram" (prompt lookup), "int4" / "engine" (an engine directory's own draft), another engine directory
(its target serves as the draft) or, on PyTorch, a draft checkpoint; "ngram+" before a model draft puts it
behind prompt lookup (``LookupFirstDrafter``). transformers' peers run on the
checkpoint the target was built from; a draft checkpoint becomes assisted generation's ``assistant_model``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdec_trt.bench.methods import NGRAM, OursRunner, TransformersRunner
from specdec_trt.build_engines.checkpoint import load_checkpoint, load_tokenizer, load_transformers_model, read_header
from specdec_trt.build_engines.manifest import read_manifest
from specdec_trt.drafting import Drafter, LookupFirstDrafter, ModelDrafter, PromptLookupDrafter
from specdec_trt.loading import (
    DRAFT_FROM_ENGINES,
    LOOKUP_FIRST,
    VocabularyMismatchError,
    check_same_vocabulary,
    load_engine_directory,
    model_spec,
    split_lookup_first,
    usable_device,
)
from specdec_trt.runtime.ort_engine import OrtEngine
from specdec_trt.runtime.torch_engine import TorchEngine

DRAFT_INT4 = "int4"


@dataclass
class Backend:
    """Our runner and what the benchmark needs to know about it; transformers' side is loaded apart."""

    ours: OursRunner
    drafts: list[str]  # the draft labels, as methods name them
    eos_token_ids: list[int]
    max_context: int
    max_draft_len: int | None
    device: str
    target_checkpoint: Path | None  # what transformers' peers load; None when unknown
    draft_checkpoints: dict[str, Path] = field(default_factory=dict)  # draft label -> checkpoint for assistants


def open_engines(directory: Path, drafts: list[str], provider: str, threads: int | None) -> Backend:
    """Our side from an engine directory on ONNX Runtime."""
    models = [split_lookup_first(d)[1] for d in drafts]
    own = [d for d in models if d in (DRAFT_INT4, DRAFT_FROM_ENGINES)]
    manifest, tokenizer, target, own_drafter = load_engine_directory(
        directory, DRAFT_FROM_ENGINES if own else None, provider, threads
    )
    if own and own_drafter is None:
        raise ValueError(f"{directory} was built without a draft: --draft {own[0]} needs one (or use ngram)")
    if DRAFT_INT4 in own and manifest.draft_kind != DRAFT_INT4:
        raise ValueError(f"{directory}'s draft is a {manifest.draft_kind} draft, not int4: use --draft engine")
    drafters: dict[str, Drafter] = {}
    draft_checkpoints: dict[str, Path] = {}
    others: dict[str, ModelDrafter] = {}  # engine directories serving as drafts, each opened once
    for draft in drafts:
        lookup, model = split_lookup_first(draft)
        if model in own:  # labelled by what it is: "int4" for the quantized self-draft
            label = DRAFT_INT4 if manifest.draft_kind == DRAFT_INT4 else DRAFT_FROM_ENGINES
            drafter = own_drafter
            if manifest.draft_kind != DRAFT_INT4:
                draft_checkpoints[label] = Path(manifest.draft.source)
        elif model == NGRAM:
            label, drafter = NGRAM, PromptLookupDrafter()
        else:
            label = Path(model).name
            if label not in others:
                other = read_manifest(model)
                other_tokenizer = load_tokenizer(Path(model) / "tokenizer")
                if other.target.vocab_size != manifest.target.vocab_size or (
                    other_tokenizer is not None and other_tokenizer.get_vocab() != tokenizer.get_vocab()
                ):
                    raise VocabularyMismatchError(f"the engines in {model} do not share {directory}'s vocabulary")
                others[label] = ModelDrafter(OrtEngine(model_spec(Path(model), other.target), provider, threads))
                draft_checkpoints[label] = Path(other.target.source)
            drafter = others[label]
        _add(drafters, LOOKUP_FIRST + label if lookup else label, LookupFirstDrafter(drafter) if lookup else drafter)
    return Backend(
        ours=OursRunner(target, drafters, tokenizer, manifest.target.eos_token_ids, torch_threads=1),
        drafts=list(drafters),
        eos_token_ids=manifest.target.eos_token_ids,
        max_context=min([target.max_context] + [d.max_context for d in drafters.values() if d.max_context]),
        max_draft_len=target.max_draft_len,
        device="cpu",  # where sampling and transformers' peers run
        target_checkpoint=Path(manifest.target.source),
        draft_checkpoints=draft_checkpoints,
    )


def open_checkpoints(
    target: Path,
    drafts: list[str],
    device: str,
    dtype: torch.dtype,
    max_context: int | None,
    threads: int,
    cuda_graphs: bool | None = None,
    compiled: bool = False,
) -> Backend:
    """Our side from checkpoints on the PyTorch engine (``cuda_graphs``, ``compiled``: see ``TorchEngine``)."""
    torch_device = usable_device(device)
    header = read_header(target)
    models = list(dict.fromkeys(m for m in (split_lookup_first(d)[1] for d in drafts) if m != NGRAM))
    for draft in models:  # refuse a mismatched draft before reading any weights
        check_same_vocabulary(header, read_header(draft))
    checkpoint = load_checkpoint(target, dtype)
    engine = TorchEngine.from_checkpoint(checkpoint, max_context, torch_device, cuda_graphs, compiled)
    model_drafters: dict[str, ModelDrafter] = {}  # each draft checkpoint loaded once
    for draft in models:
        draft_checkpoint = load_checkpoint(draft, dtype)
        context = min(engine.max_context, draft_checkpoint.config.max_context)
        draft_engine = TorchEngine.from_checkpoint(draft_checkpoint, context, torch_device, cuda_graphs, compiled)
        model_drafters[draft] = ModelDrafter(draft_engine)
    drafters: dict[str, Drafter] = {}
    for draft in drafts:
        lookup, model = split_lookup_first(draft)
        if model == NGRAM:
            _add(drafters, NGRAM, PromptLookupDrafter(device=torch_device))
        elif lookup:
            _add(drafters, LOOKUP_FIRST + Path(model).name, LookupFirstDrafter(model_drafters[model]))
        else:
            _add(drafters, Path(model).name, model_drafters[model])
    eos = list(checkpoint.config.eos_token_ids)
    return Backend(
        ours=OursRunner(engine, drafters, checkpoint.tokenizer, eos, torch_threads=threads),
        drafts=list(drafters),
        eos_token_ids=eos,
        max_context=min([engine.max_context] + [d.max_context for d in drafters.values() if d.max_context]),
        max_draft_len=None,
        device=str(torch_device),
        target_checkpoint=Path(target),
        draft_checkpoints={Path(draft).name: Path(draft) for draft in models},
    )


def _add(drafters: dict[str, Drafter], label: str, drafter: Drafter) -> None:
    """Name a drafter; two drafts under one name would be measured as one."""
    if label in drafters:
        raise ValueError(f"two drafts are named {label!r}: give each --draft once, with distinct directory names")
    drafters[label] = drafter


def open_transformers(
    target: Path, assistants: dict[str, Path], device: str, dtype: torch.dtype, threads: int, eos_token_ids: list[int]
) -> TransformersRunner:
    """transformers' models on the target's checkpoint (and each draft checkpoint, as assistants)."""
    if not target.exists():
        raise ValueError(
            f"transformers' peers need the target's checkpoint, {target}, which is not there: "
            "give --hf-target or --no-peers"
        )

    def load(path: Path) -> PreTrainedModel:
        return load_transformers_model(path, dtype).to(device)

    return TransformersRunner(load(target), {label: load(p) for label, p in assistants.items()}, threads, eos_token_ids)
