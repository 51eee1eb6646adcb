"""The memory-bandwidth limit in specdec-bench: weight bytes per token of ONNX graphs, GGUF files and
transformers models, the machine's read rate, our decode step's breakdown, and the figures and markdown
built from them. Graphs, files and engines are real (tiny ones made here); figures derived from known inputs
are checked by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import onnx
import pytest
import torch
from conftest import build_model
from onnx import TensorProto, helper

from specdec_trt.bench.bandwidth import (
    gguf_weight_bytes,
    matrix_vector_bandwidth,
    module_weight_bytes,
    onnx_weight_bytes,
    stream_bandwidth,
)
from specdec_trt.bench.harness import first_divergence
from specdec_trt.bench.methods import LLAMA_CPP, LLAMA_CPP_VERSION, ORT_GENAI, OURS, OWN_LENGTHS, TRANSFORMERS, Method
from specdec_trt.bench.peers import FOUR_BIT, PeerError, PeerRequest, open_peers, weight_class
from specdec_trt.bench.peers_report import compared_rows, peers_section
from specdec_trt.bench.step_profile import step_breakdown
from specdec_trt.bench.summary import summarise
from specdec_trt.build import BuildRequest, build
from specdec_trt.build_engines.manifest import read_manifest
from specdec_trt.decoder import AUTO
from specdec_trt.draft_spec import DraftSpec
from specdec_trt.loading import model_spec, open_engine_directory

SIZE = {"hidden_size": 64, "head_dim": 16}


def test_onnx_weight_bytes_skip_tables_that_are_only_looked_up(tmp_path: Path) -> None:
    """An embedding table read by Gather alone counts nothing; a table a MatMul also reads counts whole."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [10, 4], np.zeros(40, np.float32))
    head = helper.make_tensor("head", TensorProto.FLOAT, [4, 10], np.zeros(40, np.float32))
    scale = helper.make_tensor("scale", TensorProto.FLOAT16, [4], np.zeros(4, np.float16).view(np.uint16))
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"]),
        helper.make_node("Mul", ["rows", "scale16"], ["scaled"]),
        helper.make_node("Cast", ["scale"], ["scale16"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["scaled", "head"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        [table, head, scale],
    )
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), path)
    assert onnx_weight_bytes(path) == 40 * 4 + 4 * 2  # the head in float32, the scale in float16
    tied = helper.make_graph(
        [*nodes[:3], helper.make_node("MatMul", ["scaled", "table"], ["logits"])],
        "g",
        graph.input,
        graph.output,
        [table, scale],
    )
    onnx.save(helper.make_model(tied), path)
    assert onnx_weight_bytes(path) == 40 * 4 + 4 * 2  # the table is the head too: read whole


def _write_gguf(path: Path, with_head: bool) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), np.float32))
    if with_head:
        writer.add_tensor("output.weight", np.zeros((16, 8), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


def test_gguf_weight_bytes_count_the_embedding_only_when_it_is_the_head(tmp_path: Path) -> None:
    assert gguf_weight_bytes(_write_gguf(tmp_path / "tied.gguf", with_head=False)) == (16 * 8 + 8 * 8) * 4
    assert gguf_weight_bytes(_write_gguf(tmp_path / "head.gguf", with_head=True)) == (8 * 8 + 16 * 8) * 4


def test_module_weight_bytes_count_tied_tables_once() -> None:
    model = build_model(**SIZE)  # untied: the input table is only looked up
    everything = sum(p.numel() * 4 for p in model.parameters())
    table = model.get_input_embeddings().weight.numel() * 4
    assert module_weight_bytes(model) == everything - table
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tie them
    assert module_weight_bytes(model) == everything - table  # the head is the table now, counted once


def test_stream_kernels_and_the_matrix_vector_product_give_rates_in_gigabytes() -> None:
    """Plausible rates (0.1 GB/s to 10 TB/s), the median never above the best; the matrix-vector product on
    distinct weights (shared ones would be read from cache and read faster than any memory)."""
    rates = [*stream_bandwidth(threads=1, gigabytes=0.05, repeats=3).values()]
    rates.append(matrix_vector_bandwidth(gigabytes=0.05, repeats=3))
    assert len(rates) == 4
    for rate in rates:
        assert 0.1 < rate.median <= rate.best < 10_000


def test_first_divergence_names_the_first_differing_token() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # stopped early: the shorter ends where they part


@pytest.fixture(scope="module")
def engine_dir(make_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engines") / "plain"
    build(BuildRequest(out=out, target=make_checkpoint(family="llama", **SIZE), draft="none", max_context=128))
    return out


def test_step_breakdown_accounts_for_the_whole_step(engine_dir: Path) -> None:
    spec = model_spec(engine_dir, read_manifest(engine_dir, verify_files=False).target)
    step = step_breakdown(spec, context=20, steps=8)
    assert step["step_ms"] > 0 and step["ms"]["matrix"] > 0 and step["ms"]["attention"] > 0
    assert sum(step["ms"].values()) == pytest.approx(step["step_ms"], rel=0.05)  # nodes and what they miss
    assert sum(step["share"].values()) == pytest.approx(1.0, rel=0.05)
    assert step["not_matrix_share"] == pytest.approx(1 - step["ms"]["matrix"] / step["step_ms"])


def test_a_verify_pass_of_several_rows_is_profiled_without_their_prefills(engine_dir: Path) -> None:
    """Three rows of 4 new tokens: the three prefill runs stay out of the nodes' time, or the nodes would add
    up to more than the passes' wall time."""
    spec = model_spec(engine_dir, read_manifest(engine_dir, verify_files=False).target)
    verify = step_breakdown(spec, context=20, steps=8, rows=3, width=4)
    assert (verify["rows"], verify["width"], verify["context"]) == (3, 4, 20)
    assert verify["ms"]["matrix"] > 0 and verify["ms"]["attention"] > 0
    assert sum(verify["ms"].values()) == pytest.approx(verify["step_ms"], rel=0.05)


def run(method: str, total: float, ttft: float, draft: bool = False, same: bool | None = True, **extra) -> dict:
    figures = {"drafted_tokens": 10, "drafted_per_position": [5, 5], "accepted_per_position": [5, 3]}
    return {
        "suite": "s",
        "temperature": 0.0,
        "prompt_id": "a",
        "repeat": 0,
        "method": method,
        "generated_tokens": 11,
        "total_s": total,
        "ttft_s": ttft,
        "rounds": 5 if draft else 10,
        "accepted_tokens": 5 if draft else 0,
        "draft_s": 0.01 if draft else None,
        "same_tokens_as_plain": same,
        "first_divergence": None if same is not False else 7,
        **(figures if draft else {}),
        **extra,
    }


PLAIN, DEFAULT = Method(OURS, None), Method(OURS, "ngram+int4", AUTO)
LLAMA, LOOKUP, GENAI = Method(LLAMA_CPP, None), Method(LLAMA_CPP, "ngram-mod", OWN_LENGTHS), Method(ORT_GENAI, None)
LIMITS = {"machine_read_GBps": 20.0, "weight_bytes_per_token": {PLAIN.name: 500e6, LLAMA.name: 400e6}}


def summary() -> list[dict]:
    """Ours 10 tokens after the first in 0.5 s (20 tok/s decoding), llama.cpp in 1.0 s, its lookup in 0.5 s,
    our default drafter in 0.25 s; onnxruntime-genai's tokens differ from ours from token 7."""
    runs = [
        run(PLAIN.name, 0.6, 0.1),
        run(DEFAULT.name, 0.35, 0.1, draft=True),
        run(LLAMA.name, 1.1, 0.1),
        run(LOOKUP.name, 0.6, 0.1, draft=True),
        run(GENAI.name, 2.1, 0.1, same=False),
    ]
    return summarise(runs, [PLAIN, DEFAULT, LLAMA, LOOKUP, GENAI], LIMITS)


def test_bandwidth_figures_are_weight_bytes_times_decode_rate() -> None:
    rows = {r["method"]: r for r in summary()}
    ours, theirs = rows[PLAIN.name], rows[LLAMA.name]
    assert ours["used_GBps"] == pytest.approx(500e6 * 20 / 1e9)  # 10 GB/s of the machine's 20
    assert ours["of_bound"] == pytest.approx(0.5) and ours["bound_tokens_per_s"] == pytest.approx(40.0)
    assert ours["weight_mb_per_token"] == pytest.approx(500.0)
    assert theirs["used_GBps"] == pytest.approx(400e6 * 10 / 1e9) and theirs["of_bound"] == pytest.approx(0.2)
    assert rows[GENAI.name]["used_GBps"] is None  # its weight bytes are not known in this summary
    assert rows[DEFAULT.name]["of_bound"] is None  # the bound is plain decoding's
    assert rows[GENAI.name]["first_divergence"] == 7


def test_peers_section_compares_plain_methods_and_the_fastest_drafters() -> None:
    rows = summary()
    assert [r["method"] for r in compared_rows(rows)] == [PLAIN.name, LLAMA.name, GENAI.name, DEFAULT.name, LOOKUP.name]
    data = {"command": "specdec-bench x", "weights": "4-bit", "limits": LIMITS, "summary": rows, "notes": ["t: why"]}
    data["environment"] = {"packages": {LLAMA_CPP_VERSION: "11434.0.0"}}
    text = peers_section(data)
    assert "llama.cpp is its current source, build 11434.0.0" in text
    assert "## Against llama.cpp and onnxruntime-genai: 4-bit weights" in text
    assert "20.0 GB/s" in text and "| plain | 18.3 | 20.0 | 500 | 10.0 | 40.0 | 50% | yes |" in text
    assert f"| {GENAI.name} | 5.2 | 5.0 | - | - | - | - | from token 7 |" in text
    assert "our plain 1.83x llama.cpp's plain" in text  # 11 / 0.6 against 11 / 1.1
    assert "our plain 3.50x onnxruntime-genai's plain" in text  # 11 / 0.6 against 11 / 2.1
    assert f"our {DEFAULT.name} 3.14x llama.cpp's plain" in text  # 11 / 0.35 against 11 / 1.1
    assert f"our {DEFAULT.name} 1.71x llama.cpp's best, {LOOKUP.name}" in text  # 11 / 0.35 against 11 / 0.6
    assert "our plain at 50% of the bandwidth bound" in text
    assert "- t: why" in text


def test_a_four_bit_run_leaves_transformers_out_and_says_why(make_checkpoint, tmp_path: Path) -> None:
    """An int4-quantized target makes a 4-bit run; transformers has no 4-bit CPU path: a note when the peers
    are chosen by default, an error when it is named."""
    out = tmp_path / "int4-target"
    target = make_checkpoint(family="llama", **SIZE)
    build(BuildRequest(out=out, target=target, draft="none", target_quantization="int4", max_context=128))
    assert weight_class(out, torch.float32) == FOUR_BIT
    models = open_engine_directory(out, [DraftSpec.parse("ngram")])
    request = PeerRequest(names=(TRANSFORMERS,), named=False, lengths=(2,), threads=1, n_ctx=128)
    found = open_peers(request, models, FOUR_BIT, "cpu", lambda text: None)
    assert found.methods == [] and found.notes == [
        "transformers: transformers has no 4-bit weights on a CPU; it is compared in float32 runs"
    ]
    with pytest.raises(PeerError, match="--peer transformers: transformers has no 4-bit weights"):
        open_peers(replace(request, named=True), models, FOUR_BIT, "cpu", lambda text: None)
