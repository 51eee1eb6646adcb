"""``load_checkpoint``: every broken input is a ``CheckpointError`` naming the file (and the fix where
the loader gives one); pickled weights are refused without being unpickled; the happy paths load real
tokenizers, sharded safetensors and other dtypes."""

from __future__ import annotations

import json
import pickle
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, build_model, char_tokenizer, save_checkpoint

from specdec_trt.build_engines.checkpoint import CheckpointError, load_checkpoint, load_transformers_model


@pytest.fixture
def checkpoint_copy(make_checkpoint, tmp_path: Path) -> Path:
    """A private, writable copy of a tiny llama checkpoint (with tokenizer)."""
    return Path(shutil.copytree(make_checkpoint(family="llama"), tmp_path / "ckpt"))


class _CreatesFileWhenUnpickled:
    """Unpickling this object creates ``marker``: the proof that a loader ran pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def _malicious_pickle(marker: Path) -> bytes:
    """Pickled "weights" whose unpickling creates ``marker``; first proves on a control file that this
    payload really runs code when unpickled."""
    payload = pickle.dumps({"model.embed_tokens.weight": _CreatesFileWhenUnpickled(marker)})
    control = marker.with_name("control")
    pickle.loads(pickle.dumps(_CreatesFileWhenUnpickled(control)))
    assert control.exists(), "the payload must really run code when unpickled"
    return payload


# --- errors ----------------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError, match="does not exist") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and ".gguf" in str(err.value)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="needs config.json") as err:
        load_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_config_not_json(checkpoint_copy: Path) -> None:
    config = checkpoint_copy / "config.json"
    config.write_text('{"model_type": "llama",')
    with pytest.raises(CheckpointError, match="not valid JSON") as err:
        load_checkpoint(checkpoint_copy)
    assert str(config) in str(err.value)


def test_config_json_not_an_object(checkpoint_copy: Path) -> None:
    (checkpoint_copy / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(checkpoint_copy)


def test_unsupported_model_type(checkpoint_copy: Path) -> None:
    config = checkpoint_copy / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="'gpt2' is not supported") as err:
        load_checkpoint(checkpoint_copy)
    assert str(config) in str(err.value)
    assert "llama, mistral, qwen2, qwen3" in str(err.value)


def test_unsupported_architecture_detail_names_the_checkpoint(checkpoint_copy: Path) -> None:
    """A supported family with an unsupported option: ModelConfig's error, prefixed with the directory."""
    config = checkpoint_copy / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match="hidden_act 'gelu'") as err:
        load_checkpoint(checkpoint_copy)
    assert str(err.value).startswith(str(checkpoint_copy))


@pytest.mark.parametrize("loader", [load_checkpoint, load_transformers_model])
def test_pickled_weights_refused_without_unpickling(loader, checkpoint_copy: Path, tmp_path: Path) -> None:
    """A directory whose only weights are pytorch_model.bin is refused, and the pickle is never loaded: by
    our loader and by the one that opens the checkpoint in transformers (the benchmark's peers)."""
    marker = tmp_path / "unpickled"
    for weights in checkpoint_copy.glob("*.safetensors"):
        weights.unlink()
    (checkpoint_copy / "pytorch_model.bin").write_bytes(_malicious_pickle(marker))
    with pytest.raises(CheckpointError, match="refused as unsafe") as err:
        loader(checkpoint_copy)
    message = str(err.value)
    assert str(checkpoint_copy) in message and "pytorch_model.bin" in message
    assert "safetensors" in message and "save_pretrained" in message
    assert not marker.exists()


def test_pickled_file_path_refused_without_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    weights = tmp_path / "model.pt"
    weights.write_bytes(_malicious_pickle(marker))
    with pytest.raises(CheckpointError, match="pickled weights are refused") as err:
        load_checkpoint(weights)
    assert str(weights) in str(err.value)
    assert not marker.exists()


def test_truncated_safetensors(checkpoint_copy: Path) -> None:
    weights = checkpoint_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated") as err:
        load_checkpoint(checkpoint_copy)
    assert str(weights) in str(err.value) and "re-download or re-save" in str(err.value)


def test_sharded_index_naming_a_missing_shard(tmp_path: Path) -> None:
    build_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(CheckpointError, match="model.safetensors.index.json but missing") as err:
        load_checkpoint(tmp_path)
    assert str(shards[1]) in str(err.value)


@pytest.mark.parametrize("index_text", ["{broken", "{}"])
def test_corrupt_sharded_index(tmp_path: Path, index_text: str) -> None:
    build_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name", ["weights.txt", "model.bin"])
def test_file_that_is_not_gguf(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="not a checkpoint directory or a .gguf file") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


def test_corrupt_gguf_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(CheckpointError, match="not a readable GGUF model") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


def test_gguf_truncated_in_header(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1))  # v3, 0 tensors, 1 key/value pair: then EOF
    with pytest.raises(CheckpointError, match="not a readable GGUF model"):
        load_checkpoint(path)


# --- happy paths -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_weights_and_tokenizer(make_checkpoint, family: str) -> None:
    """The stored tokenizer comes back as saved: one id per character, decoding to the same text."""
    directory = make_checkpoint(family=family)
    checkpoint = load_checkpoint(directory)
    assert checkpoint.source == directory
    assert checkpoint.config.family == family and checkpoint.config.eos_token_ids == (2,)
    assert "model.embed_tokens.weight" in checkpoint.state_dict
    tokenizer = checkpoint.tokenizer
    assert tokenizer is not None and tokenizer.eos_token == "</s>" and tokenizer.eos_token_id == 2
    text = "hello, world!\nhow are you?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == char_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text


def test_without_tokenizer(make_checkpoint) -> None:
    checkpoint = load_checkpoint(make_checkpoint(family="llama", with_tokenizer=False))
    assert checkpoint.tokenizer is None
    assert "model.embed_tokens.weight" in checkpoint.state_dict


def test_sharded_equals_single_file(tmp_path: Path) -> None:
    model = build_model("mistral", seed=3)
    save_checkpoint(model, tmp_path / "single", with_tokenizer=False)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    expected = model.state_dict()
    for directory in ("single", "sharded"):
        state_dict = load_checkpoint(tmp_path / directory).state_dict
        assert state_dict.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(state_dict[name], tensor), name


def test_float16(make_checkpoint) -> None:
    directory = make_checkpoint(family="llama")
    full = load_checkpoint(directory).state_dict
    half = load_checkpoint(directory, dtype=torch.float16).state_dict
    assert half.keys() == full.keys()
    for name, tensor in half.items():
        assert tensor.dtype == torch.float16, name
        assert torch.equal(tensor, full[name].half()), name
