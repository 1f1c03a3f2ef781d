"""``apex.parallel.LARC`` under peak's Apex alias."""
from peak.optimizers import LARC

__all__ = ["LARC"]
