"""Prometheus metrics of the server, with vLLM's names and semantics under the ``specdec:`` prefix.

Speculative decoding, as vLLM counts it: ``spec_decode_num_drafts`` (rounds that drafted at least one token,
per request), ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
``spec_decode_num_accepted_tokens_per_pos`` (by draft position). So the acceptance rate is accepted / draft
tokens and the mean acceptance length 1 + accepted / drafts (docs/SERVING.md has the PromQL); of those, the
drafts copied from earlier requests' text (the store) are counted apart too. The prefix cache, as vLLM counts it:
``prefix_cache_queries`` (prompt tokens looked up) and ``prefix_cache_hits`` (those found cached). A request's
counts are added when it ends, whatever the reason, so they equal the sums over the responses.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec_trt.request import FINISH_REASONS, GenerationOutput

PREFIX = "specdec:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960)
ROUND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    """The server's metrics in a registry of their own (so that several servers fit one process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry)

        self._labels = labels
        self.num_drafts = counter("spec_decode_num_drafts", "Rounds that drafted at least one token, per request.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.", ("position",)
        )
        self.store_draft_tokens = counter(
            "spec_decode_num_store_draft_tokens", "Draft tokens proposed from earlier requests' text (the store)."
        )
        self.store_accepted_tokens = counter(
            "spec_decode_num_store_accepted_tokens", "Draft tokens from earlier requests' text accepted."
        )
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (what usage counts).")
        self.request_success = counter("request_success", "Requests ended, by finish reason.", ("finished_reason",))
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.running = Gauge(
            PREFIX + "num_requests_running", "Requests in a slot.", ["model_name"], registry=self.registry
        )
        self.waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting for a slot.", ["model_name"], registry=self.registry
        )
        self.draft_length = Gauge(
            PREFIX + "spec_decode_draft_length",
            "Mean drafts per row in the latest round (the current draft length).",
            ["model_name"],
            registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive text deltas.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting for a slot.", E2E_BUCKETS)
        self.round = histogram("round_time_seconds", "Time of one speculative round (draft and verify).", ROUND_BUCKETS)

    def track_queue(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Read the scheduler's running and waiting counts at every scrape."""
        self.running.labels(**self._labels).set_function(running)
        self.waiting.labels(**self._labels).set_function(waiting)

    def observe_round(self, seconds: float, num_drafted: list[int]) -> None:
        """From the engine thread, after each round."""
        self.round.labels(**self._labels).observe(seconds)
        self.draft_length.labels(**self._labels).set(sum(num_drafted) / max(len(num_drafted), 1))

    def observe_gap(self, seconds: float) -> None:
        self.itl.labels(**self._labels).observe(seconds)

    def observe_finished(self, output: GenerationOutput) -> None:
        """Add an ended request's counts; its latencies too when it ran to its end."""
        stats, name = output.stats, self._labels["model_name"]
        self.request_success.labels(name, output.finish_reason).inc()
        self.prompt_tokens.labels(name).inc(stats.prompt_tokens)
        self.generation_tokens.labels(name).inc(len(output.token_ids))
        self.num_drafts.labels(name).inc(stats.drafted_per_position[0] if stats.drafted_per_position else 0)
        self.num_draft_tokens.labels(name).inc(stats.drafted_tokens)
        self.num_accepted_tokens.labels(name).inc(stats.accepted_tokens)
        self.store_draft_tokens.labels(name).inc(stats.store_drafted_tokens)
        self.store_accepted_tokens.labels(name).inc(stats.store_accepted_tokens)
        self.prefix_cache_queries.labels(name).inc(stats.prompt_tokens)  # 0 unless admitted: then looked up
        self.prefix_cache_hits.labels(name).inc(stats.cached_prompt_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(name, str(position)).inc(accepted)
        if output.finish_reason in ("stop", "length"):
            self.ttft.labels(name).observe(stats.time_to_first_token_s)
            self.e2e.labels(name).observe(stats.total_s)
            self.queue.labels(name).observe(stats.queue_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
