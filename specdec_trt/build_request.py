"""What ``specdec-build`` builds, as plain data importable without torch or ONNX Runtime (commands name presets
and quantizations in their options before they load anything), and where built things are cached."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specdec_trt.draft_spec import INT4

QUANTIZATIONS = ("none", "int4")  # of a model built from its own checkpoint; int4: MatMulNBits, block 32
PRESETS = {
    "smollm2-135m": {"target": None, "draft": INT4, "max_draft_len": 8, "max_context": 8192, "dtype": "float32"},
}


@dataclass(frozen=True)
class BuildRequest:
    """What to build. ``target=None`` is the embedded SmolLM2-135M-Instruct; ``draft`` is a checkpoint,
    "int4" (the target block-quantized to 4 bits) or "none". ``target_quantization`` and
    ``draft_quantization`` block-quantize that checkpoint's linear layers to 4 bits ("int4"): a cheaper
    draft (speculative decoding stays exact for any draft), or a smaller target, whose own output it then
    is."""

    out: Path
    target: str | Path | None = None
    draft: str | Path = INT4
    max_draft_len: int = 8
    max_context: int = 2048
    dtype: str = "float32"
    target_quantization: str = "none"
    draft_quantization: str = "none"
    force: bool = False


def cache_root() -> Path:
    """Where the project keeps what it builds once and reuses: ``$SPECDEC_CACHE`` or ~/.cache/specdec-trt."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec-trt"))
