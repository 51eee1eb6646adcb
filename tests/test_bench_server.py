"""The serving benchmark's parts: Poisson arrivals, the streamed-completion client against a real
specdec-serve app on 127.0.0.1 (tokens from usage, or counted from the text where a server sends none), and
server processes that are waited for and always stopped."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from serving import serve

from benchlib.load import RequestTiming, against_best, load_summary, median_run, open_loop
from benchlib.openai_client import ServerResponseError, stream_chat, stream_completion
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.servers import ServerStartError, free_port, running


def test_open_loop_sends_every_request_no_sooner_than_its_poisson_arrival() -> None:
    sent: list[tuple[int, float]] = []
    lock = threading.Lock()

    def send(index: int) -> RequestTiming:
        now = time.perf_counter()
        with lock:
            sent.append((index, now))
        time.sleep(0.05)  # slower than the arrivals: requests overlap, as under an open-loop load
        return RequestTiming(now, [now + 0.05], tokens=index)

    rate, count, seed = 40.0, 12, 3
    start = time.perf_counter()
    timings, wall = open_loop(send, list(range(count)), rate, seed)
    gaps = np.random.default_rng(seed).exponential(1 / rate, count)
    assert [t.tokens for t in timings] == list(range(count))  # in request order
    by_index = dict(sent)
    for index in range(1, count):  # request i leaves no sooner than the sum of the gaps before it
        assert by_index[index] - start >= gaps[1 : index + 1].sum() - 1e-3
    assert wall >= gaps[1:].sum() + 0.05 - 1e-3
    assert max(by_index.values()) - min(by_index.values()) < wall


def test_open_loop_reports_a_failed_send() -> None:
    def send(index: int) -> RequestTiming:
        raise RuntimeError(f"request {index} failed")

    with pytest.raises(RuntimeError, match="failed"):
        open_loop(send, [0, 1], 100.0)


def test_median_run_reports_the_repeat_with_the_median_tokens_per_second() -> None:
    def repeat(tokens: int, wall: float) -> dict:
        timing = RequestTiming(sent=0.0, arrivals=[0.1, wall], tokens=tokens)
        return load_summary([timing], wall)

    repeats = [repeat(100, 1.0), repeat(100, 4.0), repeat(100, 2.0)]  # 100, 25 and 50 tokens/s
    median = median_run(repeats)
    assert median["tokens_per_s_median"] == 50.0
    assert median["wall_s"] == 2.0 and median["e2e"] == repeats[2]["e2e"]
    assert median["repeats"] == repeats
    assert median_run(repeats[:2])["tokens_per_s_median"] == 62.5  # an even count: the mean of the middle two


def test_against_best_compares_with_the_best_by_median_and_turn_by_turn() -> None:
    def method(*rates: float) -> dict:
        return median_run([load_summary([RequestTiming(0.0, [0.5, 1.0], int(rate))], 1.0) for rate in rates])

    # k=2 is the best of the others by median (100 against plain's 85); auto trails it in two turns of three
    methods = {"auto": method(90, 95, 120), "0": method(80, 90, 85), "2": method(100, 100, 100)}
    compared = against_best(methods, "auto", ["0", "2"])
    assert compared["best"] == "2" and compared["ratio_of_medians"] == 0.95
    assert compared["turn_ratios"] == [0.9, 0.95, 1.2]
    assert compared["median_turn_ratio"] == 0.95
    assert (compared["lowest_turn_ratio"], compared["highest_turn_ratio"]) == (0.9, 1.2)
    logs = np.log([0.9, 0.95, 1.2])
    assert compared["geometric_mean_turn_ratio"] == round(float(np.exp(logs.mean())), 3) == 1.009
    error = np.exp(logs.mean()) * logs.std(ddof=1) / np.sqrt(3)
    assert compared["geometric_mean_standard_error"] == round(float(error), 3) > 0.05
    assert against_best(methods, "auto", ["0"])["turn_ratios"] == [1.125, 1.056, 1.412]  # against plain alone


@pytest.fixture(scope="module")
def served(make_checkpoint):
    target = make_checkpoint(family="llama")

    def load() -> SpeculativeDecoder:
        return SpeculativeDecoder.from_pretrained(target, num_draft_tokens=0, max_batch_size=2)

    with serve(load, api_key=None) as server:
        yield server


def test_stream_completion_counts_tokens_from_usage(served) -> None:
    expected = served.decoder.generate("the cat", SamplingParams(max_new_tokens=12, ignore_eos=True))
    body = {"prompt": "the cat", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=served.url, timeout=60) as client:
        timing, text = stream_completion(client, body | {"stream_options": {"include_usage": True}})
    assert text == expected.text
    assert timing.tokens == len(expected.token_ids) == 12
    assert timing.ok and timing.arrivals and timing.arrivals == sorted(timing.arrivals)
    assert timing.ttft > 0 and timing.latency >= timing.ttft


def test_stream_completion_without_usage_counts_the_text_or_refuses(served) -> None:
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=served.url, timeout=60) as client:
        timing, text = stream_completion(client, body, count_tokens=len)
        assert timing.tokens == len(text) > 0
        with pytest.raises(ServerResponseError, match="no usage"):
            stream_completion(client, body)
        with pytest.raises(ServerResponseError, match="HTTP 400"):
            stream_completion(client, body | {"max_tokens": -1})


def test_stream_chat_times_a_chat_and_reads_its_cached_tokens(served) -> None:
    """The agent benchmark's client: the answer, its timings, and usage with the prefix cache's hit."""
    messages = [{"role": "user", "content": "tell me about the sea"}]
    with httpx.Client(base_url=served.url, timeout=60) as client:
        text, ttft, e2e, counts = stream_chat(client, "tiny", messages, 6)
        again = stream_chat(client, "tiny", messages, 6)[3]
        with pytest.raises(ServerResponseError, match="HTTP 400"):
            stream_chat(client, "tiny", messages, -1)
    expected = served.decoder.generate(served.decoder.apply_chat_template(messages), SamplingParams(max_new_tokens=6))
    assert text == expected.text and 0 < ttft <= e2e
    assert counts["prompt"] == expected.stats.prompt_tokens and counts["completion"] == len(expected.token_ids)
    assert counts["cached"] < again["cached"] == counts["prompt"] - 1  # all but the last prompt token are kept


def test_running_waits_for_the_server_and_stops_it(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with running("files", argv, port, "/", tmp_path / "log" / "files.log") as server:
        assert httpx.get(server.url + "/", timeout=5).status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/", timeout=2)


def test_running_reports_a_server_that_exits_before_it_is_ready(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with pytest.raises(ServerStartError, match="exited with status 3"):
        with running("broken", argv, free_port(), "/", tmp_path / "broken.log"):
            pass
