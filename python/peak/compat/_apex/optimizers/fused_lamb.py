"""``apex.optimizers.fused_lamb`` under peak's Apex alias (Apex's module path)."""
from . import FusedLAMB

__all__ = ["FusedLAMB"]
