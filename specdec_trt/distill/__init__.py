"""specdec-distill: train a small draft for any target by knowledge distillation."""

from specdec_trt.lazy_exports import lazy_exports

_PIPELINE, _TRAINER = "specdec_trt.distill.pipeline", "specdec_trt.distill.trainer"
_EXPORTS = {name: _PIPELINE for name in ("DataSettings", "DistillConfig", "DistillError", "DistillReport", "distill")}
_EXPORTS["TrainSettings"] = _TRAINER
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
