"""``apex.multi_tensor_apply.multi_tensor_apply`` under peak's Apex alias (Apex's module path)."""
from . import MultiTensorApply

__all__ = ["MultiTensorApply"]
