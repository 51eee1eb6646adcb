"""``specdec-serve --ray`` as a process: a local Ray cluster on this machine with two replicas of a tiny model.
Requests spread over both replicas with the single server's greedy outputs, /metrics carries every replica's
samples, a replica killed mid-stream fails only its own streams (with an error, not a hang) while Ray replaces
it, a queue deeper than the slots brings a second replica up under autoscaling, and SIGTERM leaves no Ray
process behind. The metrics merge runs without Ray."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from serving import free_port, sse_events, wait_until

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.serve.cli import serve
from specdec_trt.serve.metrics import ServerMetrics
from specdec_trt.serve.metrics_merge import merge_expositions

BIN = Path(sys.executable).parent
HEADER = "x-specdec-replica"
needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray Serve is not installed: pip install 'specdec-trt[ray]'"
)
PROMPTS = ["the cat sat", "hello there", "abc abc abc", "a long way", "quiet", "one two one", "red", "sky"]


def test_merged_metrics_label_every_sample_with_its_replica() -> None:
    first, second = ServerMetrics("tiny"), ServerMetrics("tiny")
    first.request_success.labels("tiny", "stop").inc()
    second.request_success.labels("tiny", "stop").inc(3)
    families = {
        f.name: f
        for f in text_string_to_metric_families(
            merge_expositions({"a": first.exposition(), "b": second.exposition()}).decode()
        )
    }
    assert len(families) == len(list(text_string_to_metric_families(first.exposition().decode())))
    stops = {
        s.labels["replica"]: s.value
        for s in families["specdec:request_success"].samples
        if s.name.endswith("_total") and s.labels["finished_reason"] == "stop"
    }
    assert stops == {"a": 1.0, "b": 3.0}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--replicas", "2"], "--replicas needs --ray"),
        (["--replicas", "2", "--ray-address", "auto"], "--replicas and --ray-address need --ray"),
        (["--ray", "--replicas", "3", "--max-replicas", "2"], "--max-replicas 2 is below --replicas 3"),
        (["--ray", "--device", "cuda"], "--ray replicas run on CPUs only"),
    ],
)
def test_replica_options_are_checked_before_anything_starts(args: list[str], message: str) -> None:
    result = CliRunner().invoke(serve, args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.slow
@needs_ray
def test_replicas_that_cannot_start_end_the_command_with_the_error_in_one_line(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    argv = [str(BIN / "specdec-serve"), "--ray", "--port", str(free_port()), "--target", str(tmp_path)]
    with the_one_ray_cluster():
        done = subprocess.run(
            [*argv, "--draft", "none", "--log-level", "warning"], capture_output=True, text=True, timeout=300
        )
        wait_until(lambda: ray_processes() == [], "Ray processes were left behind", 60)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("Error: the replicas could not start: "), done.stderr[-2000:]
    assert "model_type None is not supported" in last


def ray_processes() -> list[int]:
    """Pids of this machine's Ray processes (its workers are titled ``ray::...``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError):
            continue
        if command.startswith(b"ray::") or b"raylet" in command or b"gcs_server" in command:
            pids.append(int(entry.name))
    return pids


def replica_pid(replica: str) -> int:
    """The pid of the replica named ``replica``: the replica process that holds its log file open."""
    for entry in Path("/proc").iterdir():
        try:
            if not (entry / "cmdline").read_bytes().startswith(b"ray::ServeReplica:specdec:SpecdecServer"):
                continue
            if any(f"SpecdecServer_{replica}" in os.readlink(fd) for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except (OSError, ValueError):
            continue
    raise AssertionError(f"no process of replica {replica}")


@contextmanager
def the_one_ray_cluster() -> Iterator[None]:
    """Take the machine's one local Ray cluster for a test: pytest-xdist may run these tests in two workers at
    once, and each test starts a cluster of its own and checks that it leaves no Ray process behind."""
    with open(Path(tempfile.gettempdir()) / "specdec-trt-tests-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@contextmanager
def ray_server(target: Path, *options: str) -> Iterator[str]:
    """``specdec-serve --ray`` on ``target`` with ``options``, once every replica is up: its URL. On the way
    out: SIGTERM, exit status 0, and no Ray process left."""
    with the_one_ray_cluster():
        yield from _ray_server(target, *options)


def _ray_server(target: Path, *options: str) -> Iterator[str]:
    assert ray_processes() == [], "a Ray cluster is already running on this machine"
    port = free_port()
    argv = [str(BIN / "specdec-serve"), "--ray", "--port", str(port), "--target", str(target), "--draft", "none"]
    process = subprocess.Popen(
        [*argv, *options, "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(process.stdout), daemon=True).start()
    try:
        # "Ready" comes once every replica is up; /health answers as soon as the first one is.
        ready = lambda: any(line.startswith("Ready") for line in log) or process.poll() is not None  # noqa: E731
        wait_until(ready, "the replicas never became ready", 300)
        assert process.poll() is None, "".join(log)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            status = process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert status == 0, "".join(log)[-2000:]
    wait_until(lambda: ray_processes() == [], "Ray processes were left behind", 60)


@pytest.mark.slow
@needs_ray
def test_two_replicas_share_the_load_survive_a_killed_one_and_leave_nothing(make_checkpoint) -> None:
    target = make_checkpoint(family="llama", hidden_size=256, num_layers=6, max_position_embeddings=2048)
    with ray_server(target, "--replicas", "2", "--threads", "1", "--max-batch-size", "2") as url:
        solo = SpeculativeDecoder.from_pretrained(target, "none")
        expected = {p: solo.generate(p, SamplingParams(max_new_tokens=16, ignore_eos=True), 0).text for p in PROMPTS}

        # Requests spread over both replicas, with the single decoder's greedy outputs.
        answers: dict[str, tuple[str, str]] = {}

        def complete(prompt: str) -> None:
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            response = httpx.post(url + "/v1/completions", json=body, timeout=120)
            answers[prompt] = (response.json()["choices"][0]["text"], response.headers[HEADER])

        clients = [threading.Thread(target=complete, args=(p,)) for p in PROMPTS]
        for client in clients:
            client.start()
        for client in clients:
            client.join(180)
        assert {p: text for p, (text, _) in answers.items()} == expected
        replicas = {replica for _, replica in answers.values()}
        assert len(replicas) == 2

        # /metrics holds both replicas' samples.
        wait_until(lambda: _metric_replicas(url) == replicas, "/metrics did not show both replicas", 30)

        # A replica killed while streams run on both.
        streams: dict[int, dict] = {}

        def stream(i: int) -> None:
            body = {"prompt": PROMPTS[i], "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
            record = streams[i] = {"events": [], "error": None, "replica": None}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                    response.raise_for_status()
                    record["replica"] = response.headers[HEADER]
                    for event in sse_events(response.iter_lines()):
                        record["events"].append(event)
            except httpx.HTTPError as error:
                record["error"] = error
            record["ended"] = time.monotonic()

        runners = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for runner in runners:
            runner.start()
        # Four streams fill the two replicas' four slots: all of them run before the kill.
        started = lambda: len(streams) == 4 and all(s["events"] for s in streams.values())  # noqa: E731
        try:
            wait_until(started, "", 60)
        except AssertionError:
            raise AssertionError(f"streams did not all start: {_summary(streams)}") from None
        assert len({s["replica"] for s in streams.values()}) == 2, _summary(streams)
        victim = sorted(replicas)[0]
        os.kill(replica_pid(victim), signal.SIGKILL)
        killed = time.monotonic()
        for runner in runners:
            runner.join(120)
        assert not any(runner.is_alive() for runner in runners), "a stream hung after its replica died"
        for record in streams.values():
            finished = bool(record["events"]) and record["events"][-1] == "[DONE]"
            if record["replica"] == victim:  # cut off with a transport error, within seconds
                assert not finished and isinstance(record["error"], httpx.RemoteProtocolError), record
                assert record["ended"] - killed < 30
            else:
                assert finished and record["error"] is None, record

        # New requests go to the survivor, and Ray brings a replacement up.
        def replicas_answering() -> set[str]:
            body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
            return {httpx.post(url + "/v1/completions", json=body, timeout=60).headers[HEADER] for _ in range(4)}

        assert victim not in replicas_answering()
        wait_until(lambda: len(replicas_answering() - replicas) > 0, "Ray did not replace the killed replica", 240)


@pytest.mark.slow
@needs_ray
def test_a_queue_deeper_than_the_slots_scales_the_replicas_up(make_checkpoint) -> None:
    target = make_checkpoint(family="llama", hidden_size=256, num_layers=6, max_position_embeddings=2048)
    with ray_server(target, "--replicas", "1", "--max-replicas", "2", "--max-batch-size", "1") as url:
        # Four clients in a closed loop on one slot: the queue stays deeper than the slots until a second
        # replica takes its share.
        seen: list[str] = []
        done = threading.Event()

        def client() -> None:
            body = {"prompt": "the cat sat", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
            while not done.is_set():
                response = httpx.post(url + "/v1/completions", json=body, timeout=120)
                response.raise_for_status()
                seen.append(response.headers[HEADER])

        clients = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for thread in clients:
            thread.start()
        try:
            wait_until(lambda: len(set(seen)) == 2, f"no second replica came up: {sorted(set(seen))}", 240)
        finally:
            done.set()
            for thread in clients:
                thread.join(120)
        assert not any(thread.is_alive() for thread in clients)


def _summary(streams: dict[int, dict]) -> list[tuple]:
    return [(s["replica"], len(s["events"]), repr(s["error"])) for s in streams.values()]


def _metric_replicas(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        sample.labels["replica"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "replica" in sample.labels
    }
