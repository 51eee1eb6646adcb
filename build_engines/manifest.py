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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, get_origin, get_type_hints

from specdec_trt.build_engines.verified_files import VerifiedFiles

SCHEMA_VERSION = 3  # 2: the graphs take query_seqlens (a batched multi-token pass); 3: packed new tokens
ROTARY_POSITIONS_KEY = "specdec.rotary_positions"  # graph metadata: the positions its rotary tables cover
MANIFEST_NAME = "manifest.json"
_REBUILD = "rebuild the engines with specdec-build"
DRAFT_KINDS = ("int4", "model", "none")
ENGINE_DTYPES = ("float32", "float16")


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


# Each ModelEntry field's JSON type, to check manifests whose checksum was recomputed after an edit.
_ENTRY_TYPES = {name: get_origin(hint) or hint for name, hint in get_type_hints(ModelEntry).items()}


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


def read_manifest(directory: Path, verify_files: bool = True, verified: VerifiedFiles | None = None) -> Manifest:
    """Parse and check an engine directory's manifest (and, by default, every file's size and sha256; those that
    ``verified`` holds as checked and unchanged are not read again)."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise EngineDirectoryError(
            f"{path} is missing: {directory} is not an engine directory; build one with specdec-build"
        )
    try:
        body = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise EngineDirectoryError(f"{path} is not UTF-8 text (byte offset {err.start}): {_REBUILD}") from None
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
    problem = _layout_problem(body)
    if problem:
        raise EngineDirectoryError(f"{path} is not a manifest specdec-build writes ({problem}): {_REBUILD}")
    manifest = Manifest(
        target=ModelEntry(**body["target"]),
        draft=ModelEntry(**body["draft"]) if body["draft"] else None,
        draft_kind=body["draft_kind"],
        versions=body["versions"],
        files=body["files"],
    )
    if verify_files:
        for name, expected in manifest.files.items():
            _check_file(Path(directory) / name, expected, verified)
        if verified is not None:
            verified.save()
    return manifest


def _layout_problem(body: dict[str, Any]) -> str | None:
    """What in a checksum-valid manifest body differs from what ``write_manifest`` writes (None: nothing):
    every key present, none added, each value of its type, every graph among the checksummed files."""
    problem = _keys_problem("the manifest", body, {f.name for f in fields(Manifest)})
    if problem:
        return problem
    if body["draft_kind"] not in DRAFT_KINDS:
        return f"draft_kind {body['draft_kind']!r} is none of {', '.join(DRAFT_KINDS)}"
    if (body["draft"] is None) != (body["draft_kind"] == "none"):
        return f"draft_kind {body['draft_kind']!r} does not match the draft entry"
    files = body["files"]
    if not isinstance(files, dict) or any(
        not isinstance(f, dict) or set(f) != {"sha256", "bytes"} or not isinstance(f["bytes"], int)
        for f in files.values()
    ):
        return "'files' must map each file to its sha256 and bytes"
    if not isinstance(body["versions"], dict):
        return "'versions' must be an object"
    for role in ("target", "draft"):
        entry = body[role]
        if entry is None and role == "draft":
            continue
        problem = _keys_problem(f"the {role} entry", entry, set(_ENTRY_TYPES))
        if problem:
            return problem
        for name, kind in _ENTRY_TYPES.items():
            value = entry[name]
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
                return f"{role}.{name} is {value!r}, not a {'non-negative integer' if kind is int else kind.__name__}"
        if entry["dtype"] not in ENGINE_DTYPES:
            return f"{role}.dtype {entry['dtype']!r} is none of {', '.join(ENGINE_DTYPES)}"
        sizes = ("max_context", "max_draft_len", "num_layers", "num_kv_heads", "head_dim", "vocab_size")
        zero = next((name for name in sizes if entry[name] == 0), None)
        if zero:
            return f"{role}.{zero} is 0"
        if entry["graph"] not in files:
            return f"{role}.graph {entry['graph']!r} is not among its checksummed files"
        if any(not isinstance(t, int) or isinstance(t, bool) for t in entry["eos_token_ids"]):
            return f"{role}.eos_token_ids must be integers"
    return None


def _keys_problem(what: str, body: object, expected: set[str]) -> str | None:
    if not isinstance(body, dict):
        return f"{what} is not an object"
    missing, extra = sorted(expected - set(body)), sorted(set(body) - expected)
    if missing:
        return f"{what} lacks {', '.join(missing)}"
    if extra:
        return f"{what} has unknown keys {', '.join(extra)}"
    return None


def _check_file(path: Path, expected: dict[str, Any], verified: VerifiedFiles | None) -> None:
    if not path.is_file():
        raise EngineDirectoryError(f"{path} is missing: {_REBUILD}")
    if path.stat().st_size != expected["bytes"]:
        raise EngineDirectoryError(
            f"{path} has {path.stat().st_size} bytes, the manifest says {expected['bytes']} (truncated or "
            f"replaced): {_REBUILD}"
        )
    if verified is not None and verified.holds(path, expected["sha256"]):
        return
    if file_digest(path) != expected["sha256"]:
        raise EngineDirectoryError(
            f"{path} does not match its sha256 in the manifest (corrupt or replaced): {_REBUILD}"
        )
    if verified is not None:
        verified.add(path, expected["sha256"])


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
