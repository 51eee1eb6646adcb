"""Engine directories: every way one can be broken is a clear ``EngineDirectoryError`` that names the file
and the fix (rebuild with specdec-build), from ``SpeculativeDecoder.from_engines`` and from
``specdec-run --engines`` (exit status 1, ``Error:``, no traceback); a valid directory loads and its
manifest records what was asked for."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import onnxruntime
import pytest
from click.testing import CliRunner, Result
from conftest import TEXT_VOCAB_SIZE
from test_build import MAX_CONTEXT, MAX_DRAFT_LEN, SIZE, build_all

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.build import BuildRequest
from specdec_trt.build_engines import manifest as manifest_module
from specdec_trt.build_engines.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    EngineDirectoryError,
    file_digest,
    read_manifest,
)
from specdec_trt.build_engines.onnx_export import OPSET
from specdec_trt.build_engines.verified_files import VerifiedFiles
from specdec_trt.cli import run

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint) -> tuple[Path, Path]:
    """A target and a draft that agrees with it often."""
    target_kwargs = {"family": "llama", **SIZE}
    return make_checkpoint(**target_kwargs), make_checkpoint(draft_of=(target_kwargs, 0.05), seed=100)


@pytest.fixture(scope="module")
def engine_dir(checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One built directory; tests that break it work on a copy."""
    out = tmp_path_factory.mktemp("manifest") / "engines"
    target, draft = checkpoints
    build_all(BuildRequest(out=out, target=target, draft=draft, max_draft_len=MAX_DRAFT_LEN, max_context=MAX_CONTEXT))
    return out


def run_cli(*args: str | Path) -> Result:
    return CliRunner().invoke(run, [str(arg) for arg in args])


def read_body(directory: Path) -> dict:
    return json.loads((directory / MANIFEST_NAME).read_text())


def write_body(directory: Path, body: dict) -> None:
    (directory / MANIFEST_NAME).write_text(json.dumps(body, indent=2, sort_keys=True))


def reseal(body: dict) -> dict:
    """Recompute the manifest's own checksum as ``Manifest.to_json`` does (sha256 of the sorted JSON of
    everything else), so that only the other checks can tell the manifest changed."""
    rest = {key: value for key, value in body.items() if key != "checksum"}
    return {**rest, "checksum": hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()}


# --- each corruption: (break the copy, returning the file the message must name), message, fix -------------


def remove_manifest(directory: Path) -> str:
    (directory / MANIFEST_NAME).unlink()
    return MANIFEST_NAME


def garble_manifest(directory: Path) -> str:
    (directory / MANIFEST_NAME).write_text("{ not json")
    return MANIFEST_NAME


def truncate_weights(directory: Path) -> str:
    path = directory / "target" / "model.onnx.data"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "target/model.onnx.data"


def flip_one_byte(directory: Path) -> str:
    """Same size, different bytes: only the sha256 can tell."""
    path = directory / "draft" / "model.onnx.data"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return "draft/model.onnx.data"


def edit_manifest(directory: Path) -> str:
    body = read_body(directory)
    body["target"]["max_context"] *= 2
    write_body(directory, body)
    return MANIFEST_NAME


def bump_schema_version(directory: Path) -> str:
    write_body(directory, reseal({**read_body(directory), "schema_version": SCHEMA_VERSION + 1}))
    return MANIFEST_NAME


def remove_listed_file(directory: Path) -> str:
    (directory / "tokenizer" / "tokenizer.json").unlink()
    return "tokenizer/tokenizer.json"


REBUILD = "rebuild the engines with specdec-build"
CORRUPTIONS: dict[str, tuple[Callable[[Path], str], str, str]] = {
    "no manifest": (remove_manifest, "is not an engine directory", "build one with specdec-build"),
    "manifest not JSON": (garble_manifest, "is not valid JSON", REBUILD),
    "truncated weights": (truncate_weights, "bytes, the manifest says", REBUILD),
    "changed bytes, same size": (flip_one_byte, "does not match its sha256", REBUILD),
    "edited manifest": (edit_manifest, "was edited after the build", REBUILD),
    "schema version": (bump_schema_version, f"schema version {SCHEMA_VERSION + 1} but this specdec-trt reads", REBUILD),
    "listed file missing": (remove_listed_file, "tokenizer.json is missing", REBUILD),
}


@pytest.fixture(params=CORRUPTIONS)
def broken(request: pytest.FixtureRequest, engine_dir: Path, tmp_path: Path) -> tuple[Path, str, str, str]:
    """A corrupted copy of the engine directory, the path its error must name, the message and the fix."""
    corrupt, message, fix = CORRUPTIONS[request.param]
    copy = Path(shutil.copytree(engine_dir, tmp_path / "engines"))
    return copy, str(copy / corrupt(copy)), message, fix


def test_from_engines_names_the_file_and_the_fix(broken: tuple[Path, str, str, str]) -> None:
    directory, path, message, fix = broken
    with pytest.raises(EngineDirectoryError) as caught:
        SpeculativeDecoder.from_engines(directory)
    assert path in str(caught.value) and message in str(caught.value) and fix in str(caught.value)


def test_specdec_run_names_the_file_and_the_fix(broken: tuple[Path, str, str, str]) -> None:
    directory, path, message, fix = broken
    result = run_cli("--engines", directory, "-n", "4", "hello")
    assert result.exit_code == 1, result.output
    assert "Error:" in result.output and "Traceback" not in result.output
    assert path in result.output and message in result.output and fix in result.output


def test_resealed_manifest_still_loads(engine_dir: Path, tmp_path: Path) -> None:
    """The positive control for the schema-version case: ``reseal`` computes the checksum the reader
    expects, so there only the version check can have failed."""
    copy = Path(shutil.copytree(engine_dir, tmp_path / "engines"))
    write_body(copy, reseal(read_body(copy)))
    assert read_manifest(copy) == read_manifest(engine_dir)


def test_more_drafts_than_built_for(engine_dir: Path) -> None:
    decoder = SpeculativeDecoder.from_engines(engine_dir, "engine")
    assert decoder.num_draft_tokens == MAX_DRAFT_LEN, "the default (5) is capped by what the engine was built for"
    assert decoder.generate("hello", PARAMS, num_draft_tokens=MAX_DRAFT_LEN).stats.drafted_tokens > 0
    with pytest.raises(ValueError, match="rebuild with specdec-build --max-draft-len"):
        decoder.generate("hello", PARAMS, num_draft_tokens=MAX_DRAFT_LEN + 1)
    asking = SpeculativeDecoder.from_engines(engine_dir, num_draft_tokens=MAX_DRAFT_LEN + 1)
    with pytest.raises(ValueError, match=f"num_draft_tokens={MAX_DRAFT_LEN + 1} exceeds the {MAX_DRAFT_LEN} drafts"):
        asking.generate("hello", PARAMS)
    result = run_cli("--engines", engine_dir, "-k", MAX_DRAFT_LEN + 1, "-n", "4", "hello")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "Error:" in result.output and "--max-draft-len" in result.output


def test_valid_directory_loads_and_records_the_request(engine_dir: Path, checkpoints: tuple[Path, Path]) -> None:
    manifest = read_manifest(engine_dir)
    assert manifest.schema_version == SCHEMA_VERSION and manifest.draft_kind == "model"
    for entry, role, source in ((manifest.target, "target", checkpoints[0]), (manifest.draft, "draft", checkpoints[1])):
        assert entry.graph == f"{role}/model.onnx" and entry.source == str(source)
        assert (entry.dtype, entry.quantization, entry.opset) == ("float32", "none", OPSET)
        assert (entry.max_context, entry.max_draft_len) == (MAX_CONTEXT, MAX_DRAFT_LEN)
        assert (entry.num_layers, entry.num_kv_heads, entry.head_dim) == (2, 2, SIZE["head_dim"])
        assert entry.vocab_size == TEXT_VOCAB_SIZE and entry.eos_token_ids == [2]
        assert entry.architecture["model_type"] == "llama" and entry.architecture["hidden_size"] == SIZE["hidden_size"]
    assert manifest.versions["onnxruntime"] == onnxruntime.__version__
    assert {"specdec-trt", "torch", "onnx", "transformers"} <= set(manifest.versions)
    on_disk = {str(p.relative_to(engine_dir)) for p in engine_dir.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert set(manifest.files) == on_disk
    for name, expected in manifest.files.items():
        path = engine_dir / name
        assert expected == {"sha256": file_digest(path), "bytes": path.stat().st_size}, name
    out = SpeculativeDecoder.from_engines(engine_dir).generate("hello", PARAMS)
    assert len(out.token_ids) == PARAMS.max_new_tokens and out.stats.drafted_tokens > 0
    result = run_cli("--engines", engine_dir, "--json", "-n", "8", "hello")
    assert result.exit_code == 0, result.output
    expected = SpeculativeDecoder.from_engines(engine_dir).generate("hello", SamplingParams(max_new_tokens=8))
    assert json.loads(result.stdout)["token_ids"] == expected.token_ids


def test_files_checked_once_are_not_read_again_until_they_change(
    engine_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening the same engines again reads no file for its sha256; a byte flipped since (same size, in place)
    is read again and caught."""
    copy = tmp_path / "engines"
    shutil.copytree(engine_dir, copy)
    record = VerifiedFiles(tmp_path / "verified.json")
    digests: list[Path] = []
    counted = manifest_module.file_digest

    def counting(path: Path) -> str:
        digests.append(path)
        return counted(path)

    monkeypatch.setattr(manifest_module, "file_digest", counting)
    read_manifest(copy, verified=record)
    assert len(digests) == len(read_body(copy)["files"]) and (tmp_path / "verified.json").is_file()
    digests.clear()
    read_manifest(copy, verified=VerifiedFiles(tmp_path / "verified.json"))
    assert digests == []
    flip_one_byte(copy)
    with pytest.raises(EngineDirectoryError, match="does not match its sha256"):
        read_manifest(copy, verified=VerifiedFiles(tmp_path / "verified.json"))
    assert digests == [copy / "draft" / "model.onnx.data"]
