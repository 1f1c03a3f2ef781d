"""Deprecated Apex-era utilities kept for old scripts (``from apex.fp16_utils import
FP16_Optimizer`` -> ``from peak.fp16_utils import FP16_Optimizer``)."""
from .fp16_optimizer import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
