"""``apex.optimizers.fused_adagrad`` under peak's Apex alias (Apex's module path)."""
from . import FusedAdagrad

__all__ = ["FusedAdagrad"]
