"""Apex's manual mixed-precision helpers (``apex.fp16_utils.fp16util``), kept so that scripts
written for them run unchanged: ``amp.initialize(..., opt_level="O2")`` does the same in one call.
"""
from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..optimizers.masters import copy_to_model

__all__ = ["tofp16", "BN_convert_float", "network_to_half", "convert_module", "convert_network",
           "FP16Model", "prep_param_lists", "model_grads_to_master_grads",
           "master_params_to_model_params", "to_python_float", "clip_grad_norm"]

# Apex's name for it (torch < 0.4 had no trailing underscore).
clip_grad_norm = torch.nn.utils.clip_grad_norm_


def _affine_batch_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True


class tofp16(nn.Module):  # noqa: N801 (Apex's name)
    """``forward(input) = input.half()``: the first layer of :func:`network_to_half`."""

    def forward(self, input):  # noqa: A002 (Apex's argument name)
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 (Apex's name)
    """Turns every batch norm with affine parameters inside ``module`` back to fp32 (its running
    statistics and weights need fp32's range); returns ``module``."""
    for m in module.modules():
        if _affine_batch_norm(m):
            m.float()
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``nn.Sequential(tofp16(), network)`` with the network in fp16 except affine batch norm
    (Apex's legacy form; :class:`FP16Model` is the recommended one)."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Converts ``module``'s own floating-point parameters, their gradients and its buffers to
    ``dtype`` (not its children's)."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype=dtype)
            if param._grad is not None and param._grad.is_floating_point():
                param._grad.data = param._grad.data.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            buf.data = buf.data.to(dtype=dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Converts every module of ``network`` to ``dtype`` except batch norm with affine
    parameters (kept as they are, fp32); integer buffers stay integers. Returns ``network``."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"convert_network: dtype must be a floating-point torch.dtype (e.g. "
                        f"torch.half), got {dtype!r}")
    for module in network.modules():
        if not _affine_batch_norm(module):
            convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()  # the cuDNN weight buffer must be rebuilt in the new dtype
    return network


class FP16Model(nn.Module):
    """``network`` converted to fp16 (affine batch norm kept fp32, :func:`convert_network`);
    ``forward`` casts its tensor inputs to fp16 and returns the network's (fp16) output."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs):
        return self.network(*(t.half() for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False):
    """``(model_params, master_params)``: the model's parameters that require grad, and fp32
    copies of them (leaves with ``requires_grad``) for an fp32 optimizer.

    ``flat_master=True``: one flat fp32 master parameter holding them all (with an allocated
    gradient), for an optimizer that steps one tensor; every parameter must then have the same
    dtype."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            raise TypeError(
                f"prep_param_lists(flat_master=True): the model's parameters have several dtypes "
                f"({sorted(str(d) for d in dtypes)}) and cannot be flattened into one tensor. Use "
                "flat_master=False, or amp.initialize(..., opt_level='O2'), which keeps masters "
                "per dtype")
        if not model_params:
            raise ValueError("prep_param_lists(flat_master=True): the model has no parameters "
                             "that require grad")
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
        master = nn.Parameter(flat, requires_grad=True)
        master.grad = torch.zeros_like(master)  # as Apex: allocated, ready for the copy
        return model_params, [master]
    return model_params, [p.detach().clone().float().requires_grad_() for p in model_params]


@torch.no_grad()
def model_grads_to_master_grads(model_params, master_params, flat_master: bool = False) -> None:
    """Copies the model's gradients into the masters' (fp32). A model parameter without a
    gradient leaves its master's gradient None (not with ``flat_master``: every one is needed)."""
    if flat_master:
        missing = [i for i, p in enumerate(model_params) if p.grad is None]
        if missing:
            raise RuntimeError(
                f"model_grads_to_master_grads(flat_master=True): model_params{missing} have no "
                "gradient, and one flat master gradient needs all of them; run backward first, "
                "or use flat_master=False")
        flat = master_params[0]
        if flat.grad is None:
            flat.grad = torch.empty_like(flat)
        flat.grad.copy_(_flatten_dense_tensors([p.grad for p in model_params]))
        return
    _check_pairs(model_params, master_params)
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)


@torch.no_grad()
def master_params_to_model_params(model_params, master_params, flat_master: bool = False) -> None:
    """Copies the (fp32) masters into the model's parameters, rounding to their dtype."""
    if flat_master:
        master_params = _unflatten_dense_tensors(master_params[0], model_params)
    else:
        _check_pairs(model_params, master_params)
    copy_to_model(list(master_params), list(model_params))


def _check_pairs(model_params, master_params) -> None:
    if len(model_params) != len(master_params):
        raise ValueError(
            f"model_params has {len(model_params)} tensors but master_params has "
            f"{len(master_params)}: pass the two lists prep_param_lists returned (with "
            "flat_master=True for a flat master)")


def to_python_float(t) -> float:
    """``t.item()`` (Apex kept it for torch < 0.4, where tensors had no ``item``)."""
    return t.item() if hasattr(t, "item") else t[0]
