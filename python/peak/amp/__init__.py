"""peak.amp -- mixed-precision training.

The Apex dialect (a drop-in for ``from apex import amp``)::

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

See docs/amp_api.md (the design), docs/caster.md (O1), docs/torch_dialect.md (torch's dialect)."""

from ._amp_state import _amp_state, master_params
from .frontend import Properties, init, initialize, load_state_dict, opt_levels, state_dict
from .handle import AmpHandle, LossScaler, NoOpHandle, disable_casts, scale_loss
from . import lists
from .lists import (float_function, half_function, promote_function, register_float_function,
                    register_half_function, register_promote_function)
from .autocast_mode import autocast, custom_bwd, custom_fwd
from torch.amp import is_autocast_available  # torch.amp's, so `import peak.amp as amp` has it too
from .grad_scaler import GradScaler, OptState, OverflowReport

__all__ = ["initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
           "disable_casts", "init", "LossScaler", "lists", "half_function", "float_function",
           "promote_function", "register_half_function", "register_float_function",
           "register_promote_function", "GradScaler", "OverflowReport", "autocast", "custom_fwd",
           "custom_bwd", "is_autocast_available"]
