"""PyTorch engine: the compact decoder with a static KV cache, eager on the CPU, replayed from CUDA graphs on a
CUDA device (``cuda_graphs``), optionally compiled by ``torch.compile`` into fused kernels."""

from __future__ import annotations

import numpy as np
import torch

from specdec_trt.build_engines.checkpoint import Checkpoint
from specdec_trt.build_engines.model import CompactDecoder
from specdec_trt.runtime.cpu_linear import transpose_linears
from specdec_trt.runtime.cuda_graphs import MAX_GRAPH_TOKENS, CapturedForward
from specdec_trt.runtime.engine import Engine
from specdec_trt.runtime.transfer import to_device

DEFAULT_MAX_CONTEXT = 4096


class TorchEngine(Engine):
    """The Engine protocol over ``CompactDecoder``. The cache [layers, slots, heads, positions, dim] is
    allocated when slots are reserved; a step runs over a view of its rows, and rolling back only moves the
    per-slot length pointers (kept on the host, so no step waits for the device).

    On a CPU the linear layers keep their weights transposed (``cpu_linear``): a step over several rows
    then needs no repacking of its weights.

    ``cuda_graphs`` (default: on for a CUDA device) replays steps of up to ``MAX_GRAPH_TOKENS`` new tokens
    from CUDA graphs captured for every slot of the cache (``cuda_graphs``); rows a step does not name get
    tokens written past their length, which nothing reads. Wider steps (prefill chunks) and a step that would
    leave some row no room for those tokens run eagerly. False runs every step eagerly, as vLLM's
    ``enforce_eager``.

    ``compiled`` runs the decoder layers through ``torch.compile`` (Inductor): norms, rotary embeddings, cache
    writes and activations become a few fused kernels per layer instead of dozens, which is what bounds a small
    model's step on a GPU. Layers are compiled one by one, so every layer of every engine with the same layer
    shapes shares one compiled function (compiling a whole model as one graph takes far longer, per input
    shape). The first call of each kind compiles (a prompt, T = 1, T > 1; lengths stay dynamic); graphs, when on,
    are captured around the compiled code."""

    def __init__(
        self,
        model: CompactDecoder,
        device: torch.device | str = "cpu",
        cuda_graphs: bool | None = None,
        compiled: bool = False,
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this engine is on {self.device}")
        self.model = model.to(self.device).eval()
        if self.device.type == "cpu":
            transpose_linears(self.model)
        self.compiled = compiled
        if compiled:
            for layer in self.model.model.layers:  # one compiled function serves every layer: same code, same shapes
                layer.compile(dynamic=True, fullgraph=True)
        self.vocab_size = model.config.vocab_size
        self.max_context = model.max_context
        self.max_draft_len: int | None = None  # any number of new tokens per step
        self.dtype = next(model.parameters()).dtype
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._captured: CapturedForward | None = None  # the graphs over every slot, with cuda_graphs

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        max_context: int | None = None,
        device: torch.device | str = "cpu",
        cuda_graphs: bool | None = None,
        compiled: bool = False,
    ) -> TorchEngine:
        """Build an engine from loaded weights; ``max_context`` defaults to what the model supports, at
        most ``DEFAULT_MAX_CONTEXT`` (the KV cache is allocated for all of it up front)."""
        limit = checkpoint.config.max_context
        if max_context is not None and max_context > limit:
            raise ValueError(f"max_context {max_context} exceeds what {checkpoint.source} supports ({limit})")
        model = CompactDecoder(checkpoint.config, max_context or min(limit, DEFAULT_MAX_CONTEXT))
        model.load_weights(checkpoint.state_dict)
        dtype = next(iter(checkpoint.state_dict.values())).dtype
        return cls(model.to(dtype), device, cuda_graphs, compiled)

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured for the current number of slots (0 when eager)."""
        return 0 if self._captured is None else self._captured.num_graphs

    @property
    def slot_cache_bytes(self) -> int:
        c = self.model.config
        return 2 * c.num_layers * c.num_kv_heads * self.max_context * c.head_dim * self.dtype.itemsize

    def _resize(self, rows: int, keep_rows: int, keep_positions: int) -> None:
        old, self._cache, self._captured = self._cache, None, None
        if rows:
            self._cache = self.model.new_cache(rows, self.dtype, self.device)
            if old is not None and keep_rows:
                for new_part, old_part in zip(self._cache, old):
                    new_part[:, :keep_rows, :, :keep_positions] = old_part[:, :keep_rows, :, :keep_positions]
            self._captured = CapturedForward(self.model, *self._cache) if self.cuda_graphs else None

    def _move_row(self, source: int, destination: int, length: int) -> None:
        for part in self._cache:
            part[:, destination, :, :length] = part[:, source, :, :length]

    def _swap_rows(self, a: int, b: int, length: int) -> None:
        for part in self._cache:
            kept = part[:, a, :, :length].clone()
            part[:, a, :, :length] = part[:, b, :, :length]
            part[:, b, :, :length] = kept

    def _copy_positions(self, source: Engine, source_row: int, row: int, start: int, stop: int) -> None:
        if not isinstance(source, TorchEngine) or source._cache[0].shape[2:] != self._cache[0].shape[2:]:
            raise ValueError("copying a cache needs an engine with the same cache layout (a self-draft)")
        for part, source_part in zip(self._cache, source._cache):
            part[:, row, :, start:stop] = source_part[:, source_row, :, start:stop]

    @torch.inference_mode()
    def _run(
        self, lo: int, token_ids: torch.Tensor, starts: np.ndarray, num_new: np.ndarray, logits_from: np.ndarray
    ) -> torch.Tensor:
        rows, width = token_ids.shape
        counts = num_new - logits_from
        wanted = None  # every position's logits, as the pass computes them
        if logits_from.any() or counts.max() < width:  # [rows, K]: the positions asked for, clamped to each row's own
            index = logits_from[:, None] + np.arange(int(counts.max()))
            wanted = torch.from_numpy(np.minimum(index, num_new[:, None] - 1))
        logits = None
        if self._captured is not None and width <= MAX_GRAPH_TOKENS:
            every = np.zeros(self.num_slots, dtype=np.int64)  # per cache row; free rows hold nothing
            every[: len(self._slot_at)] = self._lengths[self._slot_at]
            every[lo : lo + rows] = starts
            if int(every.max()) + width <= self.max_context:  # every row has room for the tokens it is given
                tokens = torch.zeros(self.num_slots, width, dtype=torch.int64, device=token_ids.device)
                tokens[lo : lo + rows] = token_ids
                logits = self._captured(tokens, torch.from_numpy(every))[lo : lo + rows]
                if wanted is not None:
                    at = to_device(wanted, logits.device)  # queued: no host sync
                    logits = logits[torch.arange(rows, device=logits.device)[:, None], at]
        if logits is None:
            k_cache, v_cache = (part[:, lo : lo + rows] for part in self._cache)
            logits = self.model(token_ids, torch.from_numpy(starts), k_cache, v_cache, logits_at=wanted)
        beyond = np.arange(logits.shape[1]) >= counts[:, None]  # past a row's own logits: 0, as in every engine
        if beyond.any():
            logits = logits.masked_fill(to_device(torch.from_numpy(beyond), logits.device)[..., None], 0.0)
        return logits
