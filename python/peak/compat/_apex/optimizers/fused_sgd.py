"""``apex.optimizers.fused_sgd`` under peak's Apex alias (Apex's module path)."""
from . import FusedSGD

__all__ = ["FusedSGD"]
