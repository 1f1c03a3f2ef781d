"""An optimizer state dict checked against the optimizer that loads it, before anything loads.

A damaged checkpoint (a missing, extra, mis-shaped or mis-typed entry, an 8-bit moment without
its scale, a missing step count) is refused with the entry named; state, param_groups and weights
stay as they were. Without the check a missing ``exp_avg`` loaded and restarted at zero beside
its ``exp_avg_sq`` and step count: a silently wrong update (torch.optim.AdamW raises a KeyError
there, after loading)."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor

from ._arguments import LEAN_KEYS, check_group
from ._quant import FORMATS, num_blocks, scale_key, whole_block_rows
from .masters import MASTER_KEY, REMAINDER_KEY, store_of

# A param group's entry in state_dict() where some moment is 8-bit: "flat" (one process: every
# parameter 8-bit) or "rows" (shards: 8-bit where rows are whole blocks, else bf16). A loader
# that loads into the optimizer's own storage (torch.distributed.checkpoint) casts 8-bit codes
# to other dtypes as numbers; what the saver kept tells such a cast from a saved moment.
EIGHT_BIT_LAYOUT = "moments_8bit_layout"
STORAGE_KEYS = {"exp_avg": "exp_avg_dtype", "exp_avg_sq": "exp_avg_sq_dtype",
                "momentum_buffer": "momentum_dtype"}
# State whose dtype the optimizer chooses, not the parameter's: fp32 or a group's lean storage
# (docs/core.md, "Lean optimizer state"). torch's load_state_dict would cast it: we restore it.
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
# The per-block scales of 8-bit moments (``exp_avg_scale``...: _quant.py).
SCALE_KEYS = tuple(scale_key(k) for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"))
FP32_STATE_KEYS = ("step", "sum", MASTER_KEY, REMAINDER_KEY) + MOMENT_KEYS + SCALE_KEYS


def written_by_torch(saved_groups) -> bool:
    """A torch.optim optimizer wrote the checkpoint: its own options are in the groups."""
    return any(k in g for g in saved_groups for k in ("foreach", "differentiable", "fused"))


def check_loadable(optimizer, state_dict) -> None:
    """Raises ValueError (naming the entry and the fix) unless ``state_dict`` is whole for
    ``optimizer``: its structure, and every parameter's saved state (see the module's doc)."""
    name = type(optimizer).__name__
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(f"{name}.load_state_dict: expected a dict with 'state' and "
                         "'param_groups' (an optimizer's state_dict()), got "
                         f"{type(state_dict).__name__}"
                         + (f" with keys {sorted(state_dict)}" if isinstance(state_dict, dict)
                            else ""))
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{name}.load_state_dict: the checkpoint has {len(saved_groups)} param "
                         f"groups, this optimizer {len(optimizer.param_groups)}; build the "
                         "optimizer with the same groups as the one saved")
    for i, group in enumerate(saved_groups):  # hyperparameters as the constructor takes them
        try:  # (storage dtypes: this optimizer's own choice, not the checkpoint's)
            check_group({k: v for k, v in group.items() if k not in STORAGE_KEYS.values()},
                        optimizer.defaults)
        except ValueError as e:
            raise ValueError(f"{name}.load_state_dict: param group {i}: {e}") from None
    where = {}
    for i, (saved, own) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if len(saved["params"]) != len(own["params"]):
            raise ValueError(f"{name}.load_state_dict: param_groups[{i}] of the checkpoint has "
                             f"{len(saved['params'])} parameters, this optimizer's "
                             f"{len(own['params'])}; build it over the same parameters")
        merged = dict(own, **{k: v for k, v in saved.items() if k != "params"})
        for j, (pid, p) in enumerate(zip(saved["params"], own["params"])):
            where[pid] = (p, merged, f"param_groups[{i}]['params'][{j}]")
    via_torch = written_by_torch(saved_groups)
    for pid, entries in state_dict["state"].items():
        if pid not in where:
            raise ValueError(f"{name}.load_state_dict: the checkpoint's state has an entry for "
                             f"parameter id {pid!r}, which no param group lists (an extra "
                             "entry: the state dict was edited or comes from another model)")
        p, group, label = where[pid]
        _check_entries(optimizer, name, p, group, f"state[{pid!r}] ({label})", entries,
                       via_torch)


def _check_entries(optimizer, name, p: Tensor, group: dict, label: str, entries,
                   via_torch: bool) -> None:
    def refuse(what: str) -> None:
        raise ValueError(f"{name}.load_state_dict: {label}: {what}; the checkpoint is damaged "
                         "or from another optimizer (nothing was loaded)")

    if not isinstance(entries, dict):
        refuse(f"expected a dict of state tensors, got {type(entries).__name__}")
    # An optimizer class says which state it can keep (``_all_state_keys``, default its
    # ``_state_keys``), which a started parameter must have (``_state_keys_for(group)`` plus
    # ``_also_required_state_keys``), whether a step count is required (``_loaded_step_required``)
    # and which state is one number per parameter (``_scalar_state_keys``: NovoGrad's norm).
    known = set(getattr(optimizer, "_all_state_keys", ()) or optimizer._state_keys)
    known |= {"step", MASTER_KEY, REMAINDER_KEY}
    extra = sorted(k for k in entries if k not in known and k not in {scale_key(m) for m in known})
    if extra:
        refuse(f"unknown entries {extra} (this optimizer keeps {sorted(known)})")
    moments = [k for k in known if k not in ("step", MASTER_KEY, REMAINDER_KEY)]
    if "step" in entries or any(entries.get(k) is not None for k in moments):  # started
        # (State an option switched on mid-run starts at the next step, as _init_state does:
        # FusedSGD's momentum buffer, FusedAdam's max_exp_avg_sq; not required.)
        mid_run = getattr(optimizer, "_mid_run_state_keys", ())
        required = tuple(k for k in optimizer._state_keys_for(group) if k not in mid_run)
        required += tuple(getattr(optimizer, "_also_required_state_keys", ()))
        missing = [k for k in required if entries.get(k) is None]
        if ("step" not in entries and "step" not in group
                and getattr(optimizer, "_loaded_step_required", True)):
            missing.append("step")
        if missing:
            refuse(f"missing {missing} (a parameter's state is loaded whole or not at all)")
    scalar_keys = getattr(optimizer, "_scalar_state_keys", ())
    for key, value in entries.items():
        if key == "step":
            if isinstance(value, Tensor):
                meta = " on the meta device" if value.is_meta else ""
                if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool or meta:
                    refuse(f"'step' must be one real number, got a {value.dtype} tensor of "
                           f"shape {tuple(value.shape)}{meta}")
                value = value.item()
            elif isinstance(value, bool) or not isinstance(value, numbers.Real):
                refuse(f"'step' must be a number or a one-element tensor, got "
                       f"{type(value).__name__}")
            if not value >= 0 or value == float("inf"):
                refuse(f"'step' must be a finite count >= 0, got {value}")
            continue
        if value is None:
            continue
        if not isinstance(value, Tensor):
            refuse(f"'{key}' must be a tensor, got {type(value).__name__}")
        # (the bf16 weight's low bits; amp O2 in a wrapper: its store joins them with the model's)
        if key == REMAINDER_KEY and p.dtype != torch.bfloat16 and store_of(optimizer) is None:
            raise ValueError(
                f"{name}.load_state_dict: {label}: a remainder master (the 16 bits a bf16 weight "
                f"drops) for a {p.dtype} parameter, which cannot complete it (nothing was "
                "loaded); load it into the bf16 model it was saved with, then convert with "
                "export_fp32_state_dict / export_fp32_optimizer_state_dict")
        if value.is_meta:
            refuse(f"'{key}' is on the meta device (no values: a checkpoint saved from a model "
                   "not yet materialized)")
        if key.endswith("_scale") and key not in known:
            moment = key[: -len("_scale")]
            codes = entries.get(moment)
            if not (isinstance(codes, Tensor) and codes.dtype == torch.uint8):
                refuse(f"'{key}' (8-bit scales) without 8-bit '{moment}' codes")
            if value.dtype != torch.float32 or value.numel() != num_blocks(p.numel()):
                refuse(f"'{key}' must be float32 with {num_blocks(p.numel())} elements (one per "
                       f"256 of the parameter's {p.numel()}), got {value.dtype} with "
                       f"{value.numel()}")
            continue
        if key in (MASTER_KEY, REMAINDER_KEY) and via_torch:  # (torch's options in the groups:
            # a torch optimizer wrote it, whose load casts every entry to p's dtype. Stale anyway,
            # the weights win over a master; a remainder's lost bits are dropped)
            dtypes, shape = (torch.float32, torch.bfloat16, torch.float16, torch.int16), p.shape
        elif key == REMAINDER_KEY:
            dtypes, shape = (torch.int16,), p.shape
        elif key == MASTER_KEY:
            dtypes, shape = (torch.float32,), p.shape
        else:
            dtypes = (torch.float32, torch.bfloat16, torch.float16)
            dtypes += (torch.uint8,) if key in FORMATS else ()
            shape = torch.Size([]) if key in scalar_keys else p.shape
        if value.dtype not in dtypes:
            refuse(f"'{key}' has dtype {value.dtype}, expected one of "
                   f"{[str(d).replace('torch.', '') for d in dtypes]}")
        if value.shape != shape and not (key in scalar_keys and value.numel() == 1):
            refuse(f"'{key}' has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}")
        if value.dtype == torch.uint8 and not isinstance(entries.get(scale_key(key)), Tensor):
            refuse(f"'{key}' holds 8-bit codes but '{scale_key(key)}' (their per-block scales) "
                   "is missing")
        layout = group.get(EIGHT_BIT_LAYOUT)
        if layout is not None and str(group.get(STORAGE_KEYS.get(key))).endswith("uint8"):
            saved = torch.uint8 if layout == "flat" or whole_block_rows(p) else torch.bfloat16
            if value.dtype != saved and via_torch:
                refuse(f"'{key}' was saved as 8-bit codes but arrives as {value.dtype}: a torch "
                       "optimizer loaded this checkpoint, cast the codes as numbers and trained "
                       "on them (its moments are not Adam's). Give a torch optimizer "
                       "export_fp32_optimizer_state_dict(optimizer) instead of state_dict()")
            if value.dtype != saved:
                refuse(f"'{key}' was saved as {str(saved).replace('torch.', '')} ({layout} "
                       f"8-bit layout) but arrives as {value.dtype}: a loader cast it "
                       "(torch.distributed.checkpoint loads into this optimizer's own storage "
                       "and casts 8-bit codes as numbers). Resume 8-bit moments with the layout "
                       "they were saved in (one process: 8-bit for every parameter; shards: bf16 "
                       "where rows are not whole blocks), or load the whole state dict in one "
                       "process with optimizer.load_state_dict, which converts")

