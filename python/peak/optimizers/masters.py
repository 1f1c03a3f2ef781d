"""Master weights: the one owner of the fp32 weights that fp16/bf16 parameters are stepped
through, in a fused optimizer's state (``state[p]["master_param"]`` or a remainder) or in a
:class:`MasterWeights` store in place of a torch optimizer's parameters (amp O2,
``FP16_Optimizer``): docs/core.md, "Who owns the master weights"."""
from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary  # (keyed by optimizers, never by parameters)

from .. import ops
from ..scaling import group_by_device_dtype, local_shard
from ._arguments import (  # noqa: F401 (the owner's rules; amp checks them)
    check_one_master_each, grad_versions, inner_optimizer, warn_bare_masters, warn_bypassed_masters,
    warn_changed_grads, wrapper_chain)
from ._followed import as_followed, followed, note_weight, settle_loads
from ._memory_layout import (UNSEEN, follow_master_layouts, state_for_master, weight_stamp,
                             written_since)
from ._grads import (drop_left_grads, grads_left, own_grad, unscaled_sparse,  # noqa: F401
                     eager_no_grad, zero_in_place)  # (its front doors')
from ._remainders import (MASTER_KEY, REMAINDER_KEY, join_or_weight,  # noqa: F401 (protocol)
                          join_remainder, keep_as_remainder, rounds_to, split_master, weight_wins)

__all__ = ["MASTER_KEY", "REMAINDER_KEY", "LOW_DTYPES", "MasterWeights", "new_master",
           "copy_to_model", "join_remainder", "split_master", "keep_as_remainder",
           "master_in_state", "store_of", "master_of_param", "masters_by_param"]

LOW_DTYPES = (torch.float16, torch.bfloat16)
# The checkpoint layout amp wrote before masters had one owner ({flat index: master}): still read.
EARLIER_AMP_KEY = "amp_master_params"

# Nothing here refers to a parameter weakly (NOTE: [No weak references to parameters]).
_stores = WeakIdKeyDictionary()  # optimizer (or the FP16_Optimizer wrapping it) -> its store
_live_stores: "weakref.WeakSet[MasterWeights]" = weakref.WeakSet()  # attached or not
_amp_owners: weakref.WeakSet = weakref.WeakSet()  # fused optimizers amp O2 registered params with


def new_master(p: Tensor, original: Tensor | None = None) -> Tensor:
    """The one maker of masters: ``original`` (fp32 weights from before a cast) or p widened."""
    return original if original is not None else p.detach().to(torch.float32, copy=True)


@torch.no_grad()
def copy_to_model(masters: list[Tensor], params: list[Tensor]) -> None:
    """The one master -> model copy: every master rounded to nearest even into its parameter's
    dtype, one multi-tensor pass per (device, dtype) (NaN keeps the rule of NOTE: [Device
    conversions]). A skipped step left the masters as they were: copying them again is exact."""
    for device, _, _, (ins, outs) in group_by_device_dtype(masters, params):
        ops.multi_tensor_scale_(ins, outs, 1.0, ops.new_found_inf(device))


def master_in_state(optimizer, p: Tensor, state: dict, group: dict | None = None,
                    original: Tensor | None = None) -> Tensor | None:
    """Give ``p`` its master in a fused optimizer's ``state`` unless it has one: a remainder where
    the optimizer keeps remainders (``original``, or an fp32 master already there, split; else
    zeros: the weight is its master), else an fp32 master. Returns the fp32 master, if any."""
    if optimizer.keeps_remainder(p, group):
        if REMAINDER_KEY not in state:
            master = state.pop(MASTER_KEY, original)  # (amp O2's exact fp32 original)
            if master is None:
                state[REMAINDER_KEY] = torch.zeros_like(p, dtype=torch.int16)
            else:
                keep_as_remainder(p, state, master)
                note_weight(optimizer, p)
    elif optimizer.wants_master(p) and (MASTER_KEY not in state or original is not None):
        state[MASTER_KEY] = new_master(p, original)
    return state.get(MASTER_KEY)


class MasterWeights:
    """fp32 masters that stand in for fp16/bf16 parameters in a torch optimizer's
    ``param_groups``: ``model_params[i]`` is stepped through ``masters[i]``.

    ``add`` makes a master and returns what the param group holds instead of the parameter;
    ``copy_to_model`` rounds every master into its parameter; ``attach(optimizer)`` makes the
    optimizer's ``state_dict()`` carry the masters (``state[i]["master_param"]``) and its
    ``load_state_dict`` restore them bit for bit (the earlier ``"amp_master_params"`` layout too).
    """

    def __init__(self) -> None:
        self.model_params: list[Tensor] = []
        self.masters: list[Tensor] = []
        self.own_params: list[Tensor] = []  # stepped as they are, gradients unscaled in place
        # Frozen at registration, left in their group as they are: registered when a backward
        # pass first gives one a gradient (unfrozen later).
        self.frozen: list[Tensor] = []
        self._optimizer_ref = None  # (a weak reference, from attach: whose groups hold them)
        self.had_grads: list = []  # the layout of each master's gradient at its step, or None
        self.took_grads = False  # a backward pass of this step went through take_grads
        self._grad_stash: list | None = None
        self._had_grad: list | None = None  # (set_grads_aside: which weights had a gradient)
        self._loaded: dict | None = None
        self._versions: list[tuple] = []  # the weights' stamps at the last copy-back
        self.held: list | None = None  # in a wrapper's step: each inner step's completion
        self.master_by_id: dict[int, Tensor | None] = {}  # id(p) -> its master (frozen: None)
        self.arrived: dict[int, bool] = {}  # id(p) -> whether a model load gave finer weights
        self.joins: dict[int, tuple] = {}  # id(p) -> (p, a loaded remainder), for a later weight
        _live_stores.add(self)

    def register(self, params, with_masters: bool, originals: dict | None = None) -> list:
        """What a param group holds instead of ``params``: with ``with_masters``, every trainable
        fp16/bf16 param's new master (from ``originals[id(p)]``, its fp32 weights from before a
        cast, when there); the others as they are, own masters (frozen ones until unfrozen)."""
        out = []
        for p in params:
            if with_masters and p.requires_grad and p.dtype in LOW_DTYPES:
                out.append(self.add(p, originals.pop(id(p), None) if originals else None))
                self._versions[-1] = UNSEEN  # amp's: compared at the first step (note_master_made)
            else:
                if p.requires_grad or not with_masters:
                    self.own_params.append(p)
                else:  # (no master for a frozen weight: fine-tuning freezes most of a model)
                    self.frozen.append(p)
                    self.master_by_id[id(p)] = None
                out.append(p)
        return out

    def _register_frozen(self, unfrozen: list) -> None:
        """Register frozen parameters (unfrozen since, or with masters in a checkpoint): a master
        in place of a low-precision one in its group, an fp32 one as its own master."""
        self.frozen = [p for p in self.frozen if not any(p is q for q in unfrozen)]
        optimizer = self._optimizer_ref() if self._optimizer_ref is not None else None
        for p in unfrozen:
            self.master_by_id.pop(id(p), None)
            if p.dtype in LOW_DTYPES and optimizer is not None:
                master = self.add(p)
                for group in optimizer.param_groups:
                    group["params"] = [master if q is p else q for q in group["params"]]
                if p in optimizer.state:  # (Adagrad's from its constructor, a load's)
                    optimizer.state[master] = state_for_master(optimizer.state.pop(p))
            else:
                self.own_params.append(p)
                if self._grad_stash is not None:
                    self._grad_stash.append(None)

    def add(self, p: Tensor, original: Tensor | None = None) -> torch.nn.Parameter:
        master = torch.nn.Parameter(new_master(p, original), requires_grad=True)
        self.model_params.append(p)
        self.masters.append(master)
        self._versions.append(weight_stamp(p))
        self.master_by_id[id(p)] = master
        return master

    def mark(self) -> tuple[int, int, int]:
        return len(self.masters), len(self.own_params), len(self.frozen)

    def rollback(self, mark: tuple[int, int, int]) -> None:
        """Forget what was registered after ``mark()`` (a registration that failed)."""
        for p in self.model_params[mark[0]:] + self.frozen[mark[2]:]:
            self.master_by_id.pop(id(p), None)
        del self.model_params[mark[0]:], self.masters[mark[0]:], self._versions[mark[0]:]
        del self.own_params[mark[1]:], self.frozen[mark[2]:]

    def holds(self, p: Tensor) -> bool:
        return id(p) in self.master_by_id  # (the store keeps p: the id is p's)

    def copy_to_model(self) -> None:
        follow_master_layouts(self.masters, self.model_params, self._optimizer_ref)  # (a load's)
        copy_to_model(self.masters, self.model_params)
        self._versions = [weight_stamp(p) for p in self.model_params]  # (peak's kernels bump none)
        self._settle()

    @eager_no_grad
    def follow_weights(self) -> None:
        """After a backward pass and before a step: a master follows its weight where it was
        written since (``weight.copy_`` under no_grad, nn.Embedding's max_norm, ``p.data = x``;
        ``p.data`` written in place only before the first step, as in Apex), as a fused
        optimizer's do (NOTE: [Masters after a model reload]); after the backward: before the
        script edits the masters (clipping, decay). A new memory layout is followed too."""
        follow_master_layouts(self.masters, self.model_params, self._optimizer_ref)
        for i, (p, master, seen) in enumerate(zip(self.model_params, self.masters, self._versions)):
            if written_since(p, seen):
                master.copy_(weight_wins(master, p))
                self._versions[i] = weight_stamp(p)

    def _settle(self) -> None:
        """A step (or its skip) or a load: what a model load gave is settled."""
        self.arrived.clear()
        self.joins.clear()

    def after_step(self, completed: bool) -> None:
        """After the optimizer's step: the model follows the masters, and after a step that
        returned their gradients go (one that raised keeps them: called again, it steps them;
        inside a wrapper's step they go when it returns: NOTE: [A wrapper's work after the step])."""
        if self.masters:
            self.copy_to_model()
        if self.held is not None:
            self.held.append(completed)
        elif completed and self.masters:
            self.drop_grads()

    def around_wrapper(self, wrapper_step, ended, *args, **kwargs):
        """``wrapper_step``, the step of a wrapper given to amp around the optimizer amp set up;
        ``ended()`` after it, when it ran the inner step.

        NOTE: [A wrapper's work after the step] A wrapper may work on the weights after the inner
        step (Lookahead syncs its slow weights into the masters, reading their gradients, often
        through ``p.data``, which no version counter sees). The masters keep their gradients until
        the wrapper's step returns, and the model follows the masters after each inner step and
        again then, so that the work reaches the model, as under Apex, which patched the step of
        the object it was given. A skip holds for the rest of the wrapper's step (amp keeps the
        overflow flag: a second inner step on the same gradients skips too). A wrapper's step that
        does not call the inner one (an accumulating call) leaves everything as it was."""
        if self.held is not None:  # (a wrapper's step inside another's)
            return wrapper_step(*args, **kwargs)
        self.held = []
        try:
            return wrapper_step(*args, **kwargs)
        finally:
            held, self.held = self.held, None
            if held:  # (the inner step ran, or was skipped)
                self.after_step(held[-1])
                ended()

    def drop_grads(self) -> None:
        """After a step (or its skip): the masters' gradients go; which had one is kept, as
        ``zero_grad(set_to_none=False)`` gives those zeros again (as torch keeps zeroed ones)."""
        if self.held is not None:  # (a skip inside a wrapper's step: its work may write masters)
            self.held.append(False)
        self.had_grads = [None if m.grad is None else m.grad.layout for m in self.masters]
        self.took_grads = False
        self._settle()
        for m in self.masters:
            m.grad = None

    def bypassed(self) -> bool:
        """The model's params have gradients but no backward pass of this step went through
        ``take_grads`` (the masters hold none, or only zero_grad's zeros)."""
        return (bool(self.masters) and not self.took_grads
                and any(p.grad is not None for p in self.model_params))

    # -- the scaled gradients: a backward pass writes the model's; the masters get them ----------
    def set_grads_aside(self) -> None:
        """Before a backward pass: the model's gradients go (the masters hold them unscaled), the
        own params' are set aside, so that the pass's new ones can be told apart. A weight that
        had one (zeroed by the script: a step's went before) keeps its master stepped on a zero
        gradient if the pass does not reach it, as torch steps a zeroed gradient (and Apex)."""
        self._had_grad = [p.grad is not None for p in self.model_params]
        self._grad_stash = [own_grad(p.grad) for p in self.own_params]
        for p in self.model_params + self.own_params:
            p.grad = None

    def restore_grads(self) -> None:
        """Undo ``set_grads_aside`` (the backward pass raised)."""
        for p, g in zip(self.own_params, self._grad_stash or ()):
            p.grad = g
        for p in self.model_params:
            p.grad = None
        self._grad_stash = None

    @torch.no_grad()
    def take_grads(self, scaler) -> bool:
        """After a backward pass: its gradients unscaled by ``scaler`` (``unscale(grads, outs)``,
        ``unscale_with_stashed(grads, earlier, outs)``, flagging inf/NaN) into the masters'
        gradients (own params: in place), added to those of earlier passes of the step. Returns
        whether the pass gave any of them a gradient."""
        if self.frozen:  # (unfrozen since: registered before their gradients are unscaled)
            self._register_frozen([p for p in self.frozen if p.grad is not None])
        self.follow_weights()
        rows, sparse = [], False  # (new gradient, earlier gradient or None, output)
        unscale = lambda values: scaler.unscale(values, values)  # noqa: E731
        for p, m in zip(self.model_params, self.masters):
            if p.grad is not None and p.grad.is_sparse:
                m.grad, sparse = unscaled_sparse(p.grad, m.grad, unscale, torch.float32), True
            elif p.grad is not None:
                earlier = m.grad
                if earlier is None:
                    m.grad = torch.empty_like(m)
                rows.append((p.grad, earlier, m.grad))
        stash = self._grad_stash or [None] * len(self.own_params)
        for p, g in zip(self.own_params, stash):
            if p.grad is None:
                p.grad = g
            elif p.grad.is_sparse:
                p.grad, sparse = unscaled_sparse(p.grad, g, unscale, p.grad.dtype), True
            else:
                rows.append((p.grad, g, p.grad))
        # (FSDP2: every DTensor to its local shard, one by one: some parameters may not be sharded)
        rows = [tuple(None if t is None else local_shard(t) for t in row) for row in rows]
        new = [r for r in rows if r[1] is None]
        acc = [r for r in rows if r[1] is not None]
        if new:
            scaler.unscale([r[0] for r in new], [r[2] for r in new])
        if acc:
            scaler.unscale_with_stashed(*([r[i] for r in acc] for i in range(3)))
        for m, had in zip(self.masters, self._had_grad or ()):
            if had and m.grad is None:
                m.grad = torch.zeros_like(m)
        self._grad_stash = self._had_grad = None
        self.took_grads |= bool(rows) or sparse
        return bool(rows) or sparse

    def zero_grad(self, set_to_none: bool) -> None:
        """The model params' gradients, after the optimizer's ``zero_grad`` cleared the masters'.
        Without ``set_to_none`` a master stepped with a gradient keeps a zero one, stepped again
        without a new one, as torch steps a parameter whose gradient was zeroed."""
        for p in self.model_params:
            if p.grad is not None and set_to_none:
                p.grad = None
            elif p.grad is not None:
                zero_in_place(p.grad)
        if not set_to_none:
            for m, had in zip(self.masters, self.had_grads):
                if had is not None and m.grad is None:  # (a sparse one stays sparse)
                    m.grad = torch.zeros_like(m, layout=had)
        self._grad_stash = None
        self.took_grads = False

    # -- checkpoints ------------------------------------------------------------------------------
    def attach(self, optimizer, hooks: bool = True) -> None:
        """Register this store as ``optimizer``'s (``store_of``) and, with ``hooks``, make the
        optimizer's state dicts carry the masters."""
        _stores[optimizer] = self
        self._optimizer_ref = weakref.ref(optimizer)
        if not hooks:
            return
        optimizer.register_state_dict_post_hook(self._save_hook)
        optimizer.register_load_state_dict_pre_hook(self._take_hook)
        optimizer.register_load_state_dict_post_hook(self._restore_hook)

    def _save_hook(self, optimizer, state_dict: dict) -> dict:
        masters = {id(m) for m in self.masters}
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        state = state_dict["state"]
        for i, p in enumerate(flat):
            if id(p) in masters:
                state[i] = dict(state.get(i, {}), **{MASTER_KEY: p})
        return state_dict

    def _take_hook(self, optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        loaded = dict(state_dict.pop(EARLIER_AMP_KEY, None) or {})
        state = {}
        for i, st in state_dict["state"].items():
            if isinstance(st, dict) and (MASTER_KEY in st or REMAINDER_KEY in st):
                # (a fused optimizer's remainder: (remainder,), joined with the weight below)
                loaded[i] = st[MASTER_KEY] if MASTER_KEY in st else (st[REMAINDER_KEY],)
                st = {k: v for k, v in st.items() if k not in (MASTER_KEY, REMAINDER_KEY)}
                if not st:
                    continue  # a master alone: no state of the torch optimizer's
            state[i] = st
        state_dict["state"] = state
        groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
        if loaded and [len(g["params"]) for g in groups] == [len(g["params"])
                                                             for g in saved_groups]:
            # Checked before anything changes (torch's own check of the groups too), then frozen
            # parameters with saved masters get theirs, before torch loads their state.
            flat = [p for group in groups for p in group["params"]]
            weight_of = {id(m): p for p, m in zip(self.model_params, self.masters)}
            weight_of.update((id(p), p) for p in self.frozen if p.dtype in LOW_DTYPES)
            for i, value in loaded.items():
                target = flat[i] if 0 <= i < len(flat) else None
                weight = weight_of.get(id(target))
                saved = value[0] if isinstance(value, tuple) else value
                if (weight is None or target.shape != saved.shape
                        or (isinstance(value, tuple) and weight.dtype != torch.bfloat16)):
                    what = ("a remainder master (the 16 bits a bf16 weight drops; a bf16 "
                            "weight needed)" if isinstance(value, tuple) else "an fp32 master")
                    raise RuntimeError(
                        f"optimizer.load_state_dict: the checkpoint has {what} for parameter {i} "
                        "that this optimizer does not have a master for (shape or dtype differ). "
                        "Restore with the same model, opt_level and keep_batchnorm_fp32 that "
                        "wrote the checkpoint.")
            self._register_frozen([flat[i] for i in loaded if any(flat[i] is q
                                                                   for q in self.frozen)])
        self._loaded = loaded or None
        return state_dict

    def _restore_hook(self, optimizer) -> None:
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return  # a checkpoint without masters: keep the masters derived from the model
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        weight_of = {id(m): p for p, m in zip(self.model_params, self.masters)}
        joins = {}
        with torch.no_grad():
            for i, value in loaded.items():
                target = flat[i]  # (checked by _take_hook)
                weight = weight_of[id(target)]
                remainder = value[0] if isinstance(value, tuple) else None
                if remainder is not None:  # (joined again with a weight loaded after it)
                    remainder = remainder.to(device=weight.device, dtype=torch.int16)
                    joins[id(weight)] = (weight, remainder)
                    value = join_remainder(weight.detach(), remainder)
                elif self.arrived.get(id(weight)):  # (finer weights than the model's: stale
                    if not torch.equal(value.to(weight.dtype), weight):  # unless theirs)
                        continue
                elif id(weight) in self.arrived:  # (elementwise: a weight written before wins)
                    value = weight_wins(value.to(weight.device, torch.float32), weight)
                target.copy_(value)
        self.copy_to_model()
        self.joins.update(joins)


def store_of(optimizer) -> MasterWeights | None:
    """The :class:`MasterWeights` store (amp O2 with a torch optimizer, ``FP16_Optimizer``) of
    ``optimizer`` or of what it wraps (``wrapper_chain``: Accelerate's, LARC)."""
    return next((_stores[o] for o in wrapper_chain(optimizer) if o in _stores), None)


def store_holding(p: Tensor) -> MasterWeights | None:
    """The live store that holds model parameter ``p`` (with a master, or frozen), if any."""
    return next((store for store in list(_live_stores) if store.holds(p)), None)


def owner_of(p: Tensor):
    """The fused optimizer amp O2 registered ``p`` with (``register_owner``), if it lives."""
    return next((o for o in list(_amp_owners) if id(p) in followed(o).amp_owned), None)


def master_of_param(p: Tensor) -> Tensor | None:
    """The fp32 master of model parameter ``p``: a :class:`MasterWeights` store's, or that of the
    fused optimizer registered as holding ``p`` (``register_owner``); None otherwise (no master,
    or a remainder)."""
    store = store_holding(p)
    if store is not None:
        return store.master_by_id[id(p)]
    owner = owner_of(p)
    return None if owner is None else owner.state.get(p, {}).get(MASTER_KEY)


# NOTE: [Masters after a model reload] (docs/amp_api.md, "Checkpoints") Under amp, the model's
# load_state_dict hooks (below) re-derive a master that no longer rounds to its reloaded weight
# and keep one that does ("rounds": to nearest even, or ties away as a remainder's weight), so
# model and optimizer checkpoints restore exactly in either order. A remainder joins any weight:
# its master, read before the load, is re-split from a loaded value that changes the weight (kept
# where it rounds to it), unless the optimizer's own load_state_dict just restored the remainder
# for the weight arriving now.
# Outside amp no hook sees the model (a fused optimizer alone, with GradScaler, under FSDP2): the
# optimizer notes each weight's version counter and memory when its master last matched it, and a
# weight written since (in-place loads; peak's kernels bump no counter) makes the master follow it
# before the next step: an fp32 master takes the weight where it no longer rounds to it; a
# remainder, which cannot tell, is cleared. Some writes change nothing (nn.Embedding's max_norm): a
# weight written once is watched from then on by a checksum of its bits after each step, its
# remainder cleared only when the bits changed. A checkpoint saves the masters as that step will
# follow them (NOTE: [Masters saved after a write]). A loaded fp32 master follows a weight written
# after the load (a model loaded after it brings weights it rounds to); a loaded remainder's version
# is forgotten (its weight arrives with it, in either order). ``p.data = x`` (new memory, torch's
# prune.remove) is followed by an fp32 master (a remainder joins it); in-place writes to ``p.data``
# go unseen; a step captured in a CUDA graph follows nothing (a replay would repeat it). The
# entries: optimizers/_followed.py.
# module being loaded -> {id(p): (p, fp32 value being loaded, weight changes, master before)}
_loading: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def note_load_hook(module, state_dict, prefix, *args) -> None:
    """``module.load_state_dict`` pre-hook: what each parameter is about to be given."""
    loading = _loading[module] = {}
    for name, p in module._parameters.items():
        value = state_dict.get(prefix + name)
        if p is not None and isinstance(value, Tensor) and value.shape == p.shape:
            owner = owner_of(p)
            rem = owner.state.get(p, {}).get(REMAINDER_KEY) if owner is not None else None
            loading[id(p)] = (p, value, not torch.equal(value.to(p.dtype), p.detach()),
                              None if rem is None else join_remainder(p.detach(), rem))


@torch.no_grad()
def refresh_after_load_hook(module, incompatible_keys) -> None:
    """``module.load_state_dict`` post-hook (NOTE: [Masters after a model reload])."""
    loading = _loading.pop(module, {})
    for p in module._parameters.values():
        if p is None:
            continue
        _, value, changed, before = loading.get(id(p), (p, None, False, None))
        owner, store = owner_of(p), store_holding(p)
        table = followed(owner) if owner is not None else None
        if (owner is not None and value is not None and value.dtype == torch.float32
                and p.requires_grad and owner.wants_master(p)
                and not {MASTER_KEY, REMAINDER_KEY} & owner.state.get(p, {}).keys()):
            owner.set_master(p, value)  # (none yet: amp made none from fp32 weights, multi-rank)
        master = master_of_param(p)
        finer = (value is not None and (master is not None or store is not None)  # (than p)
                 and not torch.equal(value.to(p.dtype).to(value.dtype), value))
        joins = table.joins if table is not None else store.joins if store is not None else {}
        remainder = joins.pop(id(p), (p, None))[1]
        if master is not None and remainder is not None:  # (its rounding is p by construction)
            master.copy_(join_remainder(p, remainder))
        elif (master is not None and value is not None  # (not a weight this load left out)
              and not rounds_to(master, p)):  # (exact where fp32 weights arrive)
            master.copy_(value if finer else weight_wins(master, p))
        if value is not None and store is not None:
            store.arrived[id(p)] = finer  # (a store's weight: checked at its optimizer's next load)
        state = owner.state.get(p, {}) if owner is not None else {}
        if REMAINDER_KEY in state and table.awaiting.pop(id(p), None) is None and changed:
            table.splits.pop(id(p), None)  # (the master it waited for is ``before``)
            keep_as_remainder(p, state, before if before is not None and rounds_to(before, p)
                              else value.to(torch.float32))  # (a tie's weight: ties away again)
        if state:  # (this hook has made the master match: the step need not follow again)
            note_weight(owner, p)


def stepped_elsewhere(p: Tensor) -> bool:
    """A live store (amp's, FP16_Optimizer's) or a fused optimizer under amp O2 steps ``p``."""
    return owner_of(p) is not None or store_holding(p) is not None


def register_owner(p: Tensor, optimizer) -> None:
    """``optimizer`` (a peak fused optimizer) keeps p's master in its state: master_of_param
    finds it (amp's model load hook re-derives it from a reloaded weight)."""
    followed(optimizer).amp_owned[id(p)] = p
    _amp_owners.add(optimizer)


def masters_by_param(optimizer) -> dict[int, Tensor]:
    """id(model parameter) -> its exact fp32 master, wherever ``optimizer`` keeps it: a store
    (amp O2 with a torch optimizer, ``FP16_Optimizer``) or its state (peak's fused optimizers;
    a remainder joined with its bf16 weight)."""
    store = store_of(optimizer)
    masters = {id(p): m for p, m in zip(store.model_params, store.masters)} if store else {}
    fused = inner_optimizer(optimizer)  # (behind a wrapper: its watch is the fused one's)
    if store is None:  # (a fused optimizer's own masters)
        settle_loads(fused)
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            st = as_followed(fused, p, st) if store is None else st
            if MASTER_KEY in st:
                masters[id(p)] = st[MASTER_KEY]
            elif REMAINDER_KEY in st:
                masters[id(p)] = join_remainder(p.detach(), st[REMAINDER_KEY])
    return masters


def apex_lists(optimizer, store: MasterWeights | None, which: int, flat: bool,
               trainable_only: bool = True) -> list:
    """Apex's amp stash lists (``fp16_groups`` ... ``all_fp32_params``), per param group: the
    fp16/bf16 model params (``which`` 0), the fp32 weights stepped for them (1: their masters, or
    themselves without) and the fp32 params (2); ``flat``: one list of all groups'."""
    model_of = {id(m): p for p, m in zip(store.model_params, store.masters)} if store else {}
    lists = []
    for group in optimizer.param_groups:
        pairs = [(model_of.get(id(q), q), q if store else optimizer.state.get(q, {}).get(
            MASTER_KEY, q)) for q in group["params"]]
        lists.append([pair[min(which, 1)] for pair in pairs
                      if (pair[0].requires_grad or not trainable_only)
                      and (pair[0].dtype in LOW_DTYPES) == (which < 2)])
    return [t for group in lists for t in group] if flat else lists


def _stash_list(name: str, which: int, flat: bool) -> property:
    def read(self):
        masters = getattr(self, "master_weights", True)
        if name != "all_fp16_params" and masters == (name == "all_fp32_params"):
            raise AttributeError(  # (an AttributeError: hasattr() answers as on Apex's stash)
                f"Apex's amp stash has no {name} {'with' if masters else 'without'} master weights "
                "(with: fp16_groups, fp32_from_fp16_groups, fp32_from_fp32_groups and the all_* "
                "lists of them; without, as under O1 and O3: all_fp16_params, all_fp32_params)")
        return apex_lists(self.optimizer, getattr(self, "store", None), which, flat, masters)
    return property(read)


class ApexStashLists:
    """Apex's amp stash lists, which scripts read (NVIDIA's BERT clears a skipped step's master
    gradients through ``optimizer._amp_stash.all_fp32_from_fp16_params``), of ``self.optimizer``
    and ``self.store`` (if any): amp's per-optimizer state has them. As Apex's: with master
    weights the six lists of trainable params; without, ``all_fp16_params`` and
    ``all_fp32_params``, frozen params included."""


# (name, which, flat): the per-group lists, the same flat, and O1/O3's list of fp32 params
for _name, _which, _flat in (("fp16_groups", 0, False), ("fp32_from_fp16_groups", 1, False),
                             ("fp32_from_fp32_groups", 2, False), ("all_fp16_params", 0, True),
                             ("all_fp32_from_fp16_params", 1, True),
                             ("all_fp32_from_fp32_params", 2, True), ("all_fp32_params", 2, True)):
    setattr(ApexStashLists, _name, _stash_list(_name, _which, _flat))
del _name, _which, _flat
