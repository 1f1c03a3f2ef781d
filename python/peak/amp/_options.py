"""Apex's opt_levels and the ``Properties`` they set: the option tables, their validation and
messages (see ``docs/amp_api.md``). ``amp.initialize`` (frontend.py) and the legacy ``amp.init``
(handle.py) both start from here, so neither has to import the other."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ._amp_state import warn_or_err


LOW_DTYPES = (torch.float16, torch.bfloat16)
_OPTION_NAMES = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions",
                 "keep_batchnorm_fp32", "master_weights", "loss_scale")


def _parse_bool(name: str, value):
    """Booleans, or the strings "True"/"False" (argparse-style scripts pass those)."""
    if isinstance(value, str):
        if value in ("True", "False"):
            return value == "True"
        raise ValueError(f"{name} must be True, False, the string 'True' or 'False', or None; found {name}={value!r}")
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be True, False, the string 'True' or 'False', or None; found {name}={value!r}")


class Properties:
    """The options that govern an amp run.  Assigning an option validates it against the current
    ``opt_level`` (Apex's checks and messages)."""

    def __init__(self) -> None:
        self.__dict__["options"] = OrderedDict(
            enabled=False, opt_level=None, cast_model_type=None, patch_torch_functions=False,
            keep_batchnorm_fp32=None, master_weights=None, loss_scale=1.0,
        )
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
            raise AttributeError(
                f"'Properties' has no option '{name}'; valid options are: {', '.join(_OPTION_NAMES)}")
        opt_level = options["opt_level"]
        if name == "cast_model_type":
            if not (value is None or value is False or (isinstance(value, torch.dtype) and value.is_floating_point)):
                raise TypeError(
                    "cast_model_type must be a floating torch.dtype (torch.float16, torch.bfloat16, torch.float32), "
                    f"False (do not cast the model) or None; found cast_model_type={value!r}")
            if opt_level == "O1" and value not in (None, False, torch.float32):
                warn_or_err(
                    "O1 inserts casts around Torch functions rather than model weights, so with O1, the model "
                    "weights themselves should remain FP32. If you wish to cast the model to a different type, "
                    f"use opt_level='O2' or 'O3'. cast_model_type was {value}"
                    + (" (to run O1 in bfloat16, pass low_precision_dtype=torch.bfloat16 instead)"
                       if value == torch.bfloat16 else ""))
        elif name == "patch_torch_functions":
            value = _parse_bool(name, value)
            if opt_level != "O1" and value:
                warn_or_err("Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'.")
        elif name == "keep_batchnorm_fp32":
            if opt_level == "O1" and value is not None:
                warn_or_err(
                    "With opt_level O1, batchnorm functions are automatically patched to run in FP32, so "
                    f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value}")
            value = _parse_bool(name, value)
        elif name == "master_weights":
            if opt_level == "O1" and value is not None:
                warn_or_err(
                    "It doesn't make sense to use master_weights with O1. With O1, your model weights themselves "
                    "should be FP32.")
            value = _parse_bool(name, value)
        elif name == "loss_scale":
            value = parse_loss_scale(value)
        options[name] = value


def parse_loss_scale(value):
    if value == "dynamic":
        return value
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"loss_scale must be a number, a numeric string such as '128.0', or 'dynamic'; found loss_scale={value!r}"
        ) from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"loss_scale must be a finite number > 0 (or 'dynamic'); found loss_scale={value!r}")
    return scale


class _OptLevel:
    """An opt_level (Apex's O0..O3 classes): ``level(properties)`` sets its defaults, in order."""

    brief = ""
    settings: dict = {}

    def __call__(self, properties):
        properties.enabled = True
        for name, value in self.settings.items():
            setattr(properties, name, value)
        return properties


class O3(_OptLevel):
    brief = "O3:  Pure FP16 training."
    settings = dict(opt_level="O3", cast_model_type=torch.float16, patch_torch_functions=False,
                    keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0)


class O2(_OptLevel):
    brief = "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n"
    settings = dict(opt_level="O2", cast_model_type=torch.float16, patch_torch_functions=False,
                    keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic")


class O1(_OptLevel):
    brief = "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n"
    settings = dict(opt_level="O1", cast_model_type=None, patch_torch_functions=True,
                    keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic")


class O0(_OptLevel):
    brief = "O0:  Pure FP32 training.\n"
    settings = dict(opt_level="O0", cast_model_type=torch.float32, patch_torch_functions=False,
                    keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0)


opt_levels = {"O3": O3(), "O2": O2(), "O1": O1(), "O0": O0()}
