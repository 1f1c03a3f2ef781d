"""What ``amp.initialize`` does to models: input checks (all made before ``process`` changes
anything), casting, the patched ``forward``, the model state-dict hooks."""

from __future__ import annotations

import itertools
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from peak.optimizers.masters import (check_one_master_each, inner_optimizer, note_load_hook,
                                    refresh_after_load_hook)

from . import _caster
from ._amp_state import LOW_DTYPES, _amp_state, warn_or_err
from ._process_optimizer import process_optimizer
from .._bound import BoundMethod, stands_in_for
from .._ranks import multi_rank_run
from .._stacklevel import user_stacklevel

# Models that went through an enabled amp.initialize (params may be cast, forward patched).
_initialized_models: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def check_inputs(models, optimizers):
    """Normalize ``models``/``optimizers`` to lists and reject every bad input, changing nothing."""
    if isinstance(models, nn.Module):
        models_list = [models]
    elif isinstance(models, list) and all(isinstance(m, nn.Module) for m in models):
        models_list = list(models)
    else:
        raise TypeError("models must be either a single model or a list of models.")
    if optimizers is None:
        optimizers_list = []
    elif _is_optimizer(optimizers):
        optimizers_list = [optimizers]
    elif isinstance(optimizers, list) and all(_is_optimizer(o) for o in optimizers):
        optimizers_list = list(optimizers)
    else:
        hint = (" (got a tuple; pass a list)" if isinstance(optimizers, tuple) else
                " (torch.optim.Optimizer objects, or wrappers that keep one in .optimizer or "
                ".optim and share its param_groups)")
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers."
                        + hint)
    for i, model in enumerate(models_list):
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise RuntimeError(
                "Incoming model is an instance of {}. Parallel wrappers should only be applied to "
                "the model(s) AFTER \nthe model(s) have been returned from amp.initialize.".format(
                    f"torch.nn.parallel.{type(model).__name__}")
                + f" (models[{i}]: the wrapper has already registered the parameters' fp32 dtype "
                "and storage for its gradient all-reduce, and amp.initialize would cast them and "
                "patch the inner module's forward behind its back; see docs/distributed.md.) Pass "
                "the unwrapped model: model, optimizer = amp.initialize(model, optimizer, "
                "opt_level=...), then model = DistributedDataParallel(model, ...).")
        for j in range(i):
            if models_list[j] is model:
                raise ValueError(f"models[{i}] is the same object as models[{j}]; pass each model "
                                 "once.")
        if model in _initialized_models or "_amp_forward_config" in vars(model):  # (a deepcopy)
            raise RuntimeError(
                f"Model {type(model).__name__} (models[{i}]) was already passed through "
                "amp.initialize (or copied from one: deepcopy, torch.load), which casts its "
                "parameters and patches its forward: build a fresh model and pass it once (load "
                "its state_dict to resume); an EMA: copy the model before amp.initialize (fp32: "
                "low-precision weights round small EMA updates away), used without initialize.")
    for i, opt in enumerate(optimizers_list):
        inner = inner_optimizer(opt)
        for j in range(i):
            if inner_optimizer(optimizers_list[j]) is inner:
                raise ValueError(f"optimizers[{i}] is the same object as optimizers[{j}]; pass "
                                 "each optimizer once.")
        if not hasattr(inner, "_optimizer_state_dict_post_hooks"):
            raise TypeError(
                f"optimizers[{i}] ({type(opt).__name__}) is a torch.optim.Optimizer subclass that "
                "did not run torch.optim.Optimizer.__init__, and amp finds no inner optimizer in "
                "it (a wrapper keeps the torch optimizer in .optimizer, .optim or .base_optimizer "
                "and returns its param_groups). Keep it in one of those, or pass the inner "
                "optimizer to amp.initialize and wrap the one amp returns (docs/advanced.md).")
        if hasattr(opt, "_amp_stash") or hasattr(inner, "_amp_stash"):
            raise RuntimeError(
                "A given optimizer should only be passed through amp.initialize once. "
                f"optimizers[{i}] ({type(opt).__name__}) already was: build a fresh optimizer "
                "over the new model's parameters and pass that.")
    if not _amp_state.allow_incoming_model_not_fp32:
        for model in models_list:
            _check_fp32(model)
    model_params = {id(p) for model in models_list for p in model.parameters()}
    for i, opt in enumerate(optimizers_list):
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) not in model_params:
                    raise ValueError(
                        f"optimizers[{i}] ({type(opt).__name__}), param_groups[{g}], holds a "
                        f"parameter of shape {tuple(p.shape)} that is not a parameter of any model "
                        "passed to amp.initialize. Pass every model whose parameters the "
                        "optimizer updates (amp.initialize([model_a, model_b], optimizer, ...)); "
                        "a tensor outside any module: make it a model's nn.Parameter attribute.")
    return models_list, optimizers_list


def check_sharded_optimizers(optimizers_list, properties, models_list=()) -> None:
    """Reject what would silently stand still or half-step: masters in a ZeroRedundancyOptimizer's
    groups (its inner optimizer steps its own), a model under FSDP2's ``fully_shard`` cast or given
    masters (only O1 works over it), a parameter held twice (``check_one_master_each``)."""
    if properties.master_weights or properties.cast_model_type in LOW_DTYPES:
        for i, model in enumerate(models_list):
            if any(getattr(p, "device_mesh", None) is not None for p in model.parameters()):
                raise RuntimeError(
                    f"models[{i}] has DTensor parameters (FSDP2's fully_shard), which "
                    f"opt_level={properties.opt_level!r} would cast and give fp32 masters in the "
                    "optimizer's groups; FSDP2 replaced the parameters, so neither can happen. "
                    "Use opt_level='O1', or peak.amp.GradScaler with a peak.optimizers fused "
                    "optimizer built after fully_shard (docs/distributed.md).")
    if properties.master_weights or properties.loss_scale != 1.0:  # (each holder unscales)
        check_one_master_each([(f"optimizers[{i}]", [p for g in inner_optimizer(o).param_groups
                                                     for p in g["params"]])
                               for i, o in enumerate(optimizers_list)],
                              f"under opt_level={properties.opt_level!r}")
    if not properties.master_weights:
        return
    # Not imported (that scripts torch's functional optimizers: slow, and fails under O1): no
    # ZeroRedundancyOptimizer exists unless its module was imported.
    zero_module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero_module is None:
        return
    for i, opt in enumerate(optimizers_list):
        if isinstance(opt, zero_module.ZeroRedundancyOptimizer):
            raise RuntimeError(
                f"optimizers[{i}] is a torch.distributed.optim.ZeroRedundancyOptimizer, which "
                f"cannot keep amp's fp32 master weights (opt_level={properties.opt_level!r}, "
                "master_weights=True): its inner optimizer steps its own shard of the parameters, "
                "so the masters would never change. Use opt_level='O1' (fp32 weights) or 'O3' "
                "with ZeRO, or peak.amp.GradScaler with a low-precision model and a "
                "peak.optimizers fused optimizer (optimizer_class=FusedAdam), which keeps fp32 "
                "masters in its own sharded state; see docs/distributed.md.")


def _check_fp32(model: nn.Module) -> None:
    for kind, items in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if t.is_floating_point() and t.dtype in LOW_DTYPES:
                what = "parameters" if kind == "param" else "buffers"
                warn_or_err(f"Found {kind} {name} with type {t.dtype}, expected torch.float32.\n"
                    "When using amp.initialize, you do not need to call .half() or .bfloat16() on "
                    "your model\nbefore passing it, no matter what optimization level you "
                    "choose: pass the FP32 model and let the opt_level cast it.\n(Model "
                    f"{what} that are deliberately low precision: set "
                    "amp._amp_state.allow_incoming_model_not_fp32 = True before amp.initialize.)")


def first_device(models) -> torch.device:
    devices = (t.device for m in models for t in itertools.chain(m.parameters(), m.buffers()))
    return next(devices, torch.device("cpu"))


def process(models, optimizers, properties, cast_model_outputs) -> None:
    cast_type = properties.cast_model_type
    o1 = bool(properties.patch_torch_functions)
    fp32_originals: dict = {}  # id(param) -> its fp32 data before the cast (becomes the master)
    for model in models:
        if cast_type:
            fp32_originals.update(cast_model(model, cast_type,
                                             bool(properties.keep_batchnorm_fp32)))
            if cast_type in LOW_DTYPES:
                for module in model.modules():
                    module.register_state_dict_post_hook(_upcast_state_dict_hook)
        input_dtype = cast_type or None
        output_dtype = (cast_model_outputs or torch.float32) if cast_type else cast_model_outputs
        if input_dtype is not None or output_dtype is not None or o1:
            patch_forward(model, input_dtype, output_dtype)
        if properties.master_weights:  # NOTE: [Masters after a model reload]
            for module in model.modules():
                if module._parameters:
                    module.register_load_state_dict_pre_hook(note_load_hook)
                    module.register_load_state_dict_post_hook(refresh_after_load_hook)
        _initialized_models.add(model)
    if multi_rank_run():
        # NOTE: [Masters under DDP] DDP's constructor, after this, gives each rank rank 0's cast
        # weights (not its fp32 ones): masters from the cast weights then agree on every rank.
        fp32_originals.clear()
    for optimizer in optimizers:
        process_optimizer(inner_optimizer(optimizer), properties, fp32_originals, optimizer)
    fp32_originals.clear()
    if properties.master_weights and not optimizers:
        _warn_on_training_without_masters(models, properties.opt_level)
    if o1:
        _caster.enable(properties.low_precision_dtype)


def _is_optimizer(obj) -> bool:
    return isinstance(inner_optimizer(obj), torch.optim.Optimizer)


def _warn_on_training_without_masters(models, opt_level) -> None:
    """O2 without an optimizer: no fp32 master weights exist. Inference needs none, but a backward
    reaching the cast parameters means training on them: warn then, once."""
    params = [p for model in models for p in model.parameters()
              if p.requires_grad and p.dtype in LOW_DTYPES]
    handles = []

    def warn(param) -> None:
        if not handles:
            return
        for h in handles:
            h.remove()
        handles.clear()
        warnings.warn(
            f"amp.initialize(opt_level={opt_level!r}) was given no optimizer, so no fp32 master "
            f"weights exist, and a gradient just reached the model's {param.dtype} parameters: an "
            "optimizer built over them now steps low-precision weights directly (small updates "
            "round away). Pass the optimizer to amp.initialize: model, optimizer = "
            "amp.initialize(model, optimizer, opt_level=...).", UserWarning,
            stacklevel=user_stacklevel())  # the script's backward()
    handles.extend(p.register_post_accumulate_grad_hook(warn) for p in params)


def cast_model(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> dict:
    """Cast floating params (with their grads) and buffers to ``dtype`` in place, keeping their
    identity (docs/amp_api.md, "O2/O3 models"). Returns each cast parameter's fp32 data by
    ``id(param)``: the master weights start as the exact fp32 weights."""
    originals = {}
    with torch.no_grad():
        for module in model.modules():
            if keep_batchnorm_fp32 and isinstance(module, _BatchNorm):
                continue
            for p in module._parameters.values():
                if p is None or not p.is_floating_point() or p.dtype == dtype:
                    continue
                grad = p.grad
                p.grad = None
                if p.dtype == torch.float32:
                    originals[id(p)] = p.data
                p.data = p.data.to(dtype)
                if grad is not None:
                    p.grad = grad.to(dtype)
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    module._buffers[name] = b.to(dtype)
            if isinstance(module, nn.RNNBase):
                module.flatten_parameters()
    return originals


def _upcast_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """Upcast to fp32 (exactly): checkpoints load into fp32 models too (docs/amp_api.md)."""
    for name in itertools.chain(module._parameters, module._buffers):
        key = prefix + name
        t = state_dict.get(key)
        if (isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
                and t.dtype in LOW_DTYPES):
            state_dict[key] = t.float()


class _ForwardConfig(NamedTuple):
    input_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    inner_forward: object  # an instance-level forward that was already there, else None


def patch_forward(model, input_dtype, output_dtype) -> None:
    """Cast the forward's floating inputs to ``input_dtype`` and outputs to ``output_dtype`` (None:
    not cast); a method bound to the instance, so that ``copy.deepcopy(model)`` stays correct."""
    inner = model.__dict__.get("forward")
    model._amp_forward_config = _ForwardConfig(input_dtype, output_dtype, inner)
    model.forward = BoundMethod(_amp_forward, model)


@stands_in_for(lambda model: model._amp_forward_config.inner_forward  # (transformers' generate()
               or type(model).forward.__get__(model))  # passes position_ids only where named)
def _amp_forward(self, *args, **kwargs):
    cfg = self._amp_forward_config
    if cfg.input_dtype is not None:
        args, kwargs = cast_tree((args, kwargs), cfg.input_dtype)
    inner = cfg.inner_forward
    # (O1 casts thread-wide, so the forward needs no region of its own: a context manager here
    # would also keep torch.compile from splitting the forward at a graph break.)
    output = (inner(*args, **kwargs) if inner is not None
              else type(self).forward(self, *args, **kwargs))
    if cfg.output_dtype is not None:
        output = cast_tree(output, cfg.output_dtype)
    return output


def cast_tree(value, dtype):
    """Cast the floating tensors in ``value`` to ``dtype``, recursively (docs/amp_api.md, "O2/O3
    models"); objects with a ``.to`` win over the container rules, as in Apex."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if (value is None or isinstance(value, (str, bytes, nn.Module, int, float, bool))
            or type(value).__module__ == "numpy"):
        return value
    if hasattr(value, "to") and callable(value.to):
        return value.to(dtype)
    if isinstance(value, Mapping):
        items = [(k, cast_tree(v, dtype)) for k, v in value.items()]
        try:
            return type(value)(items)
        except TypeError:
            return dict(items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(cast_tree(v, dtype) for v in value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(cast_tree(v, dtype) for v in value)
    return value
