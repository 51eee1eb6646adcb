"""Where a decode step of an ONNX Runtime engine goes: matrix products against everything else.

A plain decode step that reads its weights at the machine's bandwidth spends its time in matrix products;
attention, norms, activations, the host's work around the run and the idle gaps between kernels are the
share that keeps it from the bandwidth limit. ONNX Runtime's profiler times every node of a second session
of the same graph, and the wall clock times the whole step, so the shares add up to the step.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdec_trt.runtime.ort_engine import OrtEngine, OrtModelSpec

MATRIX_OPS = {"MatMul", "MatMulNBits", "Gemm", "FusedMatMul", "MatMulInteger", "DynamicQuantizeMatMul"}
ATTENTION_OPS = {"GroupQueryAttention", "MultiHeadAttention", "Attention"}


def step_breakdown(spec: OrtModelSpec, context: int = 100, steps: int = 32, rows: int = 1, width: int = 1) -> dict:
    """Milliseconds per pass of ``spec``'s graph over ``rows`` sequences of ``context`` cached tokens each,
    ``width`` new tokens a row (1: a decode step; more: a verify pass, logits of every token), split into
    matrix products, attention, other nodes, and what the nodes do not account for (the host's work and the
    gaps between kernels); each with its share of the pass."""
    context = max(1, min(context, spec.max_context - steps * width))  # a small engine holds fewer positions
    with tempfile.TemporaryDirectory() as scratch:
        engine = OrtEngine(spec, profile_prefix=Path(scratch) / "step")
        engine.reserve(rows)
        prompt = torch.arange(context).remainder(spec.vocab_size)[None]
        for slot in range(rows):  # one prefill run each: the profile skips them
            engine.admit(slot)
            engine.step([slot], prompt, logits_from=[context - 1])
        slots = list(range(rows))
        start = time.perf_counter()
        for step in range(steps):
            engine.step(slots, torch.arange(step, step + rows * width).remainder(spec.vocab_size).view(rows, width))
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
        trace = json.loads(Path(engine.session.end_profiling()).read_text())
    per_kind = _node_milliseconds(trace, prefills=rows)
    nodes = sum(per_kind.values())
    parts = {kind: ms / steps for kind, ms in per_kind.items()} | {"outside nodes": max(wall_ms - nodes / steps, 0.0)}
    return {
        "context": context,
        "rows": rows,
        "width": width,
        "steps": steps,
        "step_ms": wall_ms,
        "ms": parts,
        "share": {kind: ms / wall_ms for kind, ms in parts.items()},
        "not_matrix_share": 1.0 - parts.get("matrix", 0.0) / wall_ms,
    }


def _node_milliseconds(trace: list[dict], prefills: int = 1) -> dict[str, float]:
    """Total milliseconds of the trace's node kernels per kind (matrix, attention, other nodes), over the
    runs after the first ``prefills``."""
    runs = [event for event in trace if event.get("cat") == "Session" and event.get("name") == "model_run"]
    if len(runs) <= prefills:
        raise RuntimeError("the profile holds no decode run")
    decode_start = runs[prefills]["ts"]
    totals: dict[str, float] = defaultdict(float)
    for event in trace:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        if event["ts"] < decode_start:
            continue
        op = event.get("args", {}).get("op_name", "")
        kind = "matrix" if op in MATRIX_OPS else "attention" if op in ATTENTION_OPS else "other nodes"
        totals[kind] += event["dur"] / 1e3
    return dict(totals)
