"""What a benchmark ran on: CPU, cores, threads, device, package versions and the git revision."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = (
    "specdec-trt",
    "torch",
    "transformers",
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-genai",
    "onnx",
    "tokenizers",
    "numpy",
)


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what the platform module knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_revision() -> str:
    """The source tree's commit, with "+changes" when it has uncommitted edits; "unknown" outside git."""
    source = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=source, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=source, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def environment(device: str, threads: int) -> dict:
    """The facts a reader needs to compare two benchmark files."""
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "platform": f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        "device": name,
        "packages": versions,
        "git_revision": git_revision(),
    }
