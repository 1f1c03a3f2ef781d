"""``amp.initialize`` and ``amp.state_dict`` / ``amp.load_state_dict``: opt_levels, properties, overrides.

The property tables, override order, messages and verbosity output are Apex's (see
``docs/amp_api.md``).  peak's additions: bf16 as a first-class low-precision dtype
(``cast_model_type=torch.bfloat16`` for O2/O3, the keyword-only ``low_precision_dtype`` for any level),
"True"/"False" strings for every boolean property, and validation of value types.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from .. import _dtypes
from . import _caster, _initialize
from ._amp_state import _amp_state, maybe_print, warn_or_err
from .loss_scaler import LossScaler
# The opt_level tables live in _options (the legacy amp.init uses them too); re-exported here,
# where Apex scripts and peak.integrations find them.
from ._options import (LOW_DTYPES, O0, O1, O2, O3, Properties,  # noqa: F401
                       opt_levels, parse_loss_scale)


def _print_options(properties) -> None:
    for k, v in properties.options.items():
        maybe_print("{:22} : {}".format(k, v), True)


def _check_loss_scale_bound(name, value):
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number or None; found {name}={value!r}") from None
    if math.isnan(v) or v < 0:
        raise ValueError(f"{name} must be >= 0 (or None); found {name}={value!r}")
    return v


def initialize(
    models,
    optimizers=None,
    enabled=True,
    opt_level="O1",
    cast_model_type=None,
    patch_torch_functions=None,
    keep_batchnorm_fp32=None,
    master_weights=None,
    loss_scale=None,
    cast_model_outputs=None,
    num_losses=1,
    verbosity=1,
    min_loss_scale=None,
    max_loss_scale=2.0**24,
    *,
    low_precision_dtype=None,
):
    """Initialize models, optimizers and the amp state for the chosen ``opt_level`` and overrides.

    Apex's ``apex.amp.initialize`` with the same arguments, defaults and return shape: ``models`` is a
    module or a list of modules, ``optimizers`` an optimizer, a list of optimizers or None; the same
    objects come back (mutated in place), as ``model`` / ``(model, optimizer)`` in the shape passed in.

    peak additions:

    * ``cast_model_type=torch.bfloat16`` (O2/O3) casts the model to bf16 instead of fp16.
    * Every dtype argument also takes the strings of ``peak._dtypes.DTYPE_NAMES`` (``"bf16"``,
      ``"fp16"``, ``"fp32"``, ...).
    * ``low_precision_dtype`` (keyword only; ``torch.float16`` or ``torch.bfloat16``, or a string:
      ``"fp16"``, ``"float16"``, ``"half"``, ``"bf16"``, ``"bfloat16"``): the lower
      precision of the run at any opt_level -- O1's casts, O2/O3's model type (unless
      ``cast_model_type`` says otherwise); O0 ignores it.  Default: fp16, as Apex.
    * With bf16 the levels that default to dynamic loss scaling (O1, O2) default to a static scale of
      1.0 instead (bf16 has fp32's range); pass ``loss_scale="dynamic"`` to scale anyway.
    * CPU models are accepted (Apex required CUDA).
    """

    _amp_state.verbosity = verbosity

    if not enabled:
        _reset_global_state()
        _amp_state.opt_properties = Properties()
        if optimizers is None:
            return models
        return models, optimizers

    if opt_level not in opt_levels:
        raise RuntimeError(
            "Unexpected optimization level {}. ".format(opt_level)
            + "Options are 'O0', 'O1', 'O2', 'O3'.  Note that in `O0`, `O1`, etc., the prefix O is the letter O, "
            "not the number zero.")
    # Strings ("bf16", "fp16", "float32", ...) are read by the one parser every dtype argument uses.
    low_precision_dtype = _dtypes.parse_dtype(low_precision_dtype, "low_precision_dtype")
    if isinstance(cast_model_type, str):
        cast_model_type = _dtypes.parse_dtype(cast_model_type, "cast_model_type", _dtypes.FLOATING)
    if isinstance(cast_model_outputs, str):
        cast_model_outputs = _dtypes.parse_dtype(cast_model_outputs, "cast_model_outputs", _dtypes.FLOATING)
    if not isinstance(num_losses, int) or isinstance(num_losses, bool) or num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1 (one loss scaler per loss); found num_losses={num_losses!r}")
    if cast_model_outputs is not None and not (
            isinstance(cast_model_outputs, torch.dtype) and cast_model_outputs.is_floating_point):
        raise TypeError(
            "cast_model_outputs must be a floating torch.dtype (e.g. torch.float32) or None; "
            f"found cast_model_outputs={cast_model_outputs!r}")
    min_scale = _check_loss_scale_bound("min_loss_scale", min_loss_scale)
    max_scale = _check_loss_scale_bound("max_loss_scale", max_loss_scale)
    if min_scale and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"min_loss_scale ({min_loss_scale}) must not exceed max_loss_scale ({max_loss_scale})")

    properties = opt_levels[opt_level](Properties())
    maybe_print("Selected optimization level {}".format(opt_levels[opt_level].brief), True)
    maybe_print("Defaults for this optimization level are:", True)
    _print_options(properties)

    maybe_print("Processing user overrides (additional kwargs that are not None)...", True)
    properties.enabled = enabled
    properties.opt_level = opt_level
    overrides = dict(cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
                     keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
                     loss_scale=loss_scale)
    for name, value in overrides.items():  # in Apex's order: each is checked on assignment
        if value is not None:
            setattr(properties, name, value)
    _apply_low_precision_dtype(properties, low_precision_dtype, cast_model_type, loss_scale)
    maybe_print("After processing overrides, optimization options are:", True)
    _print_options(properties)
    if low_precision_dtype is not None:
        maybe_print("{:22} : {}".format("low_precision_dtype", properties.low_precision_dtype), True)

    # Validate the models and optimizers completely before changing anything.
    models_list, optimizers_list = _initialize.check_inputs(models, optimizers)
    _initialize.check_sharded_optimizers(optimizers_list, properties)

    _reset_global_state()
    _amp_state.opt_properties = properties
    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale
    device = _initialize.first_device(models_list)
    _amp_state.loss_scalers = [
        LossScaler(properties.loss_scale, min_loss_scale=min_scale, max_loss_scale=max_scale, device=device)
        for _ in range(num_losses)
    ]
    _initialize.process(models_list, optimizers_list, properties, cast_model_outputs)
    _dtypes.warn_if_slow_fp16(properties.low_precision_dtype, device.type,
                              fix='low_precision_dtype=torch.bfloat16 (or "bf16")')

    if optimizers is None:
        return models
    return models, optimizers


def _apply_low_precision_dtype(properties, low_precision_dtype, cast_model_type, loss_scale) -> None:
    """Decide the run's low-precision dtype and, for bf16, the default loss scale."""
    cmt = properties.cast_model_type
    if low_precision_dtype is not None and cmt in LOW_DTYPES:
        if cast_model_type is not None and cast_model_type != low_precision_dtype:
            raise ValueError(
                f"cast_model_type={cast_model_type} and low_precision_dtype={low_precision_dtype} disagree; "
                "pass only one of them")
        properties.cast_model_type = cmt = low_precision_dtype
    if cmt in LOW_DTYPES:
        low = cmt
    elif properties.patch_torch_functions:
        low = low_precision_dtype or torch.float16
    else:
        low = None
    properties.low_precision_dtype = low
    if low == torch.bfloat16 and loss_scale is None and properties.loss_scale == "dynamic":
        properties.loss_scale = 1.0


def _reset_global_state() -> None:
    _caster.disable()
    _amp_state.reset()


def state_dict(destination=None):
    """Every loss scaler's state: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``."""
    _require_initialized("amp.state_dict()")
    if destination is None:
        destination = OrderedDict()
    for idx, scaler in enumerate(_amp_state.loss_scalers):
        destination["loss_scaler%d" % idx] = scaler.state_dict()
    return destination


def load_state_dict(state_dict):
    """Restore what ``amp.state_dict()`` saved (Apex semantics: entries are matched by position)."""
    _require_initialized("amp.load_state_dict()")
    if not _amp_state.enabled:
        return
    scalers = _amp_state.loss_scalers
    if len(state_dict) != len(scalers):
        print("Warning: state_dict contains {} entries, while {} loss_scalers are used".format(
            len(state_dict), len(scalers)))
    state_dict = state_dict.copy()
    unexpected_keys = []
    idx = 0
    for key in state_dict:
        if "loss_scaler" not in key:
            unexpected_keys.append(key)
        else:
            if idx > len(scalers) - 1:
                print("Skipping loss_scaler[{}], since num_losses was set to {}".format(idx, len(scalers)))
                break
            scalers[idx].load_state_dict(state_dict[key])
            idx += 1
    if unexpected_keys:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: {}. ".format(
            ", ".join('"{}"'.format(k) for k in unexpected_keys)))


def _require_initialized(what: str) -> None:
    if not _amp_state.initialized:
        raise RuntimeError(
            f"{what} was called before amp.initialize(); call "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) first.")
