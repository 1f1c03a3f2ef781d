"""Apex-era mixed-precision utilities kept for old scripts (``from apex.fp16_utils import ...``
-> ``from peak.fp16_utils import ...``): the deprecated ``FP16_Optimizer`` wrapper and the manual
helpers (``FP16Model``, ``network_to_half``, ``prep_param_lists``, ...)."""
from .fp16_optimizer import FP16_Optimizer
from .fp16util import (BN_convert_float, FP16Model, clip_grad_norm, convert_module,
                       convert_network, master_params_to_model_params, model_grads_to_master_grads,
                       network_to_half, prep_param_lists, to_python_float, tofp16)

__all__ = ["FP16_Optimizer", "FP16Model", "network_to_half", "convert_network", "convert_module",
           "BN_convert_float", "tofp16", "prep_param_lists", "model_grads_to_master_grads",
           "master_params_to_model_params", "clip_grad_norm", "to_python_float"]
