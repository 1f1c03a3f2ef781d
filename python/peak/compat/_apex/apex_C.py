"""``apex_C`` under peak's Apex alias: Apex's flatten/unflatten extension, which its
DistributedDataParallel and scripts' own bucketing call. torch's utilities are the ones Apex's
C++ called, so the results are Apex's to the bit."""
from torch._utils import _flatten_dense_tensors as flatten
from torch._utils import _unflatten_dense_tensors as unflatten

__all__ = ["flatten", "unflatten"]
