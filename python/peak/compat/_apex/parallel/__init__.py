"""``apex.parallel`` (and ``apex.parallel.distributed``) under peak's Apex alias: ``LARC``;
``DistributedDataParallel``, ``SyncBatchNorm`` and ``convert_syncbn_model`` over torch's own;
``flat_dist_call`` (docs/migrating.md)."""
import dis
import sys

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors as flatten
from torch._utils import _unflatten_dense_tensors as unflatten

_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def _apex_all_reduce(options, bucket):
    """Apex's gradient all-reduce, as its ``allreduce_bucket``: in fp32 if asked, divided by the
    predivide factor before the sum and by world size / factor after it (bit for bit Apex's)."""
    group, factor, average, fp32 = options
    grads = bucket.buffer()
    summed = grads.float() if fp32 else grads
    if factor != 1.0:
        summed.mul_(1.0 / factor)
    world = dist.get_world_size(group)

    def done(fut):
        out = fut.value()[0]
        if average:
            out.mul_(factor / world)
        return grads.copy_(out) if out is not grads else grads
    return dist.all_reduce(summed, group=group, async_op=True).get_future().then(done)


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """Apex's DistributedDataParallel (its arguments) as torch's: parameters broadcast from rank
    0, gradients all-reduced in backward and averaged as Apex does it. ``message_size`` sets the
    bucket size; ``delay_allreduce=True`` lets parameters go without gradients (torch's
    ``find_unused_parameters``); the stream and trigger options only tuned when Apex ran the
    all-reduce and are accepted. Buffers are not broadcast at each forward, as in Apex."""

    def __init__(self, module, message_size=10000000, delay_allreduce=False, shared_param=None,
                 allreduce_trigger_params=None, retain_allreduce_buffers=False,
                 allreduce_always_fp32=False, num_allreduce_streams=1,
                 allreduce_communicators=None, gradient_average=True,
                 gradient_predivide_factor=1.0, gradient_average_split_factor=None, prof=False):
        if shared_param is not None:
            raise ValueError("shared_param is no longer supported as an option (as in Apex): use "
                             "delay_allreduce=True for parameters used more than once or not at all")
        if retain_allreduce_buffers:
            raise ValueError("apex.parallel.DistributedDataParallel(retain_allreduce_buffers=True)"
                             " is not provided by peak's Apex alias: the all-reduced gradients "
                             "are in each parameter's .grad")
        # (gradient_average_split_factor: unused by Apex too)
        super().__init__(module, broadcast_buffers=False, find_unused_parameters=delay_allreduce,
                         bucket_cap_mb=message_size * 4 / 2**20)
        # (the default group, as Apex's: None keeps the wrapper deep-copyable and picklable)
        self.register_comm_hook((None, float(gradient_predivide_factor), bool(gradient_average),
                                 bool(allreduce_always_fp32)), _apex_all_reduce)

    def __setstate__(self, state):  # (a deepcopy, an unpickling: torch's new reducer has no hook)
        super().__setstate__(state)
        hooks, self._comm_hooks = self._comm_hooks, []
        for hook, options in hooks:
            self.register_comm_hook(options, hook)

    def forward(self, *inputs, **kwargs):
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as e:
            if "find_unused_parameters" not in str(e):
                raise
            raise RuntimeError(f"{e}\n(apex.parallel.DistributedDataParallel: pass "
                               "delay_allreduce=True, Apex's way to this)") from None

    def disable_allreduce(self):
        """Apex's: gradients accumulate locally until ``enable_allreduce()`` (torch's no_sync)."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self):
        self.require_backward_grad_sync = True


def apply_flat_dist_call(bucket, call, extra_args=None):
    """Apex's: ``call`` (a torch.distributed collective) on ``bucket`` (tensors of one type)
    flattened into one tensor, the result copied back; an ``all_reduce`` is then averaged over
    the world, as Apex's."""
    coalesced = flatten(bucket)
    call(coalesced, *(extra_args or ()))
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for tensor, synced in zip(bucket, unflatten(coalesced, bucket)):
        tensor.copy_(synced)


def split_by_type(tensors):
    """Apex's: ``tensors`` grouped by ``tensor.type()``, in first-seen order."""
    buckets = {}
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def flat_dist_call(tensors, call, extra_args=None):
    """Apex's (``apex.parallel.distributed.flat_dist_call``): one flattened ``call`` per tensor
    type, e.g. ``flat_dist_call(weights, dist.broadcast, (0,))`` gives every rank rank 0's."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


def _refuse_apex_only(channel_last=False, fuse_relu=False):
    if channel_last or fuse_relu:
        raise ValueError("apex.parallel's channel_last and fuse_relu (its NHWC CUDA kernel) are not "
                         "provided by peak's Apex alias: pass channels_last tensors in NCHW shape "
                         "and apply the ReLU after the batch norm")


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """Apex's SyncBatchNorm (its arguments) as ``torch.nn.SyncBatchNorm``."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, channel_last=False,
                 fuse_relu=False):
        _refuse_apex_only(channel_last, fuse_relu)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group)

    def forward(self, input, z=None):
        if z is not None:
            raise ValueError("apex.parallel.SyncBatchNorm's z (a residual added in its fused "
                             "kernel) is not provided by peak's Apex alias: add it to the output")
        return super().forward(input)


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """Apex's: every batch norm of ``module`` made a synchronized one (torch's
    ``SyncBatchNorm.convert_sync_batchnorm``)."""
    _refuse_apex_only(channel_last)
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)


def __getattr__(name):
    if name == "distributed":  # (Apex's `import apex` loaded it: apex.parallel.distributed.x)
        return sys.modules[__name__]
    if name == "Reducer":
        message = ("apex.parallel.Reducer is not provided by peak's Apex alias: use "
                   "torch.nn.parallel.DistributedDataParallel (see docs/distributed.md)")
        # `from apex.parallel import Reducer`: Python turns an AttributeError raised there into
        # its own ImportError, which names this module's internal path instead of the torch class
        # to use; an ImportError of ours is kept. An attribute access keeps AttributeError, so
        # that hasattr() answers False.
        frame = sys._getframe(1)
        code = frame.f_code.co_code
        by_import = 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == _IMPORT_FROM
        raise (ImportError if by_import else AttributeError)(message)
    raise AttributeError(f"module 'apex.parallel' has no attribute {name!r}")
