"""``specdec_trt.bench.gguf_f32``: a quantized GGUF rewritten as F32 holds the dequantized tensors and the same
metadata, so llama.cpp can run the float32 weights our engines run."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specdec_trt.bench.gguf_f32 import write_f32_gguf
from specdec_trt.build_engines.checkpoint import load_checkpoint
from specdec_trt.build_engines.default_model import default_model_path


def test_tensors_are_dequantized_and_metadata_copied(tmp_path) -> None:
    rng = np.random.default_rng(0)
    weight, norm = rng.standard_normal((8, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    source = tmp_path / "q8.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    writer.add_context_length(128)
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    quantized = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", norm)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()

    reader = gguf.GGUFReader(write_f32_gguf(source, tmp_path / "f32.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    assert {t.tensor_type for t in tensors.values()} == {gguf.GGMLQuantizationType.F32}
    expected = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
    assert not np.array_equal(expected, weight)  # the quantization is lossy: F32 must hold what it left
    np.testing.assert_array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(8, 64), expected)
    np.testing.assert_array_equal(np.asarray(tensors["output_norm.weight"].data), norm)
    assert reader.fields["llama.context_length"].contents() == 128
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b"]
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32


@pytest.mark.slow
def test_the_default_model_in_f32_loads_to_the_weights_our_engines_run(tmp_path) -> None:
    ours = load_checkpoint(default_model_path()).state_dict
    theirs = load_checkpoint(write_f32_gguf(default_model_path(), tmp_path / "smollm2-f32.gguf")).state_dict
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
