"""specdec-trt: lossless speculative decoding.

from specdec_trt import SpeculativeDecoder, SamplingParams
dec = SpeculativeDecoder.from_pretrained("path/to/target", draft="path/to/draft")  # or draft="ngram"
out = dec.generate("prompt", SamplingParams(max_new_tokens=128, temperature=0.8, seed=1))  # num_draft_tokens=AUTO
"""

__version__ = "0.1.0"  # before the imports: modules imported below may read it

from specdec_trt.decoder import AUTO, GenerationOutput, GenerationStream, SpeculativeDecoder
from specdec_trt.sampling import SamplingParams
from specdec_trt.stats import GenerationStats

__all__ = ["AUTO", "GenerationOutput", "GenerationStats", "GenerationStream", "SamplingParams", "SpeculativeDecoder"]
