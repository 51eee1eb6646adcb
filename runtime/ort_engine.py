"""ONNX Runtime engine (CPU): an exported decoder graph with preallocated KV buffers and I/O binding.

Each layer's key and value cache is one preallocated buffer bound as both the graph's past input and its
present output, so GroupQueryAttention writes only the new tokens in place. Truncation only changes the
per-row lengths that become ``seqlens_k``. Every row's count of new tokens goes in as ``query_seqlens``,
so any batch takes any number of new tokens per row in one pass: a batched verify reads the weights once.

The caches are bound once per batch (one IOBinding kept with the buffers); a step binds only its five small
inputs and a fresh logits array, so the Python work around a run stays small beside the run itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.capi.onnxruntime_pybind11_state import set_global_thread_pool_sizes

from specdec_trt.runtime.engine import check_prompt_lengths, check_room, check_truncate

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
_pool_threads: int | None = None  # intra-op threads of the process-wide pool, once set (0: one per core)


@dataclass(frozen=True)
class OrtModelSpec:
    """What the runtime needs to know about an exported graph (from the engine manifest)."""

    path: Path
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    max_draft_len: int
    dtype: str = "float32"


def size_thread_pool(threads: int | None = None) -> None:
    """Size the process-wide pool of intra-op threads that every session shares (``None``: one per core).
    The first call decides; a later call that names another size is an error."""
    global _pool_threads
    if _pool_threads is None:
        set_global_thread_pool_sizes(threads or 0, 1)
        _pool_threads = threads or 0
    elif threads and threads != _pool_threads:
        raise ValueError(
            f"ONNX Runtime's thread pool is process-wide and already has {_pool_threads or 'one per core'} "
            f"threads; {threads} cannot be set for another engine in this process"
        )


def session_options(threads: int | None = None) -> ort.SessionOptions:
    """Session options for decoding: the graph is already fused offline, so only basic optimisation runs
    at load. Sessions share one process-wide thread pool of ``threads`` intra-op threads (default: one per
    core), sized by the first engine: with a pool per session, the idle session's spinning threads steal
    the cores from the session that runs."""
    size_thread_pool(threads)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.use_per_session_threads = False
    return options


class OrtEngine:
    """Engine protocol over an ONNX Runtime session of a graph made by ``build_engines.onnx_export``."""

    def __init__(self, spec: OrtModelSpec, threads: int | None = None) -> None:
        self.spec = spec
        options = session_options(threads)
        self.session = ort.InferenceSession(str(spec.path), options, providers=["CPUExecutionProvider"])
        self.vocab_size = spec.vocab_size
        self.max_context = spec.max_context
        self.max_draft_len: int | None = spec.max_draft_len
        self.device = torch.device("cpu")
        self._cache_names = [i.name for i in self.session.get_inputs() if i.name.startswith("past_")]
        self._caches: dict[str, np.ndarray] = {}
        self._binding: ort.IOBinding | None = None  # the caches bound as past inputs and present outputs
        self._lengths = np.zeros(0, dtype=np.int64)

    @property
    def lengths(self) -> torch.Tensor:
        return torch.from_numpy(self._lengths.copy())

    def prefill(self, token_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        batch, width = token_ids.shape
        check_room(torch.tensor([width]), 0, self.max_context)
        check_prompt_lengths(lengths, batch, width)
        self._allocate(batch)
        real = lengths.numpy().astype(np.int64)
        # An empty past: each row's new tokens are its real prompt; the padding after them is not cached.
        logits = self._run(token_ids.numpy(), (real - 1)[:, None], real - 1, real)
        self._lengths = real.copy()
        return torch.from_numpy(logits[:, 0])

    def adopt_prompt_cache(self, source: OrtEngine) -> None:
        """Start a batch from another engine's cache instead of a prefill: copy the keys and values of its
        cached prompts. For a self-draft (the target quantized), whose caches have the target's layout:
        its own pass over the prompt would cost more than the target's, and it then drafts on the
        target's keys and values (drafts are verified, so only the acceptance rate can change)."""
        self._check_same_layout(source)
        batch = next(iter(source._caches.values())).shape[0]
        self._allocate(batch)
        self._lengths = np.zeros(batch, dtype=np.int64)
        self.adopt_cache(source, source._lengths.tolist())

    def adopt_cache(self, source: OrtEngine, stops: Sequence[int]) -> None:
        """Extend each row r of the cache to ``stops[r]`` tokens by copying the keys and values it lacks from
        ``source`` (same layout: a self-draft), which must hold them: how a self-draft catches up with tokens
        the target has processed, without a pass of its own."""
        self._check_same_layout(source)
        stops = np.asarray(stops, dtype=np.int64)
        if len(stops) != len(self._lengths) or len(stops) != len(source._lengths):
            raise ValueError(f"adopt_cache: {len(stops)} rows to extend, the engines hold {len(self._lengths)}")
        if (stops > source._lengths).any() or (stops < self._lengths).any():
            raise ValueError(
                f"adopt_cache extends rows of {self._lengths.tolist()} tokens to {stops.tolist()} from a source "
                f"holding {source._lengths.tolist()}: it only extends, with tokens the source holds"
            )
        check_room(torch.from_numpy(stops), 0, self.max_context)
        for row, (start, stop) in enumerate(zip(self._lengths.tolist(), stops.tolist())):
            if start == stop:
                continue
            for name, cache in self._caches.items():
                cache[row, :, start:stop] = source._caches[name][row, :, start:stop]
        self._lengths = stops.copy()

    def fork_cache(self, source: OrtEngine, lengths: Sequence[int], row: int = 0) -> None:
        """Start a batch of ``len(lengths)`` rows from one cached row of ``source`` (same layout: a
        self-draft): row r holds its first ``lengths[r]`` tokens. Several continuations of one sequence, each
        from its own point, then run as one batch without a prefill of their own."""
        self._check_same_layout(source)
        stops = np.asarray(lengths, dtype=np.int64)
        if not 0 <= row < len(source._lengths) or (stops < 0).any() or (stops > source._lengths[row]).any():
            raise ValueError(
                f"fork_cache: lengths {stops.tolist()} of row {row} from a source holding {source._lengths.tolist()}"
            )
        self._allocate(len(stops))
        longest = int(stops.max(initial=0))
        for name, cache in self._caches.items():
            cache[:, :, :longest] = source._caches[name][row, :, :longest]
        self._lengths = stops.copy()

    def _check_same_layout(self, source: OrtEngine) -> None:
        if source._cache_names != self._cache_names or source.spec.dtype != self.spec.dtype:
            raise ValueError("adopting a cache needs an engine with the same cache layout (a self-draft)")
        if not source._caches:
            raise RuntimeError("the source engine has no cached prompt: prefill it first")
        _, heads, _, dim = next(iter(source._caches.values())).shape
        if (heads, dim) != (self.spec.num_kv_heads, self.spec.head_dim):
            raise ValueError("adopting a cache needs an engine with the same cache layout (a self-draft)")

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not self._caches:
            raise RuntimeError("forward() before prefill(): start a batch with prefill first")
        check_room(torch.from_numpy(self._lengths), token_ids.shape[1], self.max_context)
        ids = token_ids.cpu().numpy().astype(np.int64)
        batch, new = ids.shape
        positions = np.broadcast_to(np.arange(new, dtype=np.int64), (batch, new))
        logits = self._run(ids, positions, self._lengths + new - 1, np.full(batch, new))
        self._lengths = self._lengths + new
        return torch.from_numpy(logits)

    def truncate(self, lengths: torch.Tensor | int) -> None:
        self._lengths = check_truncate(torch.from_numpy(self._lengths), lengths).numpy()

    def close(self) -> None:
        self._caches, self._binding = {}, None
        self._lengths = np.zeros(0, dtype=np.int64)

    def _allocate(self, batch: int) -> None:
        """The KV buffers for a batch of ``batch`` rows, kept from the last batch when it had as many."""
        if not self._caches or next(iter(self._caches.values())).shape[0] != batch:
            shape = (batch, self.spec.num_kv_heads, self.max_context, self.spec.head_dim)
            self._caches = {name: np.zeros(shape, _NUMPY_DTYPES[self.spec.dtype]) for name in self._cache_names}
            self._binding = self._bind_caches()

    def _bind_caches(self) -> ort.IOBinding:
        """A binding with every cache as both its past input and its present output: written in place by the
        graph, never copied."""
        binding = self.session.io_binding()
        for name, array in self._caches.items():
            value = ort.OrtValue.ortvalue_from_numpy(array)
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name.replace("past_", "present_"), value)
        return binding

    def _run(self, ids: np.ndarray, positions: np.ndarray, seqlens: np.ndarray, new: np.ndarray) -> np.ndarray:
        """One run over the bound caches: ``new[b]`` tokens of row ``b`` of ``ids`` [B, T] enter its cache, which
        then holds ``seqlens[b] + 1``; the logits at ``positions`` [B, K] land in a fresh array (callers may
        keep them)."""
        inputs = {
            "input_ids": np.ascontiguousarray(ids),
            "logits_index": np.ascontiguousarray(positions),
            "seqlens_k": seqlens.astype(np.int32),
            "total_sequence_length": np.array(seqlens.max() + 1, dtype=np.int32),
            "query_seqlens": new.astype(np.int32),
        }
        for name, array in inputs.items():  # bound by address: the arrays live until the run returns
            self._binding.bind_cpu_input(name, array)
        logits = np.empty((*positions.shape, self.vocab_size), dtype=np.float32)
        self._binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        self.session.run_with_iobinding(self._binding)
        return logits
