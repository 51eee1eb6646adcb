"""The memory-bandwidth limit of decoding: the machine's read bandwidth, and the weight bytes a step reads.

A decode step of one token reads every weight once (the embedding table only for its one row, unless the
output head reads it too), so weight bytes per token x tokens/s is the bandwidth a method uses, and the
machine's streaming read rate over those bytes is the most tokens/s any plain decoder can reach on it.
"""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import onnx
import torch

from specdec_trt.bench.runners import torch_threads

EMBEDDING_OPS = {"Gather", "GatherBlockQuantized"}  # ops that read one row of a table per token


def machine_read_bandwidth(threads: int, gigabytes: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a streaming read on ``threads`` threads: a torch sum over a buffer far larger than the
    caches, best of ``repeats``."""
    buffer = torch.ones(int(gigabytes * 1e9 / 4))
    with torch_threads(threads):
        best = min(_seconds(buffer.sum) for _ in range(repeats))
    return buffer.numel() * 4 / best / 1e9


def _seconds(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


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
