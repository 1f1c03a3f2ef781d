"""The gradients a master-weight store takes from a backward pass: set aside while another pass
runs, zeroed in place as torch's ``zero_grad`` does, sparse ones unscaled into their masters',
dropped where a step left them."""
from __future__ import annotations

import itertools

import torch
from torch import Tensor


def eager_no_grad(func):
    """``torch.no_grad``, and run eagerly under torch.compile (a graph break): a store's loop over
    its masters would be traced once per master (Dynamo's recompile limit in a compiled step)."""
    return torch._disable_dynamo(torch.no_grad()(func))


# NOTE: [Gradients a step left] A leftover gradient is recognised as the tensor object the step
# left, unchanged (its version counter): a mark in its ``__dict__`` (an int, unique per step), not
# a weak reference, which torch.utils.swap_tensors refuses (NOTE: [No weak references to
# parameters]). The mark stays when ``module.to()`` gives the gradient new memory through
# ``.data =`` (its default path); a swapping ``to()`` (FSDP2, or swap-on-conversion) replaces the
# object's contents and its ``__dict__``, so such a moved gradient counts as a new one and stays.
_marks = itertools.count()


def grads_left(params) -> list:
    """After a step (or its skip) under amp O2: each gradient of ``params`` it leaves, marked, with
    its version counter (``drop_left_grads``)."""
    mark, left = next(_marks), []
    for p in params:
        if p.grad is not None:
            p.grad._peak_left_by_step = mark
            left.append((p, mark, p.grad._version))
    return left


def drop_left_grads(left: list) -> None:
    """Before the next backward: a step's gradients go, as the masters' do (a skipped step's inf
    would be added into the next step), unless zeroed or written since (``zero_grad(set_to_none=
    False)``, a user's own): those stay, as torch keeps them."""
    for p, mark, version in left:
        g = p.grad
        if g is not None and g._version == version and getattr(g, "_peak_left_by_step", -1) == mark:
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
