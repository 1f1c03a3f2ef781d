"""``apex.parallel`` under peak's Apex alias: ``apex.parallel.LARC`` only. Apex's
DistributedDataParallel and SyncBatchNorm have torch counterparts (see docs/distributed.md)."""

_TORCH_COUNTERPARTS = {
    "DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "Reducer": "torch.nn.parallel.DistributedDataParallel (gradient all-reduce)",
    "SyncBatchNorm": "torch.nn.SyncBatchNorm",
    "convert_syncbn_model": "torch.nn.SyncBatchNorm.convert_sync_batchnorm",
}


def __getattr__(name):
    if name in _TORCH_COUNTERPARTS:
        raise AttributeError(
            f"apex.parallel.{name} is not provided by peak's Apex alias: use "
            f"{_TORCH_COUNTERPARTS[name]} (see docs/distributed.md)")
    raise AttributeError(f"module 'apex.parallel' has no attribute {name!r}")
