"""The gradients a master-weight store takes from a backward pass: set aside while another pass
runs, zeroed in place as torch's ``zero_grad`` does, sparse ones unscaled into their masters',
dropped where a step left them."""
from __future__ import annotations

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from ..scaling import local_shard


def eager_no_grad(func):
    """``torch.no_grad``, and run eagerly under torch.compile (a graph break): a store's loop over
    its masters would be traced once per master (Dynamo's recompile limit in a compiled step)."""
    return torch._disable_dynamo(torch.no_grad()(func))


def _storage_of(grad: Tensor):
    grad = local_shard(grad)
    return (grad._values() if grad.is_sparse else grad).untyped_storage()


def grads_left(params) -> list:
    """After a step (or its skip) under amp O2: each gradient of ``params`` it leaves, by a weak
    reference to its memory (not to the tensor: NOTE: [No weak references to parameters]) and its
    version counter (``drop_left_grads``)."""
    return [(p, StorageWeakRef(_storage_of(p.grad)), p.grad._version)
            for p in params if p.grad is not None]


def drop_left_grads(left: list) -> None:
    """Before the next backward: a step's gradients go, as the masters' do (a skipped step's inf
    would be added into the next step), unless zeroed or written since (``zero_grad(set_to_none=
    False)``, a user's own): those stay, as torch keeps them. (A gradient in the memory the step
    left, still alive, with the same version, is the one it left.)"""
    for p, memory, version in left:
        g = p.grad
        if (g is not None and g._version == version and not memory.expired()
                and _storage_of(g)._cdata == memory.cdata):
            p.grad = None


def own_grad(grad: Tensor | None) -> Tensor | None:
    """A gradient set aside while a backward pass runs: a copy where it is a view into a larger
    buffer (DistributedDataParallel(gradient_as_bucket_view=True): the pass writes the bucket)."""
    return grad.detach().clone() if grad is not None and grad._base is not None else grad


def unscaled_sparse(grad: Tensor, earlier: Tensor | None, unscale, dtype) -> Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) unscaled on its values (``unscale``: of
    a list, in place), in ``dtype``, plus ``earlier``: in a copy (two embeddings' gradients may
    share values), coalesced where widened (duplicate rows summed in fp32, not in fp16/bf16)."""
    wide = grad.to(dtype, copy=True)
    grad = wide.coalesce() if grad.dtype != dtype else wide
    unscale([grad._values()])
    return grad if earlier is None else grad + earlier if earlier.is_sparse else earlier + grad


def zero_in_place(grad: Tensor) -> None:
    """As torch's ``zero_grad(set_to_none=False)``: a view (DDP's bucket) is not detached."""
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()
