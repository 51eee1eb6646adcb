"""Export the compact decoder to an ONNX graph for ONNX Runtime, and block-quantize it to 4 bits.

The graph is written node by node from the model's weights, using ONNX Runtime's fused contrib operators:
``SkipSimplifiedLayerNormalization`` (residual add + RMSNorm) and ``GroupQueryAttention`` (rotary
embedding + attention + KV cache write). The KV cache of every layer is a graph input and output in BNSH
layout; the runtime binds the same buffer as both (GQA's shared past/present buffer), so a step writes only
the new tokens' keys and values and never copies the cache. The buffer's positions are a dimension of the
graph, not fixed at ``max_context``: the runtime grows the buffer as its sequences grow, so short sequences
neither hold nor sweep a long context's memory.
Per-row cache lengths come in as ``seqlens_k``: rolling back a rejected draft is a smaller number. Each row's
count of new tokens comes in as ``query_seqlens``, which lets GroupQueryAttention take several new tokens
for every row of a batch in one pass (a batched verify, a prefill chunk).

Rows of a pass differ in their number of new tokens (one row verifies 8 drafts, another decodes one, a third
prefills a chunk), so the new tokens come in packed, row after row, with no padding: every matrix product
computes only real tokens, and a pass costs what its tokens cost, not rows x its widest row. Only attention
needs rows: ``unpack_index`` gathers the packed query, keys and values into right-padded rows [B, T] for
GroupQueryAttention, and ``pack_index`` gathers its output back.

Inputs:  input_ids [1, N] int64 (the N new tokens, row after row), unpack_index [B, T] int64 (the packed
         token at each padded position; padding repeats a row's last token), pack_index [N] int64 (each
         packed token's flat padded position b * T + t), logits_index [M] int64 (packed tokens whose logits
         to return), seqlens_k [B] int32 (cached + new tokens - 1), total_sequence_length [] int32 (an upper
         bound of cached + new tokens), query_seqlens [B] int32 (new tokens per row),
         past_key.{i} / past_value.{i} [B, H_kv, P, D] (P positions, at most max_context)
Outputs: logits [1, M, V] float32, present_key.{i} / present_value.{i} (the same buffers)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from specdec_trt.build_engines.manifest import ROTARY_POSITIONS_KEY
from specdec_trt.build_engines.model import CompactDecoder, ModelConfig, pruned_logit_source, rope_tables

OPSET = 17
# The IR version written, pinned rather than onnx's newest: ONNX Runtime refuses IR versions newer than it
# knows (seen: onnx 1.23 writes IR 14, onnxruntime 1.30 reads up to 13). IR 10 carries opset 17 and is
# read by every onnxruntime since 1.17.
IR_VERSION = 10
EXTERNAL_DATA_SUFFIX = ".data"
_ONNX_DTYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}
INT4_BLOCK_SIZE = 32


class ExportError(ValueError):
    """The model cannot be exported with the requested settings."""


STEP_INPUTS = (
    "input_ids",
    "unpack_index",
    "pack_index",
    "logits_index",
    "seqlens_k",
    "total_sequence_length",
    "query_seqlens",
)


def input_names(num_layers: int) -> list[str]:
    """Graph input names in order: the step's inputs, then every layer's key and value cache."""
    return [*STEP_INPUTS, *[f"past_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]]


def output_names(num_layers: int) -> list[str]:
    """Graph output names in order."""
    return ["logits", *[f"present_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]]


def check_exportable(config: ModelConfig) -> None:
    """Refuse what ONNX Runtime's GroupQueryAttention cannot run, before any long work."""
    if config.head_dim % 16:
        raise ExportError(
            f"head_dim {config.head_dim} is not a multiple of 16, which ONNX Runtime's GroupQueryAttention "
            "needs for its rotary embedding; use the PyTorch engine for this model"
        )


@dataclass
class _Graph:
    """A tiny helper that names nodes and collects initializers."""

    dtype: int
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    _count: int = 0

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs) -> list[str]:
        self._count += 1
        names = outputs if isinstance(outputs, list) else [f"{op_type}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(
            helper.make_node(op_type, inputs, names, name=f"{op_type}_{self._count}", domain=domain, **attrs)
        )
        return names


def export_onnx(model: CompactDecoder, path: Path, dtype: torch.dtype = torch.float32) -> None:
    """Write ``model`` as ``path`` (graph) plus ``path.data`` (weights, external data)."""
    config = model.config
    check_exportable(config)
    if dtype not in _ONNX_DTYPES:
        raise ExportError(f"dtype {dtype} is not supported for ONNX export (float32 or float16)")
    graph = _Graph(_ONNX_DTYPES[dtype])
    weights = {name: t.detach().to(dtype).numpy() for name, t in model.state_dict().items()}
    cos, sin = rope_tables(config, model.max_context)
    half = config.head_dim // 2
    graph.weight("rope_cos", cos[:, :half].to(dtype).numpy())
    graph.weight("rope_sin", sin[:, :half].to(dtype).numpy())

    hidden = graph.op("Gather", [graph.weight("embed_tokens", weights["model.embed_tokens.weight"]), "input_ids"])[0]
    residual = None
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        normed, residual = _add_and_norm(graph, hidden, residual, weights[prefix + "input_layernorm.weight"], config)
        attention = _attention(graph, normed, weights, prefix + "self_attn.", i, config)
        normed, residual = _add_and_norm(
            graph, attention, residual, weights[prefix + "post_attention_layernorm.weight"], config
        )
        hidden = _mlp(graph, normed, weights, prefix + "mlp.", config)
    final, _ = _add_and_norm(graph, hidden, residual, weights["model.norm.weight"], config)
    picked = graph.op("Gather", [final, "logits_index"], axis=1)[0]
    head = weights["lm_head.weight"]
    if config.draft_vocab is None:
        logits = graph.op("MatMul", [picked, graph.weight("lm_head", head.T)])[0]
        graph.op("Cast", [logits], ["logits"], to=TensorProto.FLOAT)
    else:
        _pruned_logits(graph, picked, head, config)

    cache_shape = ["batch", config.num_kv_heads, "cache_positions", config.head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "new_tokens"]),
        helper.make_tensor_value_info("unpack_index", TensorProto.INT64, ["batch", "width"]),
        helper.make_tensor_value_info("pack_index", TensorProto.INT64, ["new_tokens"]),
        helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["logit_positions"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("query_seqlens", TensorProto.INT32, ["batch"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "logit_positions", config.vocab_size])]
    for name in input_names(config.num_layers)[len(STEP_INPUTS) :]:
        inputs.append(helper.make_tensor_value_info(name, graph.dtype, cache_shape))
    for name in output_names(config.num_layers)[1:]:
        outputs.append(helper.make_tensor_value_info(name, graph.dtype, cache_shape))
    onnx_graph = helper.make_graph(graph.nodes, "specdec_decoder", inputs, outputs, graph.initializers)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(onnx_graph, opset_imports=opsets, producer_name="specdec-trt", ir_version=IR_VERSION)
    save_model(model, path)


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Save with every weight in one external data file beside the graph (no 2 GB protobuf limit), and the
    positions its rotary tables cover in the model's metadata (``ROTARY_POSITIONS_KEY``), where a loaded
    session reads it without parsing the graph."""
    rotary = next((int(i.dims[0]) for i in model.graph.initializer if i.name == "rope_cos"), None)
    if rotary is not None:
        helper.set_model_props(model, {ROTARY_POSITIONS_KEY: str(rotary)})
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + EXTERNAL_DATA_SUFFIX)
    data.unlink(missing_ok=True)
    onnx.save_model(
        model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=1024
    )


def quantize_int4(source: Path, destination: Path, block_size: int = INT4_BLOCK_SIZE) -> None:
    """Block-quantize every MatMul weight of ``source`` to 4 bits (ONNX Runtime's MatMulNBits, symmetric,
    ``block_size`` per block) and save the result as ``destination``."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # It logs one INFO line per node.
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(
        onnx.load(source), bits=4, block_size=block_size, is_symmetric=True, accuracy_level=4
    )
    quantizer.process()
    save_model(quantizer.model.model, destination)


def _pruned_logits(graph: _Graph, hidden: str, head: np.ndarray, config: ModelConfig) -> None:
    """A vocabulary-pruned head: scores for the draft vocabulary only, spread to the full vocabulary with
    -inf everywhere else (one Pad and one Gather over the vocabulary, no scatter of a full tensor)."""
    pruned = graph.op("MatMul", [hidden, graph.weight("lm_head", head[list(config.draft_vocab)].T)])[0]
    pruned = graph.op("Cast", [pruned], to=TensorProto.FLOAT)[0]
    pads = graph.weight("logit_pads", np.array([0, 0, 0, 0, 0, 1], np.int64))
    padded = graph.op("Pad", [pruned, pads, graph.weight("minus_inf", np.array(-np.inf, np.float32))])[0]
    source = graph.weight("logit_source", pruned_logit_source(config).numpy())
    graph.op("Gather", [padded, source], ["logits"], axis=-1)


def _add_and_norm(
    graph: _Graph, x: str, residual: str | None, weight: np.ndarray, config: ModelConfig
) -> tuple[str, str]:
    """RMSNorm(x + residual) and the new residual x + residual (just x for the first layer)."""
    gamma = graph.weight(f"norm_{len(graph.initializers)}", weight)
    if residual is None:
        return graph.op("SimplifiedLayerNormalization", [x, gamma], axis=-1, epsilon=config.rms_norm_eps)[0], x
    normed, _, _, summed = graph.op(
        "SkipSimplifiedLayerNormalization", [x, residual, gamma], 4, domain="com.microsoft", epsilon=config.rms_norm_eps
    )
    return normed, summed


def _attention(graph: _Graph, x: str, weights: dict, prefix: str, layer: int, config: ModelConfig) -> str:
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    fused = np.concatenate([weights[prefix + f"{p}_proj.weight"] for p in "qkv"], axis=0).T
    qkv = graph.op("MatMul", [x, graph.weight(f"qkv_{layer}", fused)])[0]
    if config.qkv_bias:
        bias = np.concatenate([weights[prefix + f"{p}_proj.bias"] for p in "qkv"])
        qkv = graph.op("Add", [qkv, graph.weight(f"qkv_bias_{layer}", bias)])[0]
    rows = graph.op("Gather", [qkv, "unpack_index"], axis=1)[0]  # [1, B, T, q + 2 kv]: padded rows
    rows = graph.op("Squeeze", [rows, _constant(graph, "axis_0", [0])])[0]
    sizes = graph.weight(f"qkv_split_{layer}", np.array([q_dim, kv_dim, kv_dim], np.int64))
    q, k, v = graph.op("Split", [rows, sizes], 3, axis=-1)
    if config.qk_norm:
        q = _head_norm(graph, q, weights[prefix + "q_norm.weight"], config.num_heads, config)
        k = _head_norm(graph, k, weights[prefix + "k_norm.weight"], config.num_kv_heads, config)
    attended = graph.op(
        "GroupQueryAttention",
        [
            q,
            k,
            v,
            f"past_key.{layer}",
            f"past_value.{layer}",
            "seqlens_k",
            "total_sequence_length",
            "rope_cos",
            "rope_sin",
            *[""] * 7,  # position_ids .. k_norm_weight: none
            "query_seqlens",
        ],
        [f"attention_{layer}", f"present_key.{layer}", f"present_value.{layer}"],
        domain="com.microsoft",
        num_heads=config.num_heads,
        kv_num_heads=config.num_kv_heads,
        do_rotary=1,
        rotary_interleaved=0,
    )[0]
    flat = graph.op("Reshape", [attended, _constant(graph, "flat_rows", [-1, q_dim])])[0]
    packed = graph.op("Gather", [flat, "pack_index"], axis=0)[0]  # [N, q]: the real tokens only
    packed = graph.op("Unsqueeze", [packed, _constant(graph, "axis_0", [0])])[0]
    out = graph.op("MatMul", [packed, graph.weight(f"o_{layer}", weights[prefix + "o_proj.weight"].T)])[0]
    if config.o_bias:
        out = graph.op("Add", [out, graph.weight(f"o_bias_{layer}", weights[prefix + "o_proj.bias"])])[0]
    return out


def _constant(graph: _Graph, name: str, values: list[int]) -> str:
    """An int64 initializer shared by every layer that uses it (written once)."""
    if all(t.name != name for t in graph.initializers):
        graph.weight(name, np.array(values, np.int64))
    return name


def _head_norm(graph: _Graph, x: str, weight: np.ndarray, heads: int, config: ModelConfig) -> str:
    """Qwen3's RMSNorm over each head's dimensions, before the rotary embedding."""
    per_head = graph.weight(f"head_shape_{len(graph.initializers)}", np.array([0, 0, heads, config.head_dim], np.int64))
    flat = graph.weight(f"flat_shape_{len(graph.initializers)}", np.array([0, 0, heads * config.head_dim], np.int64))
    split = graph.op("Reshape", [x, per_head])[0]
    gamma = graph.weight(f"head_norm_{len(graph.initializers)}", weight)
    normed = graph.op("SimplifiedLayerNormalization", [split, gamma], axis=-1, epsilon=config.rms_norm_eps)[0]
    return graph.op("Reshape", [normed, flat])[0]


def _mlp(graph: _Graph, x: str, weights: dict, prefix: str, config: ModelConfig) -> str:
    fused = np.concatenate([weights[prefix + "gate_proj.weight"], weights[prefix + "up_proj.weight"]], axis=0).T
    name = f"{prefix}gate_up"
    gate_up = graph.op("MatMul", [x, graph.weight(name, fused)])[0]
    if config.mlp_bias:
        bias = np.concatenate([weights[prefix + "gate_proj.bias"], weights[prefix + "up_proj.bias"]])
        gate_up = graph.op("Add", [gate_up, graph.weight(name + "_bias", bias)])[0]
    gate, up = graph.op("Split", [gate_up], 2, axis=-1)
    silu = graph.op("Mul", [gate, graph.op("Sigmoid", [gate])[0]])[0]
    down = graph.op(
        "MatMul",
        [graph.op("Mul", [silu, up])[0], graph.weight(prefix + "down", weights[prefix + "down_proj.weight"].T)],
    )[0]
    if config.mlp_bias:
        down = graph.op("Add", [down, graph.weight(prefix + "down_bias", weights[prefix + "down_proj.bias"])])[0]
    return down
