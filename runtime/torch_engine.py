"""PyTorch engine: the compact decoder with a static KV cache, eager on the CPU, replayed from CUDA graphs on a
CUDA device (``cuda_graphs``), optionally compiled by ``torch.compile`` into fused kernels."""

from __future__ import annotations

import torch

from specdec_trt.build_engines.checkpoint import Checkpoint
from specdec_trt.build_engines.model import CompactDecoder
from specdec_trt.runtime.cpu_linear import transpose_linears
from specdec_trt.runtime.cuda_graphs import CapturedForward
from specdec_trt.runtime.engine import check_prompt_lengths, check_room, check_truncate

DEFAULT_MAX_CONTEXT = 4096


class TorchEngine:
    """Engine protocol over ``CompactDecoder``. The cache is allocated once per batch size and reused;
    truncation only moves the per-row length pointers (kept on the host, so no step waits for the device).

    On a CPU the linear layers keep their weights transposed (``cpu_linear``): a step over several rows
    then needs no repacking of its weights.

    ``cuda_graphs`` (default: on for a CUDA device) replays ``forward`` from CUDA graphs captured per shape;
    ``prefill`` always runs without graphs. False runs every step eagerly, as vLLM's ``enforce_eager``.

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
        self.max_draft_len: int | None = None  # any number of new tokens per forward
        self.dtype = next(model.parameters()).dtype
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._captured: CapturedForward | None = None  # the graphs over this cache, with cuda_graphs
        self._lengths = torch.zeros(0, dtype=torch.int64)

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
    def lengths(self) -> torch.Tensor:
        return self._lengths.clone()

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured for the current batch size (0 when eager)."""
        return 0 if self._captured is None else self._captured.num_graphs

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        batch, width = token_ids.shape
        check_room(torch.tensor([width]), 0, self.max_context)
        check_prompt_lengths(lengths, batch, width)
        if self._cache is None or self._cache[0].shape[1] != batch:
            self._cache = self.model.new_cache(batch, self.dtype, self.device)
            self._captured = CapturedForward(self.model, *self._cache) if self.cuda_graphs else None
        logits = self.model(token_ids, torch.zeros(batch, dtype=torch.int64), *self._cache, logits_at=lengths - 1)
        self._lengths = lengths.to(torch.int64).clone()
        return logits

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._cache is None:
            raise RuntimeError("forward() before prefill(): start a batch with prefill first")
        check_room(self._lengths, token_ids.shape[1], self.max_context)
        if self._captured is not None:
            logits = self._captured(token_ids, self._lengths)
        else:
            logits = self.model(token_ids, self._lengths, *self._cache)
        self._lengths += token_ids.shape[1]
        return logits

    def truncate(self, lengths: torch.Tensor | int) -> None:
        self._lengths = check_truncate(self._lengths, lengths)

    def close(self) -> None:
        self._cache = self._captured = None
        self._lengths = torch.zeros(0, dtype=torch.int64)
