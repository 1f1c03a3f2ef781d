"""``apex.optimizers`` under peak's Apex alias: peak's fused optimizers with Apex's constructor
signatures and defaults where peak's own differ (FusedAdam: Apex's argument order and
``adam_w_mode=True``; FusedSGD: ``set_grad_none=False``)."""
from peak import optimizers as _peak
from peak.optimizers import (FusedAdagrad, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad,
                             FusedOptimizer)

__all__ = ["FusedAdam", "FusedSGD", "FusedLAMB", "FusedNovoGrad", "FusedAdagrad",
           "FusedMixedPrecisionLamb"]


class FusedAdam(_peak.FusedAdam):
    """Apex's FusedAdam signature: ``(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-8, adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
    capturable=False, master_weights=False)``. fp16/bf16 parameters always get fp32 master
    weights in peak (Apex's ``master_weights=False`` stepped them in their own precision)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
                 capturable=False, master_weights=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, adam_w_mode=adam_w_mode,
                         bias_correction=bias_correction, set_grad_none=set_grad_none,
                         master_weights=True if master_weights else None, capturable=capturable)

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None,
             **kwargs):
        """Apex's signature: its pre-2019 arguments refused, as Apex refuses them; its
        ``grad_scaler`` (read with ``capturable=True``) refused with what works instead (not a
        named parameter: torch's GradScaler would pass itself instead of handing over its scale)."""
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam.step() takes no grads, output_params, scale or "
                               "grad_norms (Apex's pre-2019 interface): build FusedAdam as "
                               "torch.optim.Adam and call step() without them")
        if "grad_scaler" in kwargs:
            raise TypeError("FusedAdam.step(grad_scaler=...): call scaler.step(optimizer), which "
                            "hands the scale and the overflow flag to the fused step")
        # (the base class's own step: a FusedAdam built elsewhere gets its step wrapped by
        # torch's hook machinery, and going through that wrapper ran every step hook twice)
        return FusedOptimizer.step(self, closure, **kwargs)


class FusedSGD(_peak.FusedSGD):
    """Apex's FusedSGD: peak's, with Apex's default ``set_grad_none=False``."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=False, **kwargs):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov,
                         wd_after_momentum, materialize_master_grads, set_grad_none, **kwargs)
