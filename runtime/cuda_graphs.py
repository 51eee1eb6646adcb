"""The compact decoder's forward replayed from CUDA graphs.

Dispatched one by one from Python, a small model's kernels cost more to launch than to run: a SmolLM2-135M step
is about 1,500 PyTorch operations (docs/GPU.md). A captured graph replays them all with one launch. A graph has
fixed shapes and addresses, so:

- there is one graph per (new tokens T, attention span) for every row of the cache (its number of slots),
  captured the first time that shape is asked for. Spans are powers of two from ``MIN_SPAN`` up to the max
  context, so a request crosses only a few; positions past each row's length are masked inside the graph,
  from the per-row starts;
- token ids and per-row starts are copied into static buffers before each replay (queued, never waited for),
  and the logits are copied out after it. The KV cache, allocated once per number of slots, is the graphs'
  state;
- an input wider than ``MAX_GRAPH_TOKENS`` (a draft catching up after many plain rounds, say) runs eagerly,
  as vLLM runs batches larger than its largest captured size: each width would otherwise cost a capture.

All graphs draw their intermediate tensors from one memory pool. That is safe because they replay one at a
time on one stream and each replay's logits are copied out before the next replay can overwrite them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_trt.build_engines.model import CompactDecoder
from specdec_trt.runtime.transfer import copy_into

MIN_SPAN = 256  # the shortest attention span a graph is captured for
MAX_GRAPH_TOKENS = 16  # the widest input a graph is captured for (a verify pass takes max_draft_len + 1)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture, as torch.cuda.graphs asks


def attention_span(needed: int, max_context: int) -> int:
    """The smallest power of two, at least ``MIN_SPAN``, that holds ``needed`` positions; at most ``max_context``."""
    span = MIN_SPAN
    while span < needed:
        span *= 2
    return min(span, max_context)


@dataclass
class _Shape:
    """One captured shape: its static token buffer, and the graph with its output once captured."""

    tokens: torch.Tensor  # [B, T] int64
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [B, T, V], written by every replay


class CapturedForward:
    """``model(token_ids, starts, k_cache, v_cache)`` for a CUDA-resident model and cache, replayed from graphs."""

    def __init__(self, model: CompactDecoder, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if k_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model and cache on a CUDA device, not {k_cache.device}")
        self.model = model
        self.cache = (k_cache, v_cache)
        self.starts = torch.zeros(k_cache.shape[1], dtype=torch.int64, device=k_cache.device)
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def num_graphs(self) -> int:
        """How many shapes have been captured."""
        return sum(shape.graph is not None for shape in self._shapes.values())

    def __call__(self, token_ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of ``token_ids`` [B, T] (host or device) placed after ``starts`` [B] (host)."""
        num_new = token_ids.shape[1]
        if num_new > MAX_GRAPH_TOKENS:
            return self.model(token_ids, starts, *self.cache)
        span = attention_span(int(starts.max()) + num_new, self.model.max_context)
        shape = self._shapes.get((num_new, span))
        if shape is None:
            tokens = torch.zeros(len(self.starts), num_new, dtype=torch.int64, device=self.starts.device)
            shape = self._shapes[(num_new, span)] = _Shape(tokens)
        copy_into(shape.tokens, token_ids)
        copy_into(self.starts, starts)
        if shape.graph is None:
            self._capture(shape, span)
        shape.graph.replay()
        return shape.logits.clone()

    def _capture(self, shape: _Shape, span: int) -> None:
        """Capture ``shape``. The warm-up runs compute the very call being made (the static buffers already
        hold its inputs), so the keys and values they write are the ones the replay writes again."""

        def run() -> torch.Tensor:
            return self.model(shape.tokens, self.starts, *self.cache, attended=span)

        side = torch.cuda.Stream(self.starts.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            shape.logits = run()
        shape.graph = graph
