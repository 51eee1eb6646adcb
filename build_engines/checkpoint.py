"""Loading checkpoints: Hugging Face directories (config.json + safetensors + tokenizer) and GGUF files.

Only safe formats are read: safetensors and GGUF. Pickled ``.bin``/``.pt`` weights are refused, never
unpickled. Every failure is a ``CheckpointError`` that names the file and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from specdec_trt.build_engines.default_model import CheckpointError
from specdec_trt.build_engines.model import SUPPORTED_FAMILIES, ModelConfig, UnsupportedModelError

if TYPE_CHECKING:  # transformers' modelling code takes seconds to import: only loading a model as one needs it
    from transformers import PreTrainedModel

_PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# A tokenizer saved as the generic tokenizers-backed class is loaded as that class: AutoTokenizer would
# otherwise substitute the model family's own tokenizer class (it does for qwen2), changing the tokenizer.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


@dataclass
class Checkpoint:
    """Weights, architecture and tokenizer of one model, ready to build an engine from."""

    source: Path
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase | None


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a checkpoint directory or a ``.gguf`` file, with its tokenizer when it has one."""
    path = Path(path).expanduser()
    config = read_config(path)
    if path.is_file():
        return _load_gguf(path, config, dtype)
    state_dict = {name: tensor.to(dtype) for name, tensor in _read_safetensors(path).items()}
    return Checkpoint(path, config, state_dict, load_tokenizer(path))


def read_header(path: str | Path) -> Checkpoint:
    """A checkpoint's architecture and tokenizer without its weights (``state_dict`` is empty)."""
    return Checkpoint(Path(path).expanduser(), read_config(path), {}, load_tokenizer(path))


def read_config(path: str | Path) -> ModelConfig:
    """The architecture of a checkpoint directory or ``.gguf`` file, validated, without reading weights."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: pass a Hugging Face checkpoint directory or a .gguf file")
    if path.is_file():
        if path.suffix != ".gguf":
            hint = " (pickled weights are refused as unsafe)" if path.suffix in _PICKLED_SUFFIXES else ""
            raise CheckpointError(f"{path} is not a checkpoint directory or a .gguf file{hint}")
        try:
            hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as err:  # noqa: BLE001 - a corrupt file can fail anywhere in the GGUF parser
            raise CheckpointError(f"{path} is not a readable GGUF model ({type(err).__name__}: {err})") from err
        return model_config(hf_config, path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file} is missing: a checkpoint directory needs config.json")
    raw = _read_json(config_file)
    if raw.get("model_type") not in SUPPORTED_FAMILIES:
        raise CheckpointError(
            f"{config_file}: model_type {raw.get('model_type')!r} is not supported; "
            f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return model_config(AutoConfig.from_pretrained(path), path)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer stored with a checkpoint (directory or GGUF), or None when it has none."""
    path = Path(path)
    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        if not any((path / name).exists() for name in _TOKENIZER_FILES):
            return None
        if _read_json(path / "tokenizer_config.json", {}).get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(path)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"cannot load the tokenizer from {path}: {err}") from err


def model_config(hf_config: Any, source: Path) -> ModelConfig:
    """``ModelConfig.from_hf`` with the error rephrased to name the checkpoint."""
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as err:
        raise CheckpointError(f"{source}: {err}") from err


def _safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (the shards its index names), or a CheckpointError."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map: re-save the checkpoint or delete the broken index")
        files = [path / shard for shard in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLED_SUFFIXES)
        if pickled:
            raise CheckpointError(
                f"{path} holds only pickled weights ({', '.join(pickled)}), which are refused as unsafe: "
                "convert them to safetensors, e.g. `model.save_pretrained(dir, safe_serialization=True)` in a "
                "trusted environment"
            )
        raise CheckpointError(f"{path} has no *.safetensors weights")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file} is listed in {index.name} but missing: re-download that shard")
    return files


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        try:
            weights.update(load_file(file))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file} is corrupt or truncated ({err}): re-download or re-save it") from err
    return weights


def _read_json(file: Path, default: dict | None = None) -> dict:
    """A JSON object from ``file`` (``default`` when the file is absent), or a CheckpointError."""
    if default is not None and not file.is_file():
        return default
    try:
        content = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is not valid JSON ({err}): fix it or re-save the checkpoint") from err
    if not isinstance(content, dict):
        raise CheckpointError(f"{file} must hold a JSON object: fix it or re-save the checkpoint")
    return content


def load_transformers_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The checkpoint as a transformers causal LM (what ``generate`` and the benchmark's peers run).
    The architecture is validated first; a directory's weights are read from safetensors only."""
    path = Path(path).expanduser()
    read_config(path)
    if path.is_file():
        return _gguf_model(path, dtype)
    _safetensors_files(path)  # refuses pickled-only and incomplete checkpoints with the loader's own errors
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).eval()
    except OSError as err:
        raise CheckpointError(f"{path}: transformers cannot load its safetensors weights: {err}") from err


def _gguf_model(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    except Exception as err:  # noqa: BLE001 - as above: truncated tensor data fails deep in the parser
        raise CheckpointError(f"{path}: cannot dequantize the GGUF weights: {err}") from err


def _load_gguf(path: Path, config: ModelConfig, dtype: torch.dtype) -> Checkpoint:
    model = _gguf_model(path, dtype)
    state_dict = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    return Checkpoint(path, config, state_dict, load_tokenizer(path))
