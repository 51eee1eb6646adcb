"""The ``specdec-serve`` command as a process: SIGTERM drains it (requests in flight complete, new ones get 503,
it exits 0), a model that cannot load ends it with a one-line error; and the default model answers the
openai client as ``SpeculativeDecoder`` does (slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from serving import API_KEY, MODEL, free_port, serve, sse_events, wait_until

from specdec_trt import SamplingParams, SpeculativeDecoder

BIN = Path(sys.executable).parent


def start(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [str(BIN / "specdec-serve"), "--port", str(port), "--log-level", "warning", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return process, f"http://127.0.0.1:{port}"


def health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight_refuses_new_ones_and_exits_0(make_checkpoint) -> None:
    target = make_checkpoint(family="llama", hidden_size=256, num_layers=6)  # slow enough to be caught mid-stream
    options = ["--draft", "none", "--max-batch-size", "2", "--threads", "1", "--prefill-chunk-rounds", "0"]
    process, url = start("--target", str(target), *options)
    try:
        wait_until(lambda: health(url) == 200 or process.poll() is not None, "the server never became ready", 120)
        assert process.poll() is None, process.stderr.read()
        body = {"prompt": "a", "max_tokens": 220, "temperature": 0, "ignore_eos": True, "stream": True}
        results: list[list] = [[], []]
        started = [threading.Event(), threading.Event()]

        def stream(i: int) -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for event in sse_events(response.iter_lines()):
                    started[i].set()
                    results[i].append(event)

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for client in clients:
            client.start()
        for event in started:
            assert event.wait(60)
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: health(url) == 503, "the server did not start draining")
        refused = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
        for client in clients:
            client.join(120)
        for events in results:
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert len("".join(e["choices"][0]["text"] for e in events[:-1])) <= 220
        assert process.wait(60) == 0
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_a_model_that_cannot_load_ends_the_command_with_one_line(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    process, _ = start("--target", str(tmp_path), "--draft", "none")
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1
    assert "Error: could not load the models" in stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_the_default_model_answers_the_openai_client_as_the_decoder_does() -> None:
    from rich.console import Console

    from specdec_trt.build_progress import default_engines_shown

    directory = default_engines_shown(Console(stderr=True))
    with serve(lambda: SpeculativeDecoder.from_engines(directory, "ngram+engine", num_draft_tokens="auto")) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)
        question = "What is the capital of France? Answer in one sentence."
        prompt = served.decoder.apply_chat_template(question)
        expected = served.decoder.generate(prompt, SamplingParams(max_new_tokens=40))
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=40, temperature=0
        )
        assert answer.choices[0].message.content == expected.text
        assert "Paris" in expected.text
        assert answer.usage.completion_tokens == len(expected.token_ids)
        stats = answer.choices[0].model_extra["speculative"]
        assert stats["num_accepted_tokens"] > 0
