"""What a server opens and how it is deployed, as plain data: the decoder's options (so that every Ray Serve
replica opens the decoder the single server does, with the defaults of ``specdec_trt.policy``) and the
replicas' plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec_trt.backend import BackendOptions
from specdec_trt.cli_options import describe
from specdec_trt.draft_spec import DraftLength
from specdec_trt.policy import choose_draft
from specdec_trt.prefill import DEFAULT_PREFILL_CHUNK_ROUNDS

WARM_UP_TOKENS = 4  # of the warm-up request's prompt, and as many new ones

if TYPE_CHECKING:
    from rich.console import Console

    from specdec_trt.decoder import SpeculativeDecoder


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
        """The decoder (building the default engines first if needed, shown on ``err``), its cost models seeded by
        the engines' profile (the one kept beside them, or one measured now), warmed up."""
        from specdec_trt.decoder import SpeculativeDecoder

        resolved = self.backend.resolved(err)
        spec, gamma = choose_draft(resolved.engines, self.draft, self.num_draft_tokens)
        decoder = SpeculativeDecoder.from_loaded(
            resolved.open([spec], err),
            gamma,
            draft=spec,
            max_batch_size=self.max_batch_size,
            max_queue=self.max_queue,
            prefill_chunk_rounds=self.prefill_chunk_rounds or None,
            prefix_cache=self.prefix_cache,
        )
        if not decoder.profiled:  # measured before the first request, not inside it
            with err.status("Timing the engines for this machine (once: kept beside engine directories)…"):
                try:
                    decoder.profile()
                except OSError as error:
                    err.print(
                        f"[yellow]The profile could not be kept[/yellow] ({describe(error)}): measured again next start"
                    )
        warm_up(decoder)
        return decoder


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


def warm_up(decoder: SpeculativeDecoder) -> None:
    """One short request through the target and the draft before the server reports ready, so that the first
    client's request pays none of ONNX Runtime's first-run allocations; forgotten after (nothing of it stays
    cached or in the store)."""
    from specdec_trt.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=WARM_UP_TOKENS, ignore_eos=True)
    decoder.generate(list(range(WARM_UP_TOKENS)), params, 1 if decoder.drafter is not None else 0)
    decoder.reset_prefix_cache()
