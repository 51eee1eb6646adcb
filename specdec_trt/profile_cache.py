"""Engine profiles kept beside the engines, as TensorRT keeps its timing cache: ``profiles.json`` in the engine
directory holds one profile (``specdec_trt.profile``) per machine, thread count and drafter, so that a decoder
opening the engines again on this machine starts with this machine's timings and measures nothing. A rebuilt
directory starts without any (the build replaces the whole directory); another machine, another ONNX Runtime or
another number of threads finds none of its own, and one is measured where a profile is (``specdec-serve``'s
start, ``specdec-build``)."""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import version
from pathlib import Path

from specdec_trt.profile import EngineProfile

PROFILES_NAME = "profiles.json"


def cpu_model() -> str:
    """The processor's model name (Linux's /proc/cpuinfo; elsewhere what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_key(threads: int, drafter: str, max_auto_draft: int) -> str:
    """What a profile holds for: this machine, ONNX Runtime's version, the intra-op threads, the drafter (its
    label) and the longest draft auto chooses (the profile's widest pass)."""
    parts = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "onnxruntime": version("onnxruntime"),
        "threads": threads,
        "drafter": drafter,
        "max_auto_draft": max_auto_draft,
    }
    return ";".join(f"{name}={value}" for name, value in parts.items())


class ProfileCache:
    """The profiles of one engine directory, read and written under ``key``."""

    def __init__(self, directory: Path, key: str) -> None:
        self.path = Path(directory) / PROFILES_NAME
        self.key = key

    def load(self, rows: list[int]) -> EngineProfile | None:
        """The profile kept for this key if it timed every number of ``rows`` (None: none, or one unreadable)."""
        try:
            stored = self._read().get(self.key)
            profile = EngineProfile.from_json(stored) if stored is not None else None
        except (KeyError, TypeError, ValueError, OSError):  # unreadable, or written by another version
            return None
        return profile if profile is not None and set(rows) <= set(profile.rows) else None

    def save(self, profile: EngineProfile) -> None:
        """Keep ``profile`` for this key beside the other keys' (atomically: a reader sees the old file or the new
        one). An OSError (a read-only directory) is the caller's to report."""
        try:
            profiles = self._read()
        except ValueError:
            profiles = {}
        profiles[self.key] = profile.to_json()
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(profiles, indent=1))
        os.replace(partial, self.path)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        if not isinstance(data, dict):
            raise ValueError(f"{self.path} is not a JSON object")
        return data
