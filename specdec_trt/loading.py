"""Building engines and drafters from checkpoint paths (what ``from_pretrained`` and the CLI use)."""

from __future__ import annotations

from pathlib import Path

import torch

from build_engines.checkpoint import Checkpoint, default_model_path, load_checkpoint
from runtime.torch_engine import TorchEngine
from specdec_trt.drafting import Drafter, ModelDrafter, PromptLookupDrafter

DRAFT_NONE = ("none", "")
DRAFT_NGRAM = "ngram"


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
) -> tuple[Checkpoint, TorchEngine, Drafter | None]:
    """Load the target (the embedded default model when None) and the drafter: None or "none" for plain
    decoding, "ngram" for prompt lookup, else a draft checkpoint directory or GGUF file."""
    device = usable_device(device)
    target_ck = load_checkpoint(target if target is not None else default_model_path(), dtype)
    drafter: Drafter | None = None
    draft_ck = None
    if draft is not None and str(draft) not in DRAFT_NONE:
        if str(draft) == DRAFT_NGRAM:
            drafter = PromptLookupDrafter(device=device)
        else:
            draft_ck = load_checkpoint(draft, dtype)
            check_same_vocabulary(target_ck, draft_ck)
    target_engine = TorchEngine.from_checkpoint(target_ck, max_context, device)
    if draft_ck is not None:
        draft_context = min(target_engine.max_context, draft_ck.config.max_context)
        drafter = ModelDrafter(TorchEngine.from_checkpoint(draft_ck, draft_context, device))
    return target_ck, target_engine, drafter
