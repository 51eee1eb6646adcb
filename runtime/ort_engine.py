"""ONNX Runtime engine (CPU): an exported decoder graph with preallocated KV buffers and I/O binding.

Each layer's key and value cache is one preallocated buffer [slots, heads, positions, dim] bound as both the
graph's past input and its present output, so GroupQueryAttention writes only the new tokens in place. A
step binds a view of the rows it runs over (the leading rows of a buffer are one contiguous block), so it
costs what those rows cost; rolling back only changes the lengths that become ``seqlens_k``. Every row's
count of new tokens goes in as ``query_seqlens``, so one pass takes any number of new tokens per row; the
tokens go in packed (see ``build_engines.onnx_export``), so its matrix products compute no padding.
The bindings of the cache views are kept per row range; a step binds only its seven small inputs and a fresh
logits array, so the Python work around a run stays small beside the run itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.capi.onnxruntime_pybind11_state import set_global_thread_pool_sizes

from specdec_trt.build_engines.manifest import ROTARY_POSITIONS_KEY
from specdec_trt.runtime.engine import Engine

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
_REBUILD = "rebuild the engines with specdec-build"
FIRST_CACHE_POSITIONS = 512  # positions of each cache row at first; doubled as the sequences need
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


class GraphMismatchError(ValueError):
    """A graph cannot be loaded, or its inputs and outputs are not the shapes its manifest describes."""


def check_graph(session: ort.InferenceSession, spec: OrtModelSpec) -> None:
    """Refuse a graph whose cache inputs or logits differ from ``spec`` (a manifest edited after the build
    would otherwise fail inside ONNX Runtime at the first step)."""
    caches = [i for i in session.get_inputs() if i.name.startswith("past_")]
    grows = bool(caches) and isinstance(caches[0].shape[2], str)  # positions a dimension: the buffers grow
    positions = caches[0].shape[2] if grows else spec.max_context
    expected = [spec.num_kv_heads, positions, spec.head_dim]
    element = "tensor(float16)" if spec.dtype == "float16" else "tensor(float)"
    problems = []
    if grows and (rotary := rotary_positions(session, spec.path)) != spec.max_context:
        problems.append(f"rotary tables for {rotary} positions, not {spec.max_context}")
    if len(caches) != 2 * spec.num_layers:
        problems.append(f"{len(caches) // 2} layers of cache, not {spec.num_layers}")
    if any(list(i.shape[1:]) != expected for i in caches):
        problems.append(f"cache shape {caches[0].shape[1:] if caches else None}, not {expected}")
    if any(i.type != element for i in caches):
        problems.append(f"cache type {caches[0].type if caches else None}, not {spec.dtype}")
    logits = next((o for o in session.get_outputs() if o.name == "logits"), None)
    if logits is None or logits.shape[-1] != spec.vocab_size:
        problems.append(f"logits over {None if logits is None else logits.shape[-1]} tokens, not {spec.vocab_size}")
    if problems:
        raise GraphMismatchError(f"{spec.path} has {'; '.join(problems)} as its manifest says: {_REBUILD}")


def rotary_positions(session: ort.InferenceSession, path: Path) -> int | None:
    """Positions the graph's rotary tables cover: its context (None: it has none), from the model's metadata, or
    for a graph built without it, read from the graph at ``path`` without its weights."""
    recorded = session.get_modelmeta().custom_metadata_map.get(ROTARY_POSITIONS_KEY)
    if recorded is not None:
        return int(recorded)
    import onnx  # a second to import: only for graphs built before the metadata

    graph = onnx.load(str(path), load_external_data=False).graph
    return next((int(i.dims[0]) for i in graph.initializer if i.name == "rope_cos"), None)


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


class OrtEngine(Engine):
    """The Engine protocol over an ONNX Runtime session of a graph made by ``build_engines.onnx_export``.
    ``profile_prefix``: have ONNX Runtime time every node of every run, into a JSON trace whose path
    ``self.session.end_profiling()`` returns (for benchmarks: where a step's time goes).

    Each cache row holds ``FIRST_CACHE_POSITIONS`` positions at first, and all rows double together (up to the
    context) when a pass needs more: a short sequence's pass neither holds nor sweeps a long context's buffer."""

    packs_rows = True

    def __init__(self, spec: OrtModelSpec, threads: int | None = None, profile_prefix: Path | None = None) -> None:
        super().__init__()
        self.spec = spec
        options = session_options(threads)
        if profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = str(profile_prefix)
        try:
            self.session = ort.InferenceSession(str(spec.path), options, providers=["CPUExecutionProvider"])
        except RuntimeError as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise GraphMismatchError(f"ONNX Runtime cannot load {spec.path} ({first_line}): {_REBUILD}") from err
        check_graph(self.session, spec)
        self.vocab_size = spec.vocab_size
        self.max_context = spec.max_context
        self.max_draft_len: int | None = spec.max_draft_len
        self.device = torch.device("cpu")
        self._cache_names = [i.name for i in self.session.get_inputs() if i.name.startswith("past_")]
        fixed = next(i.shape[2] for i in self.session.get_inputs() if i.name == self._cache_names[0])
        # A graph of an older build fixes its buffers at the full context; a newer one's grow as needed.
        self._fixed_positions = fixed if isinstance(fixed, int) else None
        self._positions = self._fixed_positions or min(FIRST_CACHE_POSITIONS, self.max_context)
        self._caches: dict[str, np.ndarray] = {}
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}  # per row range: its cache views, bound

    @property
    def slot_cache_bytes(self) -> int:
        itemsize = np.dtype(_NUMPY_DTYPES[self.spec.dtype]).itemsize
        return len(self._cache_names) * self.spec.num_kv_heads * self.max_context * self.spec.head_dim * itemsize

    def _resize(self, rows: int, keep_rows: int, keep_positions: int) -> None:
        shape = (rows, self.spec.num_kv_heads, self._positions, self.spec.head_dim)
        dtype = _NUMPY_DTYPES[self.spec.dtype]
        old, self._caches = self._caches, {name: np.zeros(shape, dtype) for name in self._cache_names} if rows else {}
        for name, cache in old.items():
            if keep_rows and rows:
                self._caches[name][:keep_rows, :, :keep_positions] = cache[:keep_rows, :, :keep_positions]
        self._bindings = {}

    def _make_room(self, positions: int) -> None:
        """Grow every row of the caches to hold ``positions`` (doubling, up to the context), keeping their tokens."""
        if positions > self._positions:
            self._positions = min(self.max_context, max(2 * self._positions, 1 << (positions - 1).bit_length()))
            self._resize(self.num_slots, len(self._slot_at), int(self._lengths.max(initial=0)))

    def _move_row(self, source: int, destination: int, length: int) -> None:
        for cache in self._caches.values():
            cache[destination, :, :length] = cache[source, :, :length]

    def _swap_rows(self, a: int, b: int, length: int) -> None:
        for cache in self._caches.values():
            kept = cache[a, :, :length].copy()
            cache[a, :, :length] = cache[b, :, :length]
            cache[b, :, :length] = kept

    def _copy_positions(self, source: Engine, source_row: int, row: int, start: int, stop: int) -> None:
        if not isinstance(source, OrtEngine) or not self._same_layout(source):
            raise ValueError("copying a cache needs an engine with the same cache layout (a self-draft)")
        self._make_room(stop)
        for name, cache in self._caches.items():
            cache[row, :, start:stop] = source._caches[name][source_row, :, start:stop]

    def _same_layout(self, source: OrtEngine) -> bool:
        return (
            source._cache_names == self._cache_names
            and source.spec.dtype == self.spec.dtype
            and ((source.spec.num_kv_heads, source.spec.head_dim) == (self.spec.num_kv_heads, self.spec.head_dim))
        )

    def _binding(self, lo: int, rows: int) -> ort.IOBinding:
        """A binding with the views of rows lo .. lo + rows - 1 of every cache as both its past input and its
        present output: written in place by the graph, never copied."""
        binding = self._bindings.get((lo, rows))
        if binding is None:
            binding = self._bindings[(lo, rows)] = self.session.io_binding()
            for name, cache in self._caches.items():
                value = ort.OrtValue.ortvalue_from_numpy(cache[lo : lo + rows])
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(name.replace("past_", "present_"), value)
        return binding

    def _run(
        self, lo: int, token_ids: torch.Tensor, starts: np.ndarray, num_new: np.ndarray, logits_from: np.ndarray
    ) -> torch.Tensor:
        ids = token_ids.cpu().numpy().astype(np.int64)
        rows, width = ids.shape
        real = np.arange(width) < num_new[:, None]  # [rows, width]: the positions that hold new tokens
        offsets = np.cumsum(num_new) - num_new  # each row's first token in the packed order
        counts = num_new - logits_from  # logits asked for per row
        returned = np.arange(int(counts.max())) < counts[:, None]  # [rows, K]
        seqlens = starts + num_new - 1  # each row then holds seqlens + 1 tokens
        self._make_room(int(seqlens.max()) + 1)
        inputs = {
            "input_ids": ids[real][None],
            "unpack_index": offsets[:, None] + np.minimum(np.arange(width), num_new[:, None] - 1),
            "pack_index": np.flatnonzero(real),
            "logits_index": ((offsets + logits_from)[:, None] + np.arange(returned.shape[1]))[returned],
            "seqlens_k": seqlens.astype(np.int32),
            "total_sequence_length": np.array(seqlens.max() + 1, dtype=np.int32),
            "query_seqlens": num_new.astype(np.int32),
        }
        binding = self._binding(lo, rows)
        for name, array in inputs.items():  # bound by address: the arrays live until the run returns
            binding.bind_cpu_input(name, array)
        logits = np.empty((1, len(inputs["logits_index"]), self.vocab_size), dtype=np.float32)
        binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        self.session.run_with_iobinding(binding)
        if returned.all():
            return torch.from_numpy(logits.reshape(*returned.shape, self.vocab_size))
        padded = np.zeros((*returned.shape, self.vocab_size), dtype=np.float32)
        padded[returned] = logits[0]
        return torch.from_numpy(padded)
