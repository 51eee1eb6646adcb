"""Load and faults together on loopback, bounded in count and time: 240 requests from 8 closed-loop clients,
a tenth of them disconnecting early and a tenth malformed. No 5xx, every completed greedy output equals its
solo output, the metrics counters add up to the responses, nothing is left behind and memory stays bounded."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from serving import serve, sse_events

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.draft_spec import AUTO

CLIENTS, REQUESTS = 8, 240
PROMPTS = ["the cat sat on the mat", "hello there", "abc abc abc abc", "a long way", "quiet", "one two one two"]
DRAFT_LENGTHS = [0, 2, AUTO, 3, AUTO, 1]
MALFORMED = [
    b'{"prompt": ',
    b'{"prompt": "hi", "max_tokens": "many"}',
    b'{"prompt": "hi", "max_tokens": -1}',
    b'{"prompt": "hi", "logit_bias": {"3": 1}}',
    b'{"prompt": "hi", "n": 3}',
    b"[1, 2, 3]",
]
DISCONNECTING_MAX_TOKENS = 120
MAX_RSS_GROWTH_MB = 64
JSON = {"content-type": "application/json"}


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def plan(index: int) -> tuple[str, int]:
    """What request ``index`` is: ("malformed" | "disconnect" | "stream" | "whole", which prompt)."""
    kind = {0: "malformed", 5: "disconnect"}.get(index % 10, "stream" if index % 2 else "whole")
    return kind, (index * 7) % len(PROMPTS)


def body(which: int, stream: bool, max_tokens: int | None = None) -> dict:
    """A greedy request for prompt ``which``: its own length and draft length, with usage when streamed."""
    request = {
        "prompt": PROMPTS[which],
        "max_tokens": max_tokens or 16 + 4 * which,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "speculative": {"num_draft_tokens": DRAFT_LENGTHS[which]},
    }
    return request | ({"stream_options": {"include_usage": True}} if stream else {})


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint) -> tuple[Path, Path]:
    target = {"family": "llama"}
    return make_checkpoint(**target), make_checkpoint(draft_of=(target, 0.1), seed=5)


@pytest.mark.slow
def test_load_with_faults(checkpoints) -> None:
    def load() -> SpeculativeDecoder:
        return SpeculativeDecoder.from_pretrained(*checkpoints, max_batch_size=4, max_queue=REQUESTS)

    with serve(load, api_key=None) as served:
        decoder = served.decoder
        solo = [
            decoder.generate(p, SamplingParams(max_new_tokens=16 + 4 * i, ignore_eos=True), k)
            for i, (p, k) in enumerate(zip(PROMPTS, DRAFT_LENGTHS))
        ]
        statuses: list[int] = []
        completed: list[tuple[int, str, dict]] = []  # (prompt, text, usage)
        disconnected: list[int] = []
        lock = threading.Lock()
        pending = iter(range(REQUESTS))

        def client() -> None:
            with httpx.Client(base_url=served.url, timeout=120) as http:
                while True:
                    with lock:
                        index = next(pending, None)
                    if index is None:
                        return
                    kind, which = plan(index)
                    if kind == "malformed":
                        bad = MALFORMED[index % len(MALFORMED)]
                        response = http.post("/v1/completions", content=bad, headers=JSON)
                        with lock:
                            statuses.append(response.status_code)
                        continue
                    if kind == "whole":
                        response = http.post("/v1/completions", json=body(which, False))
                        answer = response.json()
                        with lock:
                            statuses.append(response.status_code)
                            completed.append((which, answer["choices"][0]["text"], answer["usage"]))
                        continue
                    request = body(which, True, DISCONNECTING_MAX_TOKENS if kind == "disconnect" else None)
                    with http.stream("POST", "/v1/completions", json=request) as r:
                        with lock:
                            statuses.append(r.status_code)
                        events = sse_events(r.iter_lines())
                        if kind == "disconnect":
                            next(events)
                            with lock:
                                disconnected.append(which)
                            continue  # leaving the block closes the connection mid-stream
                        events = list(events)
                    text = "".join(e["choices"][0]["text"] for e in events[:-2])  # then usage, [DONE]
                    with lock:
                        completed.append((which, text, events[-2]["usage"]))

        def run_all(count: int) -> None:
            nonlocal pending
            pending = iter(range(count))
            threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(300)

        run_all(40)  # warm-up: allocator pools, the cost model's first fits
        before, rss_before = served.metrics(), rss_mb()
        statuses.clear(), completed.clear(), disconnected.clear()
        run_all(REQUESTS)
        after = served.metrics()
        rss_growth = rss_mb() - rss_before

    assert len(statuses) == REQUESTS and max(statuses) < 500
    assert statuses.count(400) == sum(plan(i)[0] == "malformed" for i in range(REQUESTS))
    assert len(disconnected) == REQUESTS // 10
    for which, text, usage in completed:
        assert text == solo[which].text
        assert usage["completion_tokens"] == len(solo[which].token_ids)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    ended = {r: delta("specdec:request_success_total", finished_reason=r) for r in ("stop", "length", "cancelled")}
    assert ended["stop"] + ended["length"] == len(completed)
    assert ended["cancelled"] == len(disconnected)  # each went away long before its 120 tokens
    prompt_tokens = sum(solo[w].stats.prompt_tokens for w, _, _ in completed)
    prompt_tokens += sum(solo[w].stats.prompt_tokens for w in disconnected)
    assert delta("specdec:prompt_tokens_total") == prompt_tokens
    answered = sum(usage["completion_tokens"] for _, _, usage in completed)
    generated = delta("specdec:generation_tokens_total") - answered
    assert 0 < generated <= DISCONNECTING_MAX_TOKENS * len(disconnected)  # the disconnected ones' tokens
    assert delta("specdec:e2e_request_latency_seconds_count") == ended["stop"] + ended["length"]
    assert decoder.scheduler.num_running == decoder.scheduler.num_waiting == 0
    assert served.lifecycle.in_flight == 0
    assert rss_growth < MAX_RSS_GROWTH_MB
