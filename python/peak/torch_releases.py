"""What differs between the torch releases peak supports (2.10 to 2.15), kept per release where
it cannot be asked of the installed torch: the autocast op lists' changes against 2.13's
(``peak.amp.autocast_mode`` documents 2.13's lists and undoes these on other releases)."""
from __future__ import annotations

import torch

from ._extension import major_minor

__all__ = ["TORCH_AUTOCAST_LIST_CHANGES", "autocast_list_changes", "cuda_lists_as_of_2_13"]

#: How other supported torch releases differ from the 2.13 lists (read off their dispatchers;
#: tests/torch_dialect checks it): ops added to / removed from each device's autocast set. A
#: release not recorded here (a newer one) gets its own dispatcher's lists as they are.
# 2.10 to 2.12 still register the named-dimension overloads (2.13 dropped their kernels); CUDA's
# rms_norm is autocast from 2.12 on.
_NAMED_DIMS_CPU = {"added": ("index_copy.dimname", "prod.dim_Dimname"), "removed": ()}
_NAMED_DIMS_CUDA = ("_cudnn_rnn", "cumprod.dimname", "cumsum.dimname", "log_softmax.Dimname",
                    "norm.names_ScalarOpt_dim", "prod.dim_Dimname", "softmax.Dimname",
                    "sum.dim_DimnameList")
_NAMED_DIMS_NO_RMS_NORM = {"cpu": _NAMED_DIMS_CPU,
                           "cuda": {"added": _NAMED_DIMS_CUDA, "removed": ("rms_norm",)}}
_MATRIX_SQRTH = {  # 2.14 and 2.15
    "cpu": {"added": ("linalg_matrix_sqrth",), "removed": ("cholesky", "qr")},
    "cuda": {"added": ("_cudnn_rnn", "linalg_matrix_sqrth"), "removed": ()},
}
# (`_cudnn_rnn` has an AutocastCUDA kernel in torch's CUDA builds only; the 2.13 lists were read
# off its CPU build.)
# The 2.13 policy of the CUDA ops that a recorded release lacks (to put them back).
_CUDA_POLICY_2_13 = {"rms_norm": "fp32"}
TORCH_AUTOCAST_LIST_CHANGES = {
    (2, 10): _NAMED_DIMS_NO_RMS_NORM,
    (2, 11): _NAMED_DIMS_NO_RMS_NORM,
    (2, 12): {"cpu": _NAMED_DIMS_CPU, "cuda": {"added": _NAMED_DIMS_CUDA, "removed": ()}},
    (2, 14): _MATRIX_SQRTH,
    (2, 15): _MATRIX_SQRTH,
}


def autocast_list_changes(version: str | None = None, device: str = "cpu") -> dict | None:
    """The recorded changes of torch ``version`` (default: the installed one) against 2.13's
    lists for ``device`` ("cpu" or "cuda"): ``{"added": ..., "removed": ...}``; empty for 2.13
    itself, None for a release with no record."""
    key = major_minor(version or torch.__version__)
    if key == (2, 13):
        return {"added": (), "removed": ()}
    entry = TORCH_AUTOCAST_LIST_CHANGES.get(key)
    return None if entry is None else entry[device]


def cuda_lists_as_of_2_13(lists: dict) -> dict:
    """The installed release's CUDA autocast lists (``{policy: ops}``) with its recorded changes
    undone: what torch 2.13 listed. Unchanged for 2.13 and for a release with no record."""
    changes = autocast_list_changes(device="cuda") or {"added": (), "removed": ()}
    added = set(changes["added"])
    lists = {policy: tuple(op for op in ops if op not in added) for policy, ops in lists.items()}
    for op in changes["removed"]:
        policy = _CUDA_POLICY_2_13[op]
        if op not in lists[policy]:
            lists[policy] += (op,)
    return lists
