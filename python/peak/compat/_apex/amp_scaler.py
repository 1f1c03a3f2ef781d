"""``apex.amp.scaler`` under peak's Apex alias: Apex's ``FP16_Optimizer.state_dict()`` pickles its
``apex.amp.scaler.LossScaler`` object into checkpoints, so ``torch.load`` needs this name."""
from peak.amp import LossScaler as _LossScaler

__all__ = ["LossScaler"]


class LossScaler(_LossScaler):
    """peak's amp ``LossScaler``, which an Apex checkpoint's pickled LossScaler (Apex's attributes:
    ``_loss_scale``, ``_unskipped``, ``dynamic``, ``_scale_seq_len``, ``_min_loss_scale``,
    ``_max_loss_scale``) unpickles into: its scale and the steps since its last change."""

    def __setstate__(self, state: dict) -> None:
        if "_core" in state:  # (one of peak's own)
            self.__dict__.update(state)
            return
        dynamic = state.get("dynamic", True)
        self.__init__("dynamic" if dynamic else state["_loss_scale"],
                      init_scale=state["_loss_scale"],
                      scale_window=state.get("_scale_seq_len", 2000),
                      min_loss_scale=state.get("_min_loss_scale"),
                      max_loss_scale=state.get("_max_loss_scale", 2.0 ** 24))
        self.growth_tracker.fill_(int(state.get("_unskipped", 0)))
