"""``apex.optimizers.fused_novograd`` under peak's Apex alias (Apex's module path)."""
from . import FusedNovoGrad

__all__ = ["FusedNovoGrad"]
