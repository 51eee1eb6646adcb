"""The draft's starting point: a few of the target's decoder layers, with its embeddings, final norm and
output head (frozen and shared, so the draft lives in the target's representation space)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from specdec_trt.build_engines.model import DRAFT_VOCAB_KEY


def first_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The default draft layers: the target's first ``num_draft_layers``. They keep the residual stream the
    embeddings start, and trained best of the choices tried (docs/MEASUREMENTS.md)."""
    if not 1 <= num_draft_layers <= num_target_layers:
        raise ValueError(f"a draft needs 1 to {num_target_layers} layers (the target's), got {num_draft_layers}")
    return list(range(num_draft_layers))


def init_draft(target: PreTrainedModel, layers: Sequence[int], draft_vocab: Sequence[int] | None) -> PreTrainedModel:
    """A model of the target's family with target ``layers`` (in that order) as its decoder layers.
    Embeddings and the output head are copied and frozen; ``draft_vocab`` (sorted ids) prunes the head's
    scored vocabulary through the config key the engines read."""
    count = target.config.num_hidden_layers
    if not layers or any(not 0 <= i < count for i in layers):
        raise ValueError(f"draft layers must be target layer indices in [0, {count}), got {list(layers)}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in layers]
    if draft_vocab is not None:
        setattr(config, DRAFT_VOCAB_KEY, list(draft_vocab))
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = target.state_dict()
    weights = {}
    for name in draft.state_dict():
        if name.startswith("model.layers."):
            index, rest = name.removeprefix("model.layers.").split(".", 1)
            name_in_target = f"model.layers.{layers[int(index)]}.{rest}"
        else:
            name_in_target = name
        weights[name] = source[name_in_target].float()
    draft.load_state_dict(weights)
    draft.get_input_embeddings().weight.requires_grad_(False)
    draft.get_output_embeddings().weight.requires_grad_(False)
    return draft.train()
