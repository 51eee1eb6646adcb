"""An F32 GGUF of a quantized GGUF, for peers that read GGUF (llama.cpp) to run the weights our engines run.

Our engines load the default model's GGUF dequantized to float32; a benchmark against llama.cpp on "the same
weights" therefore needs those float32 tensors in a GGUF file. Every tensor is dequantized with the ``gguf``
package (the code transformers uses), the metadata is copied, and the file type says all-F32.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_request import cache_root


def write_f32_gguf(source: Path, out: Path) -> Path:
    """Write ``source``'s tensors, dequantized to float32, with its metadata, to ``out``."""
    reader = gguf.GGUFReader(source)
    architecture = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, architecture)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = gguf.LlamaFileType.ALL_F32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def f32_gguf_once(source: Path, out: Path) -> Path:
    """``source`` as an F32 GGUF at ``out``, written once: through a partial file renamed into place, so that an
    interrupted write never leaves a file that later runs would take for complete."""
    if not out.is_file():
        partial = out.with_name(out.name + ".partial")
        write_f32_gguf(source, partial)
        partial.replace(out)
    return out


def cached_f32_path(source: Path) -> Path:
    """Where the F32 GGUF of ``source`` is kept for every benchmark that runs llama.cpp on it."""
    return cache_root() / "peers" / "llama.cpp" / f"{source.stem}-f32.gguf"


def default_model_f32(out: Path | None = None) -> Path:
    """The default model (SmolLM2-135M-Instruct) as an F32 GGUF at ``out`` (default: its shared cached
    place), written once."""
    return f32_gguf_once(default_model_path(), out or cached_f32_path(default_model_path()))
