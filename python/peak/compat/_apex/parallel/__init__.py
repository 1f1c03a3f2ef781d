"""``apex.parallel`` under peak's Apex alias: ``apex.parallel.LARC`` only. Apex's
DistributedDataParallel and SyncBatchNorm have torch counterparts (see docs/distributed.md)."""
import dis
import sys

_TORCH_COUNTERPARTS = {
    "DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "Reducer": "torch.nn.parallel.DistributedDataParallel (gradient all-reduce)",
    "SyncBatchNorm": "torch.nn.SyncBatchNorm",
    "convert_syncbn_model": "torch.nn.SyncBatchNorm.convert_sync_batchnorm",
}
_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def __getattr__(name):
    if name in _TORCH_COUNTERPARTS:
        message = (f"apex.parallel.{name} is not provided by peak's Apex alias: use "
                   f"{_TORCH_COUNTERPARTS[name]} (see docs/distributed.md)")
        # `from apex.parallel import name`: Python turns an AttributeError raised there into its
        # own ImportError, which names this module's internal path instead of the torch class to
        # use; an ImportError of ours is kept. An attribute access keeps AttributeError, so that
        # hasattr() answers False.
        frame = sys._getframe(1)
        code = frame.f_code.co_code
        by_import = 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == _IMPORT_FROM
        raise (ImportError if by_import else AttributeError)(message)
    raise AttributeError(f"module 'apex.parallel' has no attribute {name!r}")
