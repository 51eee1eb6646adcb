"""The memory-bandwidth limit of decoding: the machine's bandwidth, and the weight bytes a step reads.

A decode step of one token reads every weight once (the embedding table only for its one row, unless the
output head reads it too), so weight bytes per token x tokens/s is the bandwidth a method uses, and the
machine's streaming read rate over those bytes is the most tokens/s any plain decoder can reach on it. The
gauge is STREAM's (read, copy, triad; best and median of repeats); beside it, the rate ONNX Runtime's float32
matrix-vector product reaches, the part of that bound our float32 engines can use.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from specdec_trt.bench.runners import torch_threads
from specdec_trt.runtime.ort_engine import session_options

EMBEDDING_OPS = {"Gather", "GatherBlockQuantized"}  # ops that read one row of a table per token


STREAM_KERNELS = ("read", "copy", "triad")


@dataclass(frozen=True)
class Rate:
    """GB/s of repeated runs of one kernel: the best and the median."""

    best: float
    median: float


def stream_bandwidth(threads: int, gigabytes: float = 0.25, repeats: int = 10) -> dict[str, Rate]:
    """Memory bandwidth as STREAM measures it, on ``threads`` threads over buffers of ``gigabytes`` each (far
    larger than the caches): read (a sum over one buffer), copy (b = a: one read and one write) and triad
    (a = b + s c: two reads and a write), each repeated ``repeats`` times after a warm-up."""
    count = int(gigabytes * 1e9 / 4)
    a, b, c = torch.ones(count), torch.ones(count), torch.ones(count)
    kernels = {
        "read": (a.sum, 1),
        "copy": (lambda: b.copy_(a), 2),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3),
    }
    with torch_threads(threads):
        return {name: _rate(kernel, buffers * count * 4, repeats) for name, (kernel, buffers) in kernels.items()}


def matrix_vector_bandwidth(threads: int | None = None, gigabytes: float = 0.15, repeats: int = 10) -> Rate:
    """GB/s of ONNX Runtime's float32 matrix-vector product on the process's thread pool (``session_options``:
    the engines' where they made one, else ``threads``, default one per core): one token's pass through
    576 x 3,072 weights (SmolLM2-135M's fused gate and up projections), as many as make ``gigabytes``, chained
    in one graph. The rate a float32 decode step's matrix work reaches on this machine's ONNX Runtime."""
    rows, cols = 576, 3072
    layers = max(1, int(gigabytes * 1e9 / (rows * cols * 4)))
    generator = np.random.default_rng(0)
    nodes, initializers, outputs = [], [], []
    for layer in range(layers):  # each its own weights: identical initializers could be shared
        weights = generator.standard_normal((rows, cols), dtype=np.float32)
        initializers.append(numpy_helper.from_array(weights, f"w{layer}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w{layer}"], [f"y{layer}"]))
        outputs.append(helper.make_tensor_value_info(f"y{layer}", TensorProto.FLOAT, [1, cols]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])]
    model = helper.make_model(
        helper.make_graph(nodes, "matrix_vector", inputs, outputs, initializers),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 9
    options = session_options(threads)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.ones((1, rows), np.float32)
    return _rate(lambda: session.run(None, {"x": x}), layers * rows * cols * 4, repeats)


def _rate(kernel, moved_bytes: int, repeats: int) -> Rate:
    kernel()  # warm-up: first touches, allocations
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel()
        seconds.append(time.perf_counter() - start)
    return Rate(moved_bytes / min(seconds) / 1e9, moved_bytes / statistics.median(seconds) / 1e9)


def onnx_weight_bytes(graph: Path) -> int:
    """Bytes of initializers a step of ``graph`` reads: all of them but tables only looked up by row."""
    model = onnx.load(str(graph), load_external_data=False)
    consumers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    total = 0
    for initializer in model.graph.initializer:
        if consumers.get(initializer.name, set()) <= EMBEDDING_OPS and initializer.name in consumers:
            continue
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(initializer.data_type).itemsize
        total += int(np.prod(initializer.dims, dtype=np.int64)) * itemsize
    return total


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of tensors a llama.cpp step reads from ``path``: all of them, less the token embedding table when
    a separate output head exists (otherwise the head is that table, read whole)."""
    tensors = {tensor.name: int(tensor.n_bytes) for tensor in gguf.GGUFReader(path).tensors}
    embedding = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0
    return sum(tensors.values()) - embedding


def module_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a torch model's parameters a step reads: each tensor once (tied ones share storage), less the
    embedding tables that no linear layer (an output head) also reads."""
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    read_whole = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    tables = {
        m.weight.data_ptr(): m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.weight.data_ptr() not in read_whole
    }
    return sum(unique.values()) - sum(tables.values())
