"""specdec-trt: lossless speculative decoding.

from specdec_trt import SpeculativeDecoder, SamplingParams
dec = SpeculativeDecoder.from_pretrained("path/to/target", draft="path/to/draft")  # or draft="ngram"
out = dec.generate("prompt", SamplingParams(max_new_tokens=128, temperature=0.8, seed=1))  # num_draft_tokens=AUTO
"""

__version__ = "0.1.0"

from specdec_trt.lazy_exports import lazy_exports

_EXPORTS = {
    "AUTO": "specdec_trt.draft_spec",
    "GenerationOutput": "specdec_trt.request",
    "GenerationStats": "specdec_trt.stats",
    "GenerationStream": "specdec_trt.decoder",
    "SamplingParams": "specdec_trt.sampling",
    "SpeculativeDecoder": "specdec_trt.decoder",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
