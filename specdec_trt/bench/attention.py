"""A decoder layer's attention (rotary embedding, cache write, attention) in three ONNX Runtime formulations,
each run in place on its cache as the engines run theirs: what a step's attention costs against context.

- ``gqa``: GroupQueryAttention with its rotary embedding, on a BNSH cache ``[1, H_kv, max_context, D]``
  bound as both past and present (the exported engines' formulation);
- ``attention24``: RotaryEmbedding, TensorScatter and ONNX's Attention (opset 24) over a sequence-major
  cache ``[1, max_context, H_kv * D]``, of which the valid prefix rounded up to 64 positions is bound as a
  view, with an additive causal mask;
- ``block_diagonal``: the same cache, writes and mask; the scores of every head as one matrix product of
  the cached keys ``[S, H_kv * D]`` with a block-diagonal matrix of the queries ``[H_kv * D, H * T]``, a
  softmax over positions, and the product with the cached values ``[S, H_kv * D]``, of which each head keeps
  the block of its own key-value head (MLAS matrix products over contiguous memory, at H_kv times the
  arithmetic).

A graph holds ``layers`` independent blocks on caches of their own, fed the same new queries, keys and
values, so that the cost of a run outside the blocks is shared as in a whole model; sessions take the engines'
options and share their thread pool. The caches hold the same keys and values in every formulation, so their
outputs can be compared.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specdec_trt.runtime.ort_engine import session_options

FORMULATIONS = ("gqa", "attention24", "block_diagonal")
VIEW_ROUNDING = 64
WARM_STEPS, TIMED_STEPS = 6, 4


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention: query heads, key-value heads, head size, and the cache's positions."""

    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    max_context: int = 2048

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def _info(name: str, shape: list | None, dtype: int = TensorProto.FLOAT) -> helper.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _node(op: str, inputs: list[str], outputs: list[str], **attributes) -> helper.NodeProto:
    domain = "com.microsoft" if op in ("GroupQueryAttention", "RotaryEmbedding") else ""
    return helper.make_node(op, inputs, outputs, domain=domain, **attributes)


def _new_token_inputs(shape: AttentionShape) -> list:
    return [
        _info("q", [1, "T", shape.heads * shape.head_dim]),
        _info("k", [1, "T", shape.kv_width]),
        _info("v", [1, "T", shape.kv_width]),
    ]


def _gqa_graph(shape: AttentionShape, layers: int) -> tuple[list, list, list, list]:
    inputs = [
        *_new_token_inputs(shape),
        _info("seqlens_k", [1], TensorProto.INT32),
        _info("total_sequence_length", [], TensorProto.INT32),
    ]
    nodes, outputs = [], []
    cache = [1, shape.kv_heads, shape.max_context, shape.head_dim]
    for i in range(layers):
        inputs += [_info(f"past_key.{i}", cache), _info(f"past_value.{i}", cache)]
        nodes.append(
            _node(
                "GroupQueryAttention",
                ["q", "k", "v", f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total_sequence_length", "cos", "sin"],
                [f"out.{i}", f"present_key.{i}", f"present_value.{i}"],
                num_heads=shape.heads,
                kv_num_heads=shape.kv_heads,
                do_rotary=1,
            )
        )
        outputs += [_info(f"out.{i}", None), _info(f"present_key.{i}", None), _info(f"present_value.{i}", None)]
    return nodes, inputs, outputs, []


def _sequence_major_graph(shape: AttentionShape, layers: int, block_diagonal: bool) -> tuple[list, list, list, list]:
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    inputs = [
        *_new_token_inputs(shape),
        _info("positions", [1, "T"], TensorProto.INT64),
        _info("write_at", [1], TensorProto.INT64),
        _info("mask", ["T", "S"]),
    ]
    nodes = [
        _node("RotaryEmbedding", ["q", "positions", "cos", "sin"], ["q_rot"], num_heads=heads),
        _node("RotaryEmbedding", ["k", "positions", "cos", "sin"], ["k_rot"], num_heads=kv_heads),
    ]
    constants = []
    if block_diagonal:
        owner = np.repeat(np.arange(kv_heads), heads // kv_heads)  # the key-value head of each query head
        scaled_mask = (np.arange(kv_heads)[:, None] == owner[None]) / np.sqrt(head_dim)  # [H_kv, H]
        constants = [
            numpy_helper.from_array(scaled_mask.astype(np.float32)[:, None, :, None], "query_blocks"),
            numpy_helper.from_array(
                (owner[:, None] == np.arange(kv_heads)[None]).astype(np.float32)[:, None, :, None], "output_blocks"
            ),
            numpy_helper.from_array(np.array([-1, heads, head_dim], np.int64), "per_head"),
            numpy_helper.from_array(np.array([shape.kv_width, -1], np.int64), "block_matrix"),
            numpy_helper.from_array(np.array([-1, shape.kv_width], np.int64), "rows"),
            numpy_helper.from_array(np.array([0, heads, -1], np.int64), "scores_by_head"),
            numpy_helper.from_array(np.array([heads, -1, kv_heads, head_dim], np.int64), "values_by_head"),
            numpy_helper.from_array(np.array([2], np.int64), "kv_axis"),
            numpy_helper.from_array(np.array([1, -1, heads * head_dim], np.int64), "flat"),
        ]
        nodes += [  # queries [1, T, H*D] -> [H_kv * D, H * T], zero outside each head's key-value block
            _node("Reshape", ["q_rot", "per_head"], ["q_heads"]),
            _node("Transpose", ["q_heads"], ["q_columns"], perm=[2, 1, 0]),
            _node("Mul", ["q_columns", "query_blocks"], ["q_blocks"]),
            _node("Reshape", ["q_blocks", "block_matrix"], ["queries"]),
        ]
    outputs = []
    cache = [1, "S", shape.kv_width]
    for i in range(layers):
        key, value = f"present_key.{i}", f"present_value.{i}"
        inputs += [_info(f"past_key.{i}", cache), _info(f"past_value.{i}", cache)]
        nodes += [
            _node("TensorScatter", [f"past_key.{i}", "k_rot", "write_at"], [key], axis=1),
            _node("TensorScatter", [f"past_value.{i}", "v", "write_at"], [value], axis=1),
        ]
        if block_diagonal:
            nodes += [
                _node("Reshape", [key, "rows"], [f"keys.{i}"]),
                _node("Reshape", [value, "rows"], [f"values.{i}"]),
                _node("MatMul", [f"keys.{i}", "queries"], [f"scores.{i}"]),  # [S, H * T]
                _node("Reshape", [f"scores.{i}", "scores_by_head"], [f"scores3.{i}"]),
                _node("Transpose", [f"scores3.{i}"], [f"scores_ht.{i}"], perm=[1, 2, 0]),  # [H, T, S]
                _node("Add", [f"scores_ht.{i}", "mask"], [f"masked.{i}"]),
                _node("Softmax", [f"masked.{i}"], [f"probs.{i}"], axis=-1),
                _node("MatMul", [f"probs.{i}", f"values.{i}"], [f"mixed.{i}"]),  # [H, T, H_kv * D]
                _node("Reshape", [f"mixed.{i}", "values_by_head"], [f"mixed4.{i}"]),
                _node("Mul", [f"mixed4.{i}", "output_blocks"], [f"own.{i}"]),
                _node("ReduceSum", [f"own.{i}", "kv_axis"], [f"heads.{i}"], keepdims=0),  # [H, T, D]
                _node("Transpose", [f"heads.{i}"], [f"tokens.{i}"], perm=[1, 0, 2]),
                _node("Reshape", [f"tokens.{i}", "flat"], [f"out.{i}"]),
            ]
        else:
            nodes.append(
                _node(
                    "Attention", ["q_rot", key, value, "mask"], [f"out.{i}"], q_num_heads=heads, kv_num_heads=kv_heads
                )
            )
        outputs += [_info(f"out.{i}", None), _info(key, None), _info(value, None)]
    return nodes, inputs, outputs, constants


class AttentionBench:
    """The three formulations' sessions, each with ``layers`` blocks on caches holding the same random keys
    and values; ``bind`` prepares a step of new tokens after a context, ``run`` runs it in place."""

    def __init__(self, shape: AttentionShape, layers: int, threads: int | None = None, seed: int = 0) -> None:
        self.shape, self.layers = shape, layers
        rng = np.random.default_rng(seed)
        angles = np.arange(shape.max_context)[:, None] / 10_000 ** (np.arange(0, shape.head_dim, 2) / shape.head_dim)
        tables = [
            numpy_helper.from_array(f(angles).astype(np.float32), n) for f, n in ((np.cos, "cos"), (np.sin, "sin"))
        ]
        options = session_options(threads)  # the engines' options and their process-wide thread pool
        self.sessions = {}
        for name in FORMULATIONS:
            if name == "gqa":
                nodes, inputs, outputs, constants = _gqa_graph(shape, layers)
            else:
                nodes, inputs, outputs, constants = _sequence_major_graph(shape, layers, name == "block_diagonal")
            graph = helper.make_graph(nodes, name, inputs, outputs, tables + constants)
            opsets = [helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]
            model = helper.make_model(graph, opset_imports=opsets, ir_version=11)
            self.sessions[name] = ort.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
        cache = (layers, 2, shape.kv_heads, shape.max_context, shape.head_dim)
        self.bnsh = rng.standard_normal(cache, dtype=np.float32)
        sequence_major = self.bnsh.transpose(0, 1, 3, 2, 4).reshape(layers, 2, 1, shape.max_context, shape.kv_width)
        self.sequence_major = {name: sequence_major.copy() for name in FORMULATIONS[1:]}

    def bind(self, context: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> dict[str, ort.IOBinding]:
        """Bindings of a step of ``T = q.shape[1]`` new tokens that end at ``context`` cached positions."""
        width = q.shape[1]
        past = context - width
        view = min(self.shape.max_context, -(-context // VIEW_ROUNDING) * VIEW_ROUNDING)
        visible = np.arange(view)[None] <= past + np.arange(width)[:, None]
        gqa_step = {
            "seqlens_k": np.array([context - 1], np.int32),
            "total_sequence_length": np.array(context, np.int32),
        }
        sequence_major_step = {
            "positions": (past + np.arange(width))[None],
            "write_at": np.array([past]),
            "mask": np.where(visible, 0.0, -np.inf).astype(np.float32),
        }
        bindings = {}
        for name, session in self.sessions.items():
            binding = session.io_binding()  # it keeps the arrays bound to it alive
            feeds = {"q": q, "k": k, "v": v, **(gqa_step if name == "gqa" else sequence_major_step)}
            for input_name, array in feeds.items():
                binding.bind_cpu_input(input_name, array)
            for i in range(self.layers):
                binding.bind_output(f"out.{i}")  # bound first: get_outputs()[0] is the first block's output
            for i in range(self.layers):
                for j, kind in enumerate(("key", "value")):
                    if name == "gqa":
                        cache = ort.OrtValue.ortvalue_from_numpy(self.bnsh[i, j][None])
                        binding.bind_ortvalue_input(f"past_{kind}.{i}", cache)
                        binding.bind_ortvalue_output(f"present_{kind}.{i}", cache)
                    else:
                        prefix = self.sequence_major[name][i, j][:, :view]
                        view_of = ("cpu", 0, np.float32, list(prefix.shape), prefix.ctypes.data)
                        binding.bind_input(f"past_{kind}.{i}", *view_of)
                        binding.bind_output(f"present_{kind}.{i}", *view_of)
            bindings[name] = binding
        return bindings

    def run(self, name: str, binding: ort.IOBinding) -> np.ndarray:
        """Run one step of formulation ``name``; the first block's output ``[1, T, H * D]``."""
        self.sessions[name].run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()


def new_tokens(
    shape: AttentionShape, width: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random queries, keys and values of ``width`` new tokens."""
    q = rng.standard_normal((1, width, shape.heads * shape.head_dim), dtype=np.float32)
    k, v = (rng.standard_normal((1, width, shape.kv_width), dtype=np.float32) for _ in range(2))
    return q, k, v


def measure(
    bench: AttentionBench, contexts: Sequence[int], widths: Sequence[int], repeats: int, seed: int = 0
) -> list[dict]:
    """Median microseconds per layer of each formulation for each (width, context), and the largest difference
    of each other formulation's output from GroupQueryAttention's. Within every repeat each formulation runs
    ``WARM_STEPS`` untimed steps and then ``TIMED_STEPS`` timed ones, as an engine's step follows its previous
    steps over the same cache: straight after another formulation's steps (whose caches displace its own) a
    step at 1,500 tokens took up to three times as long, for about four steps."""
    rng = np.random.default_rng(seed)
    rows = []
    for width in widths:
        q, k, v = new_tokens(bench.shape, width, rng)
        for context in contexts:
            bindings = bench.bind(context, q, k, v)
            reference = bench.run("gqa", bindings["gqa"])
            differences = {
                name: float(np.abs(bench.run(name, bindings[name]) - reference).max()) for name in FORMULATIONS[1:]
            }
            samples: dict[str, list[float]] = {name: [] for name in FORMULATIONS}
            for _ in range(repeats):
                for name, binding in bindings.items():
                    for step in range(WARM_STEPS + TIMED_STEPS):
                        start = time.perf_counter()
                        bench.sessions[name].run_with_iobinding(binding)
                        if step >= WARM_STEPS:
                            samples[name].append(time.perf_counter() - start)
            micros = {name: 1e6 * statistics.median(times) / bench.layers for name, times in samples.items()}
            rows.append({"new_tokens": width, "context": context, "us_per_layer": micros, "max_abs_diff": differences})
    return rows
