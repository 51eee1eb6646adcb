"""The engine directory's ``manifest.json``: what was built, from what, with which shapes and checksums.

Layout of an engine directory::

    manifest.json      this file
    tokenizer/         the target's tokenizer (the draft shares its vocabulary)
    target/model.onnx  + model.onnx.data
    draft/model.onnx   + model.onnx.data   (absent when built with --draft none)

Loading checks the schema version, the manifest's own checksum (so an edited manifest is caught), and
the size and sha256 of every file; each failure names the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2  # 2: the graphs take query_seqlens (a batched multi-token pass)
MANIFEST_NAME = "manifest.json"
_REBUILD = "rebuild the engines with specdec-build"


class EngineDirectoryError(ValueError):
    """An engine directory is missing, incomplete, corrupt, edited or from another schema version."""


@dataclass(frozen=True)
class ModelEntry:
    """One compiled model (the target or the draft)."""

    graph: str  # path of the ONNX graph, relative to the engine directory
    dtype: str
    quantization: str  # "none" or "int4-block32"
    max_context: int
    max_draft_len: int  # the verify shape: up to max_draft_len + 1 new tokens per forward
    opset: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eos_token_ids: list[int]
    source: str  # the checkpoint it was built from
    architecture: dict[str, Any]  # the Hugging Face config


@dataclass(frozen=True)
class Manifest:
    """The parsed manifest of an engine directory."""

    target: ModelEntry
    draft: ModelEntry | None
    draft_kind: str  # "int4" (quantized self-draft), "model" (a draft checkpoint) or "none"
    versions: dict[str, str]
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        body = asdict(self)
        body["checksum"] = _checksum(body)
        return json.dumps(body, indent=2, sort_keys=True)


def file_digest(path: Path) -> str:
    """sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(
    directory: Path, target: ModelEntry, draft: ModelEntry | None, draft_kind: str, versions: dict
) -> Manifest:
    """Checksum every file under ``directory`` and write the manifest beside them."""
    files = {
        str(path.relative_to(directory)): {"sha256": file_digest(path), "bytes": path.stat().st_size}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }
    manifest = Manifest(target, draft, draft_kind, versions, files)
    (directory / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def schema_version_of(directory: Path) -> int | None:
    """The schema version ``directory``'s manifest declares, or None when it has no readable manifest."""
    try:
        body = json.loads((Path(directory) / MANIFEST_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return body.get("schema_version") if isinstance(body, dict) else None


def read_manifest(directory: Path, verify_files: bool = True) -> Manifest:
    """Parse and check an engine directory's manifest (and, by default, every file's size and sha256)."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise EngineDirectoryError(
            f"{path} is missing: {directory} is not an engine directory; build one with specdec-build"
        )
    try:
        body = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise EngineDirectoryError(f"{path} is not valid JSON ({err}): {_REBUILD}") from err
    if not isinstance(body, dict):
        raise EngineDirectoryError(f"{path} does not hold a JSON object: {_REBUILD}")
    version = body.get("schema_version")
    if version != SCHEMA_VERSION:
        raise EngineDirectoryError(
            f"{path} has schema version {version!r} but this specdec-trt reads version {SCHEMA_VERSION}: {_REBUILD}"
        )
    if body.pop("checksum", None) != _checksum(body):
        raise EngineDirectoryError(f"{path} was edited after the build (its checksum does not match): {_REBUILD}")
    manifest = Manifest(
        target=ModelEntry(**body["target"]),
        draft=ModelEntry(**body["draft"]) if body["draft"] else None,
        draft_kind=body["draft_kind"],
        versions=body["versions"],
        files=body["files"],
    )
    if verify_files:
        for name, expected in manifest.files.items():
            _check_file(Path(directory) / name, expected)
    return manifest


def _check_file(path: Path, expected: dict[str, Any]) -> None:
    if not path.is_file():
        raise EngineDirectoryError(f"{path} is missing: {_REBUILD}")
    if path.stat().st_size != expected["bytes"]:
        raise EngineDirectoryError(
            f"{path} has {path.stat().st_size} bytes, the manifest says {expected['bytes']} (truncated or "
            f"replaced): {_REBUILD}"
        )
    if file_digest(path) != expected["sha256"]:
        raise EngineDirectoryError(
            f"{path} does not match its sha256 in the manifest (corrupt or replaced): {_REBUILD}"
        )


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
