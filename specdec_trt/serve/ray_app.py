"""specdec-serve on Ray Serve: replicas of the OpenAI server behind Ray's HTTP proxy and router.

Each replica is the single server's FastAPI app over its own engines and continuous-batching scheduler, opened
before the replica takes a request. Ray's router sends a request to a replica with a free slot
(``max_ongoing_requests`` is a replica's slots); the others wait in Ray's queue (``max_queued_requests``, past
which the proxy answers 503). With a maximum replica count, Ray scales the replicas on that queue: more when
requests wait for slots on average, fewer when they idle. /metrics answers with every live replica's metrics,
each sample labelled with its replica: replicas push their exposition to a board deployment every second.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle
from rich.console import Console

from specdec_trt.serve.app import ServerSettings, create_app
from specdec_trt.serve.lifecycle import Lifecycle
from specdec_trt.serve.metrics import ServerMetrics
from specdec_trt.serve.metrics_merge import merge_expositions
from specdec_trt.serve.options import DecoderOptions, ReplicaPlan

APP_NAME = "specdec"
REPLICA_HEADER = "x-specdec-replica"
PUSH_INTERVAL_S = 1.0
STALE_S = 10.0  # a replica that has not pushed for this long has left: its samples leave /metrics
UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 5.0, 60.0
PROXY_READY_TIMEOUT_S = 60
logger = logging.getLogger("ray.serve")


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False})
class MetricsBoard:
    """The latest exposition of every replica; /metrics is their merge."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self.latest[replica] = (time.monotonic(), text)

    def exposition(self) -> bytes:
        now = time.monotonic()
        self.latest = {replica: entry for replica, entry in self.latest.items() if now - entry[0] < STALE_S}
        return merge_expositions({replica: text for replica, (_, text) in self.latest.items()})


@serve.deployment
@serve.ingress()
class SpecdecServer:
    """One replica: the decoder, opened in the constructor, under the single server's app."""

    def __init__(self, options: DecoderOptions, settings: ServerSettings, board: DeploymentHandle) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.settings, self.board = settings, board
        self.decoder = options.open(Console(stderr=True))
        self.metrics = ServerMetrics(settings.model_name)
        self.lifecycle = Lifecycle()
        threading.Thread(target=self._push_metrics, name="specdec-metrics", daemon=True).start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(
            lambda: self.decoder,
            self.settings,
            self.lifecycle,
            background_load=False,
            metrics=self.metrics,
            scrape=self._scrape,
        )
        app.add_middleware(ReplicaHeader, replica=self.replica)
        return app

    def check_health(self) -> None:
        """Ray replaces a replica whose engine stopped after an error."""
        ready, why = self.lifecycle.health()
        if not ready:
            raise RuntimeError(f"replica {self.replica} is not serving: {why}")

    async def _scrape(self) -> bytes:
        await self.board.put.remote(self.replica, self.metrics.exposition())
        return await self.board.exposition.remote()

    def _push_metrics(self) -> None:
        while True:
            try:
                self.board.put.remote(self.replica, self.metrics.exposition()).result(timeout_s=10)
            except Exception as error:  # noqa: BLE001 - the board restarts; the next push catches up
                logger.warning("replica %s could not push its metrics: %s", self.replica, error)
            time.sleep(PUSH_INTERVAL_S)


class ReplicaHeader:
    """ASGI middleware naming the replica that answered, in every response's x-specdec-replica header."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


def application(options: DecoderOptions, settings: ServerSettings, plan: ReplicaPlan):
    """The Ray Serve application: the replicas, and the board their metrics go to."""
    scaling = (
        {"num_replicas": plan.replicas}
        if plan.max_replicas is None
        else {
            "autoscaling_config": {
                "min_replicas": plan.replicas,
                "initial_replicas": plan.replicas,
                "max_replicas": plan.max_replicas,
                "target_ongoing_requests": options.max_batch_size,
                "upscale_delay_s": UPSCALE_DELAY_S,
                "downscale_delay_s": DOWNSCALE_DELAY_S,
            }
        }
    )
    server = SpecdecServer.options(
        max_ongoing_requests=options.max_batch_size,
        max_queued_requests=options.max_queue,
        ray_actor_options={"num_cpus": plan.threads},
        graceful_shutdown_timeout_s=plan.drain_timeout,
        **scaling,
    )
    return server.bind(options, settings, MetricsBoard.bind())


def _replica_failure() -> str | None:
    """The last line of a replica constructor's traceback (the error itself), as the deployment reports it."""
    deployment = serve.status().applications[APP_NAME].deployments.get(SpecdecServer.name)
    lines = [line.strip() for line in (deployment.message if deployment else "").splitlines() if line.strip()]
    return lines[-1] if lines else None


def serve_on_ray(options: DecoderOptions, settings: ServerSettings, plan: ReplicaPlan, err: Console) -> None:
    """Deploy the replicas, on a Ray cluster started here or the one at ``plan.address``, and
    serve until SIGTERM or SIGINT; then remove them (and stop the cluster started here).

    The engines are resolved (the default ones built) here, once: every replica opens the same directory."""
    import ray

    backend = replace(options.backend.resolved(err), is_default=False, threads=plan.threads)
    options = replace(options, backend=backend)
    if plan.address is None:
        # On a busy machine a new worker process takes longer than Serve's 5 s to report its proxy ready.
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_TIMEOUT_S))
        # Ray starts its workers at niceness 15; the replicas are the workload here, not background work.
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=plan.address, logging_level=logging.WARNING)
    logger.setLevel(plan.log_level.upper())  # the driver's own Serve log
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        logging_config = {"log_level": plan.log_level.upper()}
        serve.start(http_options={"host": plan.host, "port": plan.port}, logging_config=logging_config)
        try:
            serve.run(
                application(options, settings, plan), name=APP_NAME, route_prefix="/", logging_config=logging_config
            )
        except RuntimeError as error:
            raise RuntimeError(_replica_failure() or str(error)) from None
        if plan.max_replicas is not None:
            scaling = f"{plan.replicas} to {plan.max_replicas} Ray Serve replicas"
        else:
            scaling = f"{plan.replicas} Ray Serve replica" + "s" * (plan.replicas > 1)
        err.print(f"Ready: {settings.model_name} on {scaling} at http://{plan.host}:{plan.port}")
        while not stop.wait(0.5):  # a short wait, so that the signal handlers run
            pass
        err.print("Stopping: the replicas finish the requests in flight…")
    finally:
        if plan.address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
