"""``apex.optimizers.fused_adam`` under peak's Apex alias (Apex's module path)."""
from . import FusedAdam

__all__ = ["FusedAdam"]
