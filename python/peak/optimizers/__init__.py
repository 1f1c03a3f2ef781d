"""Fused master-weight optimizers: one pass from low-precision gradients to fp32 master weights
and moments to low-precision model weights, on CPU and CUDA.

    opt = peak.optimizers.FusedAdamW(model.parameters(), lr=1e-3)

Used alone they are ordinary torch optimizers (fp32 models: no masters; fp16/bf16 parameters:
fp32 masters in ``optimizer.state[p]["master_param"]``, saved by ``state_dict()``). With
``peak.amp.GradScaler`` or ``amp.initialize(..., opt_level="O2")`` the unscale and the overflow
skip happen inside the step. ``LARC`` wraps any optimizer (Apex's ``apex.parallel.LARC``).

Lean state (bf16 models): ``store_param_remainders=True`` keeps each master as the 16 bits the
bf16 weight drops, and ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (SGD: ``momentum_dtype``) may be
``torch.bfloat16`` (10 bytes per parameter instead of 16) or ``torch.uint8`` (8-bit
block-quantized: ~8.03 bytes); ``memory_report(model, optimizer)`` shows where they go. See "Lean
optimizer state" in docs/core.md.
"""
from ._base import FusedOptimizer
from ._export import export_fp32_optimizer_state_dict, export_fp32_state_dict
from ._memory import MemoryReport, memory_report
from .fused import (FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB, FusedMixedPrecisionLamb,
                    FusedNovoGrad, FusedSGD)
from .larc import LARC
from .masters import MasterWeights, join_remainder, split_master

__all__ = ["FusedSGD", "FusedAdam", "FusedAdamW", "FusedLAMB", "FusedMixedPrecisionLamb",
           "FusedAdagrad", "FusedNovoGrad", "LARC", "FusedOptimizer", "export_fp32_state_dict",
           "export_fp32_optimizer_state_dict", "memory_report", "MemoryReport", "join_remainder",
           "split_master", "MasterWeights"]
