"""``apex.optimizers.fused_mixed_precision_lamb`` under peak's Apex alias (Apex's module path)."""
from . import FusedMixedPrecisionLamb

__all__ = ["FusedMixedPrecisionLamb"]
