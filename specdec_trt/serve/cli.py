"""``specdec-serve``: the OpenAI-compatible HTTP server, with the same backend options as specdec-run. The server
and the runtime are imported once the options have parsed."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import TYPE_CHECKING

import click
from rich.console import Console

from specdec_trt.backend import BackendOptions
from specdec_trt.cli_options import Command, DraftLengthType, backend_options
from specdec_trt.draft_spec import DraftLength
from specdec_trt.policy import DEFAULT_DRAFT, choose_draft
from specdec_trt.prefill import DEFAULT_PREFILL_CHUNK_ROUNDS
from specdec_trt.serve.options import DecoderOptions, ReplicaPlan
from specdec_trt.serve.request_limits import DEFAULT_MAX_REQUEST_BYTES

if TYPE_CHECKING:
    from specdec_trt.decoder import SpeculativeDecoder
    from specdec_trt.serve.app import ServerSettings

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@click.command(cls=Command)
@backend_options
@click.option(
    "--draft",
    default=DEFAULT_DRAFT,
    help="As specdec-run's --draft: 'engine', another engine directory or a checkpoint, 'ngram', 'ngram+...', "
    "'none', or 'default': 'ngram+engine' with -k auto for engines that have a draft, else 'ngram'. "
    "[default: default]",
)
@click.option(
    "--num-draft-tokens",
    "-k",
    type=DraftLengthType(),
    help='Default draft length of a request (a request\'s "speculative": {"num_draft_tokens": ...} wins); '
    "0 is plain decoding, 'auto' chooses every round. [default: as specdec-run]",
)
@click.option("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, help="TCP port to listen on.")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=8, help="Slots: requests decoding at once.")
@click.option(
    "--max-queue", type=click.IntRange(min=0), default=64, help="Requests waiting for a slot; past it: HTTP 429."
)
@click.option(
    "--prefill-chunk-rounds",
    type=click.FloatRange(min=0),
    default=DEFAULT_PREFILL_CHUNK_ROUNDS,
    show_default=True,
    help="The most rounds' time a chunk of a prompt being prefilled may hold up the running requests. Larger: "
    "more tokens/s under load, longer pauses in the running streams; 0: no bound (chunks of 256 tokens).",
)
@click.option(
    "--prefix-cache/--no-prefix-cache",
    default=True,
    show_default=True,
    help="Keep an ended request's keys and values in its slot until the slot is needed, for later requests whose "
    "prompts start the same way (an agent's system prompt and history): they prefill only the rest.",
)
@click.option(
    "--served-model-name",
    help="The model's name in the API. [default: SmolLM2-135M-Instruct, or the name of --engines / --target]",
)
@click.option(
    "--api-key",
    envvar="SPECDEC_API_KEY",
    help="Require 'Authorization: Bearer KEY' on every endpoint but /health (also from $SPECDEC_API_KEY).",
)
@click.option(
    "--max-request-bytes",
    type=click.IntRange(min=1024),
    default=DEFAULT_MAX_REQUEST_BYTES,
    show_default=True,
    help="The most bytes a request's body may hold; a larger one gets 413 without being read.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    help="Seconds that requests in flight get to finish after SIGTERM or SIGINT.",
)
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info")
@click.option(
    "--ray",
    "on_ray",
    is_flag=True,
    help="Serve replicas on Ray Serve behind Ray's HTTP proxy, each with its own engines and --max-batch-size "
    "slots, taking --threads CPUs (default 1). Needs pip install 'specdec-trt[ray]'.",
)
@click.option("--replicas", type=click.IntRange(min=1), help="With --ray: replicas (the fewest, with --max-replicas).")
@click.option(
    "--max-replicas",
    type=click.IntRange(min=1),
    help="With --ray: scale between --replicas and this many on the number of requests waiting for a slot.",
)
@click.option(
    "--ray-address",
    help="With --ray: run on the Ray cluster at this address ('auto': the one this machine joined) instead of "
    "starting one here.",
)
def serve(
    backend: BackendOptions,
    draft: str,
    num_draft_tokens: DraftLength | None,
    host: str,
    port: int,
    max_batch_size: int,
    max_queue: int,
    prefill_chunk_rounds: float,
    prefix_cache: bool,
    served_model_name: str | None,
    api_key: str | None,
    max_request_bytes: int,
    drain_timeout: float,
    log_level: str,
    on_ray: bool,
    replicas: int | None,
    max_replicas: int | None,
    ray_address: str | None,
) -> None:
    """Serve the OpenAI API (completions, chat completions, models) with lossless speculative decoding on
    continuous batching, plus /health and /metrics (Prometheus). Without --engines or --target it serves the
    embedded SmolLM2-135M-Instruct.

    \b
    Examples:
      specdec-serve
      specdec-serve --engines engines/my-llama --port 8080 --api-key secret
      specdec-serve --target ./llama-1b --draft ./llama-160m --device cuda -k auto
      specdec-serve --ray --replicas 2 --threads 1
    """
    import uvicorn

    from specdec_trt.serve.app import ServerSettings, create_app
    from specdec_trt.serve.lifecycle import FAILED, DrainingServer, Lifecycle

    err = Console(stderr=True)
    choose_draft(backend.engines, draft, num_draft_tokens)  # a usage error before the server starts
    named = backend.engines or backend.target
    name = served_model_name or (named.name if named else DEFAULT_MODEL_NAME)
    settings = ServerSettings(name, api_key, max_request_bytes)
    options = DecoderOptions(
        backend, draft, num_draft_tokens, max_batch_size, max_queue, prefill_chunk_rounds, prefix_cache
    )
    if on_ray:
        plan = replica_plan(backend, replicas, max_replicas, drain_timeout)
        serve_replicas(
            options, settings, replace(plan, host=host, port=port, address=ray_address, log_level=log_level), err
        )
        return
    given = [
        name
        for name, value in (("--replicas", replicas), ("--max-replicas", max_replicas), ("--ray-address", ray_address))
        if value
    ]
    if given:
        raise click.UsageError(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --ray")

    def load() -> SpeculativeDecoder:
        decoder = options.open(err)
        cache_gb = max_batch_size * decoder.slot_cache_bytes / 1e9
        err.print(
            f"Ready: {settings.model_name} (draft {decoder.draft}, k={decoder.num_draft_tokens}) on http://{host}:{port}"
            f"; KV cache: {max_batch_size} slots of {decoder.max_context} tokens, at most {cache_gb:.1f} GB"
        )
        return decoder

    lifecycle = Lifecycle()
    app = create_app(load, settings, lifecycle)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    DrainingServer(config, lifecycle, drain_timeout).run()
    if lifecycle.state == FAILED and lifecycle.decoder is None:
        raise click.ClickException(f"could not load the models: {lifecycle.error}")


def replica_plan(
    backend: BackendOptions, replicas: int | None, max_replicas: int | None, drain_timeout: float
) -> ReplicaPlan:
    """The replicas of --ray, checked: autoscaling needs room above the fewest, and replicas take CPUs only
    (Ray would place every replica on the node's first GPU unless each asked for one)."""
    if backend.device is not None and backend.device.startswith("cuda"):
        raise click.UsageError(
            "--ray replicas run on CPUs only: for a GPU, run one specdec-serve --device cuda per GPU without --ray"
        )
    replicas = replicas or 1
    if max_replicas is not None and max_replicas < replicas:
        raise click.UsageError(f"--max-replicas {max_replicas} is below --replicas {replicas}: give at least as many")
    return ReplicaPlan(replicas, max_replicas, backend.threads or 1, drain_timeout)


def serve_replicas(options: DecoderOptions, settings: ServerSettings, plan: ReplicaPlan, err: Console) -> None:
    """Serve on Ray; a missing install or replicas that cannot start end the command with one line."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise click.ClickException("--ray needs Ray Serve: pip install 'specdec-trt[ray]'")
    from ray.exceptions import RayError

    from specdec_trt.serve.ray_app import serve_on_ray

    try:
        serve_on_ray(options, settings, plan, err)
    except (RuntimeError, RayError) as error:  # Ray's deployment failures, whose first line says what failed
        raise click.ClickException(f"the replicas could not start: {str(error).strip().splitlines()[0]}") from None
