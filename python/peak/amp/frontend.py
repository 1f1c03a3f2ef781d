"""``amp.initialize``, the legacy ``amp.init`` and ``amp.state_dict`` / ``amp.load_state_dict``;
Apex's opt_levels and the ``Properties`` they set (tables, override order, messages and verbosity
output are Apex's; peak's additions are in docs/amp_api.md, "Low-precision dtype")."""

from __future__ import annotations

import math
import numbers
import warnings
from collections import OrderedDict
from collections.abc import Mapping

import torch

from .. import _dtypes, scaling
from . import _caster, _initialize
from ._amp_state import LOW_DTYPES, _amp_state, maybe_print, warn_or_err
from .handle import AmpHandle, LossScaler, NoOpHandle


def _parse_bool(name: str, value):
    """Booleans, or the strings "True"/"False" (argparse-style scripts pass those)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    kind = ValueError if isinstance(value, str) else TypeError
    raise (_BadKeepBatchnorm if name == "keep_batchnorm_fp32" else kind)(
        f"{name} must be True, False, the string 'True' or 'False', or None; found "
        f"{name}={value!r}")


class _BadKeepBatchnorm(TypeError, ValueError, AssertionError):
    """A bad keep_batchnorm_fp32: Apex's check is a plain assert (AssertionError there)."""


class Properties:
    """An amp run's options; assigning one validates it against ``opt_level`` (Apex's checks)."""

    def __init__(self) -> None:
        self.__dict__["options"] = OrderedDict(
            enabled=False, opt_level=None, cast_model_type=None, patch_torch_functions=False,
            keep_batchnorm_fp32=None, master_weights=None, loss_scale=1.0)
        # peak: the low-precision dtype this run uses (fp16/bf16), or None for fp32 training.
        self.__dict__["low_precision_dtype"] = None

    def __getattr__(self, name):
        options = self.__dict__["options"]
        if name in options:
            return options[name]
        raise AttributeError(f"'Properties' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        options = self.__dict__["options"]
        if name not in options:
            if name == "low_precision_dtype":
                self.__dict__[name] = value
                return
            raise AttributeError(f"'Properties' has no option '{name}'; valid options are: "
                                 f"{', '.join(options)}")
        o1 = options["opt_level"] == "O1"
        if name == "cast_model_type":
            if not (value is None or value is False
                    or (isinstance(value, torch.dtype) and value.is_floating_point)):
                raise TypeError("cast_model_type must be a floating torch.dtype (torch.float16, "
                                "torch.bfloat16, torch.float32), False (do not cast the model) "
                                f"or None; found cast_model_type={value!r}")
            if o1 and value not in (None, False, torch.float32):
                warn_or_err(
                    "O1 inserts casts around Torch functions rather than model weights, so with "
                    "O1, the model weights themselves should remain FP32. If you wish to cast the "
                    f"model to a different type, use opt_level='O2' or 'O3'. cast_model_type was "
                    f"{value}" + (" (to run O1 in bfloat16, pass low_precision_dtype="
                                  "torch.bfloat16 instead)" if value == torch.bfloat16 else ""))
        elif name == "patch_torch_functions":
            value = _parse_bool(name, value)
            if not o1 and value:
                warn_or_err("Currently, patch_torch_functions=True should only be set by "
                            "selecting opt_level='O1'.")
        elif name in ("keep_batchnorm_fp32", "master_weights"):
            if o1 and value is not None:
                warn_or_err("With opt_level O1, batchnorm functions are automatically patched to "
                            "run in FP32, so keep_batchnorm_fp32 should be None. "
                            f"keep_batchnorm_fp32 was {value}" if name == "keep_batchnorm_fp32"
                            else "It doesn't make sense to use master_weights with O1. With O1, "
                            "your model weights themselves should be FP32.")
            value = _parse_bool(name, value)
        elif name == "loss_scale":
            value = parse_loss_scale(value)
        options[name] = value


def parse_loss_scale(value):
    if value == "dynamic":
        return value
    if isinstance(value, bool):
        raise ValueError(f"loss_scale must be a number or 'dynamic', not a bool; found "
                         f"loss_scale={value!r}")
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError("loss_scale must be a number, a numeric string such as '128.0', or "
                         f"'dynamic'; found loss_scale={value!r}") from None
    return scaling.check_scale("loss_scale (a number or 'dynamic')", scale)


class OptLevel:
    """An opt_level (Apex's O0..O3): ``level(properties)`` sets its defaults, in order."""

    def __init__(self, brief: str, **settings) -> None:
        self.brief = brief
        self.settings = settings

    def __call__(self, properties):
        properties.enabled = True
        for name, value in self.settings.items():
            setattr(properties, name, value)
        return properties


O3 = OptLevel("O3:  Pure FP16 training.", opt_level="O3", cast_model_type=torch.float16,
              patch_torch_functions=False, keep_batchnorm_fp32=False, master_weights=False,
              loss_scale=1.0)
O2 = OptLevel("O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n",
              opt_level="O2", cast_model_type=torch.float16, patch_torch_functions=False,
              keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic")
O1 = OptLevel("O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
              opt_level="O1", cast_model_type=None, patch_torch_functions=True,
              keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic")
O0 = OptLevel("O0:  Pure FP32 training.\n", opt_level="O0", cast_model_type=torch.float32,
              patch_torch_functions=False, keep_batchnorm_fp32=None, master_weights=False,
              loss_scale=1.0)
opt_levels = {"O3": O3, "O2": O2, "O1": O1, "O0": O0}


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
    low = torch.finfo(torch.float32).tiny if name == "max_loss_scale" else 0.0  # (1/scale finite)
    if math.isnan(v) or v < low:
        raise ValueError(f"{name} must be >= {low:.3g} (or None); found {name}={value!r}")
    return v


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
               min_loss_scale=None, max_loss_scale=2.0**24, *, low_precision_dtype=None):
    """Initialize models, optimizers and the amp state for the chosen ``opt_level`` and overrides:
    Apex's ``apex.amp.initialize`` with the same arguments, defaults and return shape (``models``:
    a module or a list of them; ``optimizers``: an optimizer, a list of them or None; the same
    objects come back, mutated in place, as ``model`` / ``(model, optimizer)``).

    peak additions (docs/amp_api.md, "Low-precision dtype"): ``low_precision_dtype`` (keyword
    only, ``torch.bfloat16`` or ``"bf16"``, default fp16), the run's lower precision at any
    opt_level (bf16: loss scale 1.0 unless ``loss_scale`` is passed); dtype strings; CPU models."""
    if isinstance(enabled, str):  # "False" is truthy: parsed, as every boolean option is
        enabled = _parse_bool("enabled", enabled)
    if enabled and not isinstance(verbosity, (numbers.Real, torch.Tensor)):
        raise TypeError(f"verbosity must be a number (0: silent, 1: amp's messages); got "
                        f"verbosity={verbosity!r}")  # (compared with 0, as Apex does)
    _amp_state.verbosity = verbosity
    if not enabled:
        _reset_global_state()
        _amp_state.opt_properties = Properties()
        return models if optimizers is None else (models, optimizers)
    if opt_level not in opt_levels:
        raise RuntimeError(f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', "
                           "'O2', 'O3'.  Note that in `O0`, `O1`, etc., the prefix O is the letter "
                           "O, not the number zero.")
    # Strings ("bf16", "fp16", "float32", ...) are read by the one parser every dtype argument uses.
    low_precision_dtype = _dtypes.parse_dtype(low_precision_dtype, "low_precision_dtype")
    cast_model_type, cast_model_outputs = (
        _dtypes.parse_dtype(value, name, _dtypes.FLOATING) if isinstance(value, str) else value
        for value, name in ((cast_model_type, "cast_model_type"),
                            (cast_model_outputs, "cast_model_outputs")))
    if not isinstance(num_losses, int) or isinstance(num_losses, bool) or num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1 (one loss scaler per loss); found "
                         f"num_losses={num_losses!r}")
    if cast_model_outputs is not None and not (
            isinstance(cast_model_outputs, torch.dtype) and cast_model_outputs.is_floating_point):
        raise TypeError("cast_model_outputs must be a floating torch.dtype (e.g. torch.float32) or "
                        f"None; found cast_model_outputs={cast_model_outputs!r}")
    min_scale = _check_loss_scale_bound("min_loss_scale", min_loss_scale)
    max_scale = _check_loss_scale_bound("max_loss_scale", max_loss_scale)
    if min_scale and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"min_loss_scale ({min_loss_scale}) must not exceed max_loss_scale "
                         f"({max_loss_scale})")
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
        maybe_print("{:22} : {}".format("low_precision_dtype", properties.low_precision_dtype),
                    True)
    # Validate the models and optimizers completely before changing anything.
    models_list, optimizers_list = _initialize.check_inputs(models, optimizers)
    _initialize.check_sharded_optimizers(optimizers_list, properties, models_list)
    previous, generation = getattr(_amp_state, "opt_properties", None), _amp_state.generation
    _reset_global_state()
    if previous is not None and vars(previous) == vars(properties):  # (docs/advanced.md)
        _amp_state.generation = generation  # the same options: earlier objects train on (Apex)
    _amp_state.opt_properties = properties
    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale
    device = _initialize.first_device(models_list)
    _amp_state.loss_scalers = [LossScaler(properties.loss_scale, min_loss_scale=min_scale,
                                          max_loss_scale=max_scale, device=device)
                               for _ in range(num_losses)]
    _initialize.process(models_list, optimizers_list, properties, cast_model_outputs)
    if properties.patch_torch_functions:
        _amp_state.handle = AmpHandle()
    _dtypes.warn_if_slow_fp16(properties.low_precision_dtype, device.type,
                              fix='low_precision_dtype=torch.bfloat16 (or "bf16")')
    return models if optimizers is None else (models, optimizers)


def _apply_low_precision_dtype(properties, low_precision_dtype, cast_model_type, loss_scale):
    """Decide the run's low-precision dtype and, for bf16, the default loss scale."""
    cmt = properties.cast_model_type
    if low_precision_dtype is not None and cmt in LOW_DTYPES:
        if cast_model_type is not None and cast_model_type != low_precision_dtype:
            raise ValueError(f"cast_model_type={cast_model_type} and low_precision_dtype="
                             f"{low_precision_dtype} disagree; pass only one of them")
        properties.cast_model_type = cmt = low_precision_dtype
    low = cmt if cmt in LOW_DTYPES else (  # O1 casts to the run's dtype, fp16 by default
        (low_precision_dtype or torch.float16) if properties.patch_torch_functions else None)
    properties.low_precision_dtype = low
    if low == torch.bfloat16 and loss_scale is None and properties.loss_scale == "dynamic":
        properties.loss_scale = 1.0


def _reset_global_state() -> None:
    _caster.disable()
    _amp_state.reset()


def init(enabled=True, loss_scale="dynamic", enable_caching=True, verbose=False,
         allow_banned=False):
    """Deprecated pre-1.0 entry point: sets up O1 (dynamic loss scaling unless ``loss_scale`` is
    a number) and returns a handle whose ``scale_loss(loss, optimizer)`` works.  Use
    ``amp.initialize`` instead."""
    warnings.warn("amp.init() is deprecated: replace `amp_handle = amp.init()` with "
        "`model, optimizer = amp.initialize(model, optimizer, opt_level='O1')` and "
        "`amp_handle.scale_loss(loss, optimizer)` with `amp.scale_loss(loss, optimizer)`.",
        DeprecationWarning, stacklevel=2)
    if not (_parse_bool("enabled", enabled) if isinstance(enabled, str) else enabled):
        return NoOpHandle()
    properties = O1(Properties())
    properties.loss_scale = loss_scale
    properties.low_precision_dtype = torch.float16
    _reset_global_state()  # what initialize does first, too
    _amp_state.verbosity = 2 if verbose else 1
    _amp_state.opt_properties = properties
    _amp_state.loss_scalers = [LossScaler(properties.loss_scale)]
    _caster.enable(torch.float16, allow_banned=allow_banned)
    handle = _amp_state.handle = AmpHandle(legacy=True)
    return handle


def state_dict(destination=None):
    """Each loss scaler's state: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}}``."""
    _require_initialized("amp.state_dict()")
    destination = OrderedDict() if destination is None else destination
    for idx, scaler in enumerate(_amp_state.loss_scalers):
        destination["loss_scaler%d" % idx] = scaler.state_dict()
    return destination


def load_state_dict(state_dict):
    """``amp.state_dict()``'s entries, by position as Apex's, checked first (docs/amp_api.md)."""
    _require_initialized("amp.load_state_dict()")
    if not _amp_state.enabled:
        return
    if not isinstance(state_dict, Mapping):
        raise TypeError("amp.load_state_dict takes the dict amp.state_dict() returned, got "
                        f"{type(state_dict).__name__}; nothing was loaded")
    scalers, items = _amp_state.loss_scalers, list(state_dict.items())
    if unexpected := [k for k, _ in items if "loss_scaler" not in k]:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: {}. "
                           .format(", ".join('"{}"'.format(k) for k in unexpected)))
    if bad := [f"{k}={e!r}" for k, e in items if not _is_scaler_state(e)]:
        raise RuntimeError(f"amp.load_state_dict: {bad} are not loss scaler states "
                           "({'loss_scale': a finite float >= 2**-127, 'unskipped': an int >= "
                           "0}); nothing was loaded")
    if len(items) != len(scalers) and _amp_state.verbosity > 0:
        warnings.warn(f"amp.load_state_dict: {len(items)} saved loss scalers, {len(scalers)} in "
                      "use (num_losses): the first ones load by position, the rest are left",
                      stacklevel=2)
    for scaler, (_, entry) in zip(scalers, items):
        scaler.load_state_dict(entry)


def _is_scaler_state(entry) -> bool:
    if not isinstance(entry, dict) or {"loss_scale", "unskipped"} - {*entry}:
        return False
    scale, unskipped = entry["loss_scale"], entry["unskipped"]
    return (isinstance(scale, (int, float)) and not isinstance(scale, bool)
            and math.isfinite(scale) and scale >= scaling.SMALLEST_SCALE  # (1/scale finite)
            and isinstance(unskipped, int) and not isinstance(unskipped, bool) and unskipped >= 0)


def _require_initialized(what: str) -> None:
    if not _amp_state.initialized:
        raise RuntimeError(f"{what} was called before amp.initialize(); call model, optimizer = "
                           "amp.initialize(model, optimizer, opt_level=...) first.")
