"""``specdec_trt.bench.ort_genai_peer``: real onnxruntime-genai builds (its own model builder) of a tiny random llama
checkpoint, fp32 and int4, and its generation loop: greedy tokens equal to transformers' own, exact token counts
past EOS, reproducible sampling, prompt lookup keeping plain decoding's tokens, builds that leave nothing behind when
they fail or are interrupted and are reused when present; on the default model (slow), the GGUF rewritten as our
float32 tensors and the fp32 build's greedy tokens against our own decoder's."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import pytest
import torch
from safetensors.torch import load_file

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench import ort_genai_peer
from specdec_trt.bench.harness import first_divergence
from specdec_trt.bench.methods import ORT_GENAI, Method
from specdec_trt.bench.ort_genai_peer import (
    OrtGenaiRunner,
    build_genai_model,
    default_genai_dir,
    write_float32_checkpoint,
)
from specdec_trt.bench.peers import FLOAT32, PeerRequest, open_peers
from specdec_trt.build import BuildRequest, build
from specdec_trt.build_engines.checkpoint import load_checkpoint, load_tokenizer, load_transformers_model
from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_engines.manifest import MANIFEST_NAME
from specdec_trt.decoder import AUTO
from specdec_trt.draft_spec import NGRAM, DraftSpec
from specdec_trt.loading import open_engine_directory
from specdec_trt.policy import default_engine_dir

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed: pip install 'specdec-trt[peers]'")

# onnxruntime's CPU GroupQueryAttention needs a head size that is a multiple of 16 (conftest's default is 8).
SIZE = {"hidden_size": 64, "head_dim": 16}
THREADS = 1
EOS = 2
PLAIN, LOOKUP = Method(ORT_GENAI, None), Method(ORT_GENAI, NGRAM, 4)
# On the tiny checkpoint (seed 0), greedy decoding of PASSES_EOS emits EOS at its 7th token and goes on; REPEATS
# holds a repeated stretch, so its continuation gives prompt lookup matches.
PASSES_EOS = [1, 19, 6, 3, 8, 28]
REPEATS = [1, 5, 6, 7, 8, 9, 10, 5, 6, 7]
QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon.",
)


def greedy(max_new_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(family="llama", **SIZE)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    """A folder holding the fp32 and int4 builds of ``checkpoint``, "fp32" and "int4"."""
    folder = tmp_path_factory.mktemp("genai")
    for precision in ("fp32", "int4"):
        build_genai_model(checkpoint, precision, folder / precision)
    return folder


@pytest.fixture(scope="module")
def runner(builds: Path) -> OrtGenaiRunner:
    return OrtGenaiRunner(builds / "fp32", THREADS)


def transformers_greedy(checkpoint: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` in float32, past EOS."""
    model = load_transformers_model(checkpoint)
    inputs = torch.tensor([prompt])
    output = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


def matmul_nbits(model_dir: Path) -> list[onnx.NodeProto]:
    graph = onnx.load(model_dir / "model.onnx", load_external_data=False).graph
    return [node for node in graph.node if node.op_type == "MatMulNBits"]


def test_fp32_greedy_is_transformers_greedy_past_eos(runner, checkpoint) -> None:
    for prompt, count in ((PASSES_EOS, 40), (REPEATS, 60)):
        expected = transformers_greedy(checkpoint, prompt, count)
        run, tokens = runner.run(PLAIN, prompt, greedy(count))
        assert tokens == expected  # float32 on both sides: every token agrees (no near-tie on these prompts)
        assert len(tokens) == run.generated_tokens == count
        assert run.rounds == count - 1 and run.accepted_tokens == 0
        assert 0 < run.ttft_s < run.total_s
        assert run.drafted_tokens is None and run.drafted_per_position is None and run.verify_s is None
    assert EOS in runner.run(PLAIN, PASSES_EOS, greedy(40))[1][:10]  # ignore_eos went past an EOS


def test_without_ignore_eos_generation_ends_at_eos(runner) -> None:
    run, tokens = runner.run(PLAIN, PASSES_EOS, greedy(40, ignore_eos=False))
    assert tokens[-1] == EOS and EOS not in tokens[:-1]  # the EOS is kept, as ours keeps it
    assert len(tokens) == run.generated_tokens < 40 and run.rounds == len(tokens) - 1
    assert tokens == runner.run(PLAIN, PASSES_EOS, greedy(40))[1][: len(tokens)]


def test_int4_build_holds_matmul_nbits_and_generates(builds) -> None:
    fp32, int4 = builds / "fp32", builds / "int4"
    assert matmul_nbits(fp32) == []
    nodes = matmul_nbits(int4)
    assert nodes  # every projection and the head
    for node in nodes:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["bits"] == 4 and attributes["block_size"] == 32 and attributes["accuracy_level"] == 4
    assert (int4 / "model.onnx.data").stat().st_size < (fp32 / "model.onnx.data").stat().st_size / 2
    run, tokens = OrtGenaiRunner(int4, THREADS).run(PLAIN, REPEATS, greedy(30))
    assert len(tokens) == run.generated_tokens == 30 and all(0 <= t < 35 for t in tokens)


def test_a_sampled_run_with_a_seed_is_reproducible(runner) -> None:
    def sampled(seed: int, method: Method = PLAIN) -> list[int]:
        params = SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
        return runner.run(method, REPEATS, params)[1]

    first = sampled(1234)
    assert len(first) == 30 and sampled(1234) == first
    assert sampled(4321) != first
    assert sampled(1234, LOOKUP) == sampled(1234, LOOKUP)


def test_prompt_lookup_keeps_greedy_tokens_and_accepts_drafts(runner) -> None:
    for prompt in (REPEATS, PASSES_EOS):
        _, plain = runner.run(PLAIN, prompt, greedy(60))
        run, tokens = runner.run(LOOKUP, prompt, greedy(60))
        assert tokens == plain
        assert len(tokens) == run.generated_tokens == 60
        assert 0 < run.accepted_tokens <= run.drafted_tokens and run.rounds > 0
        assert 0 < run.ttft_s < run.total_s


def test_other_drafts_schedules_lengths_and_filters_are_refused(runner) -> None:
    for method in (Method(ORT_GENAI, "engine", 4), Method(ORT_GENAI, NGRAM, "auto"), Method(ORT_GENAI, NGRAM, 0)):
        with pytest.raises(ValueError, match="plain decoding or prompt lookup"):
            runner.run(method, REPEATS, greedy(4))
    with pytest.raises(ValueError, match="positions"):
        runner.run(PLAIN, [1] * 250, greedy(10))  # the tiny model has 256
    with pytest.raises(ValueError, match="min-p"):
        runner.run(PLAIN, REPEATS, SamplingParams(max_new_tokens=4, temperature=1.0, min_p=0.1))


def test_specdec_bench_times_its_plain_decoding_and_prompt_lookup(builds, checkpoint, tmp_path, monkeypatch) -> None:
    """The peer as specdec-bench opens it: the cached fp32 build, plain decoding and prompt lookup at every
    fixed length asked for (auto is ours alone), and the weight bytes of its plain decoding."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    shutil.copytree(builds / "fp32", default_genai_dir(checkpoint, "fp32"))
    engines = tmp_path / "engines"
    build(BuildRequest(out=engines, target=checkpoint, draft="none", max_context=128))
    models = open_engine_directory(engines, [DraftSpec.parse(NGRAM)])
    request = PeerRequest(names=(ORT_GENAI,), named=True, lengths=(2, 4, AUTO), threads=THREADS, n_ctx=128)
    peers = open_peers(request, models, FLOAT32, "cpu", lambda text: None)
    assert peers.methods == [PLAIN, Method(ORT_GENAI, NGRAM, 2), LOOKUP] and peers.notes == []
    assert peers.weight_bytes[PLAIN.name] > 0
    _, plain = peers.runners[ORT_GENAI].run(PLAIN, REPEATS, greedy(20))
    run, tokens = peers.runners[ORT_GENAI].run(peers.methods[1], REPEATS, greedy(20))
    assert tokens == plain and run.accepted_tokens > 0


def test_a_second_build_reuses_the_first(builds, checkpoint) -> None:
    out = builds / "fp32"
    stamp = (out / "model.onnx").stat().st_mtime_ns
    started = time.perf_counter()
    assert build_genai_model(checkpoint, "fp32", out) == out
    assert time.perf_counter() - started < 1  # no builder ran (one takes seconds)
    assert (out / "model.onnx").stat().st_mtime_ns == stamp


def test_a_failed_build_leaves_nothing(checkpoint, tmp_path) -> None:
    """A checkpoint whose weights are cut short: the builder reads its config and tokenizer, then fails."""
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    out = tmp_path / "cache" / "broken-fp32"
    with pytest.raises(RuntimeError, match="builder failed"):
        build_genai_model(broken, "fp32", out)
    assert list(out.parent.iterdir()) == []


@pytest.fixture
def interrupt_after() -> Iterator[Callable[[float], None]]:
    """Arms a real SIGINT-like interruption (KeyboardInterrupt from a timer signal), disarmed afterwards."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def test_an_interrupted_build_leaves_nothing(checkpoint, tmp_path, interrupt_after) -> None:
    out = tmp_path / "cache" / "tiny-int4"
    interrupt_after(1.0)  # the builder's process is still importing torch then
    with pytest.raises(KeyboardInterrupt):
        build_genai_model(checkpoint, "int4", out)
    assert list(out.parent.iterdir()) == []


def test_bad_precision_and_missing_install_are_refused(checkpoint, tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="fp32 or int4"):
        build_genai_model(checkpoint, "fp16", tmp_path / "x")
    monkeypatch.setattr(ort_genai_peer, "ort_genai_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'specdec-trt\[peers\]'"):
        OrtGenaiRunner(tmp_path, THREADS)
    with pytest.raises(ValueError, match=r"pip install 'specdec-trt\[peers\]'"):
        build_genai_model(checkpoint, "fp32", tmp_path / "y")


def test_the_default_folder_is_under_the_cache_root(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    gguf = tmp_path / "Model.Q4_1.gguf"
    assert default_genai_dir(gguf, "int4") == tmp_path / "peers" / "onnxruntime-genai" / "Model.Q4_1-int4"


@pytest.mark.slow
def test_the_gguf_is_rewritten_as_our_float32_tensors(tmp_path) -> None:
    write_float32_checkpoint(default_model_path(), tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    ours = load_checkpoint(default_model_path()).state_dict
    assert set(saved) <= set(ours) and set(ours) - set(saved) <= {"lm_head.weight"}  # tied to the embeddings
    assert all(torch.equal(saved[name], ours[name]) for name in saved)


@pytest.mark.slow
def test_fp32_greedy_tokens_are_our_decoders() -> None:
    """onnxruntime-genai's fp32 build of the default GGUF and our plain decoding on the default engines (the same
    float32 tensors) give the same 128 greedy tokens on each prompt (on this machine: none diverged)."""
    if not (default_engine_dir() / MANIFEST_NAME).is_file():
        pytest.skip(f"the default engines are not built in {default_engine_dir()}: specdec-run builds them")
    gguf = default_model_path()
    runner = OrtGenaiRunner(build_genai_model(gguf, "fp32", default_genai_dir(gguf, "fp32")), 2)
    tokenizer = load_tokenizer(gguf)
    ours = SpeculativeDecoder.from_engines(default_engine_dir(), "none", num_draft_tokens=0)
    try:
        for question in QUESTIONS:
            chat = [{"role": "user", "content": question}]
            prompt = tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
            expected = ours.generate(prompt, greedy(128)).token_ids
            _, tokens = runner.run(PLAIN, prompt, greedy(128))
            assert first_divergence(tokens, expected) is None, (question, first_divergence(tokens, expected))
    finally:
        ours.close()
