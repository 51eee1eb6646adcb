"""What a server opens and how it is deployed, as plain data: the decoder's options (so that every Ray Serve
replica opens the decoder the single server does, with the defaults of ``specdec_trt.policy``) and the
replicas' plan."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console

from specdec_trt.backend import BackendOptions
from specdec_trt.decoder import DraftLength, SpeculativeDecoder
from specdec_trt.policy import choose_draft
from specdec_trt.prefill import DEFAULT_PREFILL_CHUNK_ROUNDS


@dataclass(frozen=True)
class DecoderOptions:
    """specdec-serve's backend and draft options, its slots and waiting queue, and how long a prefill chunk
    may hold up the running requests (``prefill_chunk_rounds``, in rounds; 0: no bound), and whether ended requests'
    keys and values are kept for later requests that share their prefix (``prefix_cache``)."""

    backend: BackendOptions
    draft: str
    num_draft_tokens: DraftLength | None
    max_batch_size: int
    max_queue: int
    prefill_chunk_rounds: float = DEFAULT_PREFILL_CHUNK_ROUNDS
    prefix_cache: bool = True

    def open(self, err: Console) -> SpeculativeDecoder:
        """The decoder (building the default engines first if needed, shown on ``err``)."""
        resolved = self.backend.resolved(err)
        spec, gamma = choose_draft(resolved.engines, self.draft, self.num_draft_tokens)
        return SpeculativeDecoder.from_loaded(
            resolved.open([spec], err),
            gamma,
            draft=spec,
            max_batch_size=self.max_batch_size,
            max_queue=self.max_queue,
            prefill_chunk_rounds=self.prefill_chunk_rounds or None,
            prefix_cache=self.prefix_cache,
        )


@dataclass(frozen=True)
class ReplicaPlan:
    """Ray Serve replicas: how many (``replicas``, or autoscaling from it up to ``max_replicas``), the CPUs (and
    threads) each one takes, the seconds a stopping replica gives its requests in flight, where Ray's proxy
    listens, the cluster (``address`` None: one started here) and the log level."""

    replicas: int = 1
    max_replicas: int | None = None
    threads: int = 1
    drain_timeout: float = 30.0
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None
    log_level: str = "info"
