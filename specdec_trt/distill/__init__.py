"""specdec-distill: train a small draft for any target by knowledge distillation."""

from specdec_trt.distill.pipeline import DataSettings, DistillConfig, DistillError, DistillReport, distill
from specdec_trt.distill.trainer import TrainSettings

__all__ = ["DataSettings", "DistillConfig", "DistillError", "DistillReport", "TrainSettings", "distill"]
