"""What every fused optimizer shares: state layout, master weights, step plumbing, checkpoints.
State per parameter, on its device: ``step`` (0-dim), the family's moments (fp32 unless lean) and
an fp16/bf16 parameter's master (fp32 or a remainder); ``state_dict()`` carries the masters and
``load_state_dict`` checks, then restores them bit for bit (the hole in Apex's FusedAdam)."""
from __future__ import annotations

import itertools
import warnings
from collections import defaultdict

import torch
from torch import Tensor

from .. import _ranks, ops
from .._stacklevel import user_stacklevel
from ..scaling import OverflowFlags, agree_on_overflow, group_by_device_dtype, unscale_grads_
from ._arguments import (LEAN_KEYS, check_bool, check_group, check_lean, check_storage,
                         check_unique)
from ._checkpoint_check import (EIGHT_BIT_LAYOUT, FP32_STATE_KEYS, MOMENT_KEYS, SCALE_KEYS,
                                STORAGE_KEYS, check_loadable, written_by_torch)
from ._layout import LayoutWatch, check_steppable, follow_storage, note_storage, storage_changes
from ._memory_layout import follow_layout
from ._quant import load_moment, new_state, scale_key, whole_block_rows
from ._sharded import (check_sharded_group, count_empty_steps, is_sharded, local,
                       local_states, reduce_over_meshes)
from ._fp32_sums import accumulate_fp32, check_fp32_sums, take_fp32_sums
from ._master_loads import (kept_master, load_master, masters_before_load, masters_loaded,
                            masters_to_save, take_fp32_masters)
from . import _followed as watch  # (each weight's version: NOTE [Masters after a model reload])
from .masters import (MASTER_KEY, REMAINDER_KEY, copy_to_model, join_remainder, master_in_state,
                      store_of)


class FusedOptimizer(torch.optim.Optimizer):
    """Base class: subclasses define ``_state_keys`` (their fp32 moments) and ``_launch``."""

    # GradScaler hands grad_scale/found_inf to step() instead of unscaling and syncing.
    _step_supports_amp_scaling = True
    _state_keys: tuple[str, ...] = ()
    _takes_tensor_norms = False  # LAMB, NovoGrad: on shards, norms of whole tensors per bucket
    _bucket_shards = None  # on shards: the bucket's DTensor parameters (for the norms' reduce)

    def __init__(self, params, defaults, master_weights: bool | None = None,
                 stochastic_rounding: bool = False, set_grad_none: bool = True,
                 store_unscaled_grads: bool = True, capturable: bool = False,
                 lean: dict | None = None):
        if master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be None (auto), True or False, got "
                             f"{master_weights!r}")
        check_bool("stochastic_rounding", stochastic_rounding)
        if stochastic_rounding and master_weights is not False:
            raise ValueError(
                "stochastic_rounding=True rounds bf16 weights that are stepped directly, without "
                "fp32 master copies: pass master_weights=False as well (with master weights the "
                "model copy is rounded to nearest from the exact fp32 master)")
        for name, value in (("set_grad_none", set_grad_none), ("capturable", capturable),
                            ("store_unscaled_grads", store_unscaled_grads)):
            check_bool(name, value)
        self.master_weights = master_weights
        self.set_grad_none = set_grad_none  # Apex's option: zero_grad()'s default
        # After a step handed grad_scale, p.grad holds the unscaled gradient, as torch's fused
        # optimizers leave it (NOTE: [Unscaled gradients after the step]); False skips that store.
        self.store_unscaled_grads = store_unscaled_grads
        self._step_store_grads = False  # this step's choice (set by step())
        # In param_groups, so checkpoints carry them: the rounding's hash key (NOTE: [Stochastic
        # rounding to bf16]; torch's seed, so torch.manual_seed repeats runs; 0 on several ranks),
        # capturable (the step never syncs either way) and the lean state's options.
        defaults = dict(defaults, stochastic_rounding=bool(stochastic_rounding),
                        stochastic_rounding_seed=_ranks.agreed_seed(),
                        capturable=capturable, **check_lean(lean, master_weights))
        super().__init__(params, defaults)
        # What a param group of ours holds (torch's __setstate__ adds 'differentiable' and others
        # to self.defaults later; they are not copied into loaded groups).
        self._group_keys = tuple(self.defaults)

    def __getstate__(self) -> dict:
        # torch's keeps defaults, state and param_groups: the constructor's options go with them
        # (a deepcopy or an unpickled optimizer steps as the original).
        return {**super().__getstate__(),
                **{k: v for k, v in self.__dict__.items() if k in _CONSTRUCTOR_ATTRIBUTES}}

    def add_param_group(self, param_group: dict) -> None:
        """As torch's; what peak does not step on DTensor parameters (FSDP2) is refused here,
        before any forward (NOTE: [Sharded steps])."""
        if isinstance(param_group, dict) and not isinstance(param_group["params"], set):
            params = param_group["params"]  # (torch's errors for a non-dict and a set of params)
            params = param_group["params"] = [params] if isinstance(params, Tensor) else [*params]
            unwrapped = [p[1] if isinstance(p, tuple) else p for p in params]
            check_group(param_group, self.defaults)
            lean = check_storage(type(self).__name__, {**self.defaults, **param_group},
                                 self.defaults, self.master_weights)
            param_group.update({k: v for k, v in lean.items() if k in param_group})
            check_unique(type(self).__name__, unwrapped)
            check_sharded_group(self, {**self.defaults, **param_group, "params": unwrapped})
        super().add_param_group(param_group)
        note_storage(self, self.param_groups[-1:])

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """As torch's; ``set_to_none=None`` follows the constructor's ``set_grad_none`` (Apex's)."""
        if set_to_none is None:  # (an unpickled optimizer has only torch's attributes)
            set_to_none = getattr(self, "set_grad_none", True)
        super().zero_grad(set_to_none)
        self.drop_master_grads()
        self.__dict__.pop("_fp32_grad_sums", None)  # (accumulate_grads' sums are gradients too)

    # -- state -----------------------------------------------------------------------------------
    def wants_master(self, p: Tensor) -> bool:
        """``p`` is stepped through an fp32 master (fp16/bf16, unless master_weights=False)."""
        if p.dtype == torch.float32:
            return False
        if p.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{type(self).__name__} supports float32, float16 and bfloat16 "
                            f"parameters; got a {p.dtype} parameter")
        return self.master_weights is not False

    def keeps_remainder(self, p: Tensor, group: dict | None = None) -> bool:
        """p's master is kept as a 16-bit remainder (NOTE: [Remainder masters])."""
        if group is None:
            if not any(g.get("store_param_remainders", False) for g in self.param_groups):
                return False  # (the common case, without a search for p's group)
            group = self._group_of(p)
        if not group.get("store_param_remainders", False) or not self.wants_master(p):
            return False
        if p.dtype != torch.bfloat16:
            raise TypeError(
                f"{type(self).__name__}(store_param_remainders=True) keeps bf16 weights' masters "
                f"as the 16 bits the weight drops; this group has a {p.dtype} parameter, which has "
                "no exact 16-bit remainder. Use a bfloat16 model, or keep fp32 masters "
                "(store_param_remainders=False), or step without masters "
                "(master_weights=False, with stochastic_rounding=True for bf16)")
        return True

    def _group_of(self, p: Tensor) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def _state_dtype(self, group: dict, key: str, p: Tensor | None = None) -> torch.dtype:
        """The storage dtype of state ``key`` in ``group`` (fp32 unless the group asks) for ``p``:
        on shards, 8-bit only where its rows are whole blocks, else bf16 (NOTE: [Sharded steps])."""
        option = STORAGE_KEYS.get(key)
        dtype = group.get(option, torch.float32) if option else torch.float32
        if dtype == torch.uint8 and p is not None and is_sharded(p) and not whole_block_rows(p):
            return torch.bfloat16
        return dtype

    def _init_state(self, p: Tensor, group: dict) -> dict:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        # Per step, not only on the first: a group may switch an option on mid-run (a momentum
        # warm-up from 0, amsgrad), and its state then starts here, as torch's would.
        for key in self._state_keys_for(group):
            if key not in state:
                dtype = self._state_dtype(group, key, p)
                if dtype == torch.uint8:  # 8-bit codes and their per-block scales
                    state[key], state[scale_key(key)] = new_state(p)
                else:
                    state[key] = torch.zeros_like(p, dtype=dtype,
                                                  memory_format=torch.preserve_format)
                self._state_started(state, key)
        master_in_state(self, p, state, group)
        return state

    def _ready_keys(self, group: dict) -> tuple[frozenset, frozenset]:
        """The state keys ``_init_state`` makes for an fp32 parameter of ``group`` and for an
        fp16/bf16 one (its master or remainder too). NOTE: [Host time of a step] On a GPU the
        kernels wait for the step's Python (~300 tensors: 1-3 ms against the kernels' 3-4 ms), so
        per parameter a step that finds its state made does lookups only, no calls. Warns once for
        remainders asked of an all-fp32 group."""
        keys = frozenset(("step", *self._state_keys_for(group),
                          *getattr(self, "_also_required_state_keys", ())))
        remainders = group.get("store_param_remainders", False)
        if (remainders and not self.__dict__.get("_warned_fp32_remainders")
                and all(q.dtype == torch.float32 for q in group["params"])
                and any(q.grad is not None for q in group["params"])):  # (a group stepped)
            self._warned_fp32_remainders = True
            warnings.warn(
                f"{type(self).__name__}(store_param_remainders=True) steps a group whose "
                "parameters are all float32: they are their own masters, so nothing is stored as "
                "remainders and the state is not leaner. Cast the model to bfloat16 (or use "
                "amp.initialize(..., opt_level='O2', cast_model_type=torch.bfloat16)) before the "
                "first step", stacklevel=user_stacklevel())  # the script's step()
        if self.master_weights is False:
            return keys, keys
        return keys, keys | {REMAINDER_KEY if remainders else MASTER_KEY}

    @staticmethod
    def _master_list_entry(state: dict):
        """The kernel's master_params entry: the fp32 master, the int16 remainder or None."""
        master = state.get(MASTER_KEY)
        return master if master is not None else state.get(REMAINDER_KEY)

    def _state_keys_for(self, group: dict) -> tuple[str, ...]:
        return self._state_keys

    def _state_started(self, state: dict, key: str) -> None:
        """Hook: ``state[key]`` was just created (zeros) for a parameter."""

    # -- the master-weight protocol (docs/core.md, "Who owns the master weights") ---------------
    def set_master(self, p: Tensor, master: Tensor) -> None:
        """Make the fp32 ``master`` p's master (amp O2: the weights from before its cast)."""
        master_in_state(self, p, self.state[p], original=master)
        watch.note_master_made(self, p, self.state[p])

    def master_of(self, p: Tensor) -> Tensor | None:
        """p's exact fp32 master (a remainder joined with its weight), or None."""
        watch.settle_loads(self, [p])
        state = watch.as_followed(self, p, self.state.get(p) or {})  # (a write since: followed)
        if REMAINDER_KEY in state:
            return join_remainder(p.detach(), state[REMAINDER_KEY])
        return state.get(MASTER_KEY)

    def master_params(self):
        """The fp32 weights the optimizer steps: the master copy where there is one, else the
        parameter itself (for gradient clipping on the values being updated)."""
        for group in self.param_groups:  # (remainders: the bf16 param, half of its master)
            for p in group["params"]:
                yield self.state[p].get(MASTER_KEY, p) if p in self.state else p

    @torch.no_grad()
    def give_master_grads(self, grad_scale: Tensor | None = None):
        """Unscale the model's gradients (carrying ``grad_scale``) into fp32 gradients of the
        weights stepped, for clipping: an fp32 master gets a new fp32 gradient (exact for the
        power-of-two scales loss scalers use), an fp32 or remainder-kept parameter its own,
        unscaled in place. The next ``step()`` (with no ``grad_scale``) steps with them; it or
        ``zero_grad()`` drops the masters' gradients. Returns ``master_params()``."""
        lows, masters, own = [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.wants_master(p) and not self.keeps_remainder(p):
                    self.__dict__.setdefault("_layouts", LayoutWatch()).visit(p, self.state[p])
                    master = master_in_state(self, p, self.state[p])
                    master.grad = torch.empty_like(master)
                    lows.append(p.grad)
                    masters.append(master.grad)
                else:
                    own.append(p.grad)
        inv = 1.0 if grad_scale is None else grad_scale.reciprocal()
        unscale_grads_(lows, inv, OverflowFlags(), outputs=masters)
        if grad_scale is not None:
            unscale_grads_(own, inv, OverflowFlags())
        return self.master_params()

    def accumulate_grads(self) -> None:
        """Add every fp16/bf16 gradient into an fp32 sum and drop it (after each micro-batch's
        backward): the next ``step()`` steps the exact sum (NOTE: [fp32 gradient accumulation])."""
        with torch.no_grad():
            accumulate_fp32(self)

    def drop_master_grads(self) -> None:
        """Drop the fp32 gradients ``give_master_grads`` gave the masters."""
        for state in self.state.values():
            master = state.get(MASTER_KEY)
            if master is not None:
                master.grad = None

    @property
    def clips_by_norm(self) -> bool:
        """Some group clips by the global gradient norm (``max_grad_norm > 0``)."""
        return any(g.get("max_grad_norm", 0.0) > 0 for g in self.param_groups)

    def _grad_read(self, p: Tensor) -> Tensor:
        """What the step reads: a master's fp32 gradient, an accumulate_grads sum, or p.grad."""
        state, total = self.state.get(p), self.__dict__.get("_fp32_grad_sums", {}).get(p)
        master = state.get(MASTER_KEY) if state else None
        if total is not None:
            return total if p.grad is None else total + p.grad
        return master.grad if master is not None and master.grad is not None else p.grad

    @torch.no_grad()
    def grad_norm(self) -> Tensor | None:
        """The L2 norm of every gradient of the optimizer (all groups and dtypes) as they are
        (scaled, if a scaler scaled them): one read pass per (device, dtype), combined on the
        first gradient's device, no host sync. inf/NaN in any gradient makes it non-finite."""
        sums = self.__dict__.get("_fp32_grad_sums", {})
        params = [p for group in self.param_groups for p in group["params"]
                  if p in sums or p.grad is not None and not p.grad.is_sparse]
        if not params:
            return None
        grads = [(local(self._grad_read(p)), is_sharded(p)) for p in params]
        device = local(params[0]).device
        sumsq = torch.zeros(2, dtype=torch.float32, device=device)  # [shards' part, whole ones]
        for i, shards in enumerate((True, False)):
            part = [g for g, s in grads if s == shards and g.numel()]
            for _, _, _, (group,) in group_by_device_dtype(part):
                norm, _ = ops.multi_tensor_l2norm(group)  # slices: a dense copy in C++
                sumsq[i] += norm.to(device)[0] ** 2
        if any(s for _, s in grads):  # each rank's part of its shards; a plain tensor is whole
            reduce_over_meshes(sumsq[:1], params)  # on every rank
        return sumsq.sum().sqrt().reshape(1)

    def step(self, closure=None, *, grad_scale: Tensor | None = None,
             found_inf: Tensor | None = None, grad_norm: Tensor | None = None):
        """One fused step. ``grad_scale``/``found_inf`` (float32, one element) come from a loss
        scaler: grads are divided by ``grad_scale`` inside the step, and a set ``found_inf`` skips
        it on the device, leaving every weight and state bit-for-bit.

        Groups with ``max_grad_norm > 0`` clip every gradient by the global norm inside the same
        step, as ``torch.nn.utils.clip_grad_norm_`` over all the optimizer's gradients would.
        ``grad_norm`` (the norm of the gradients as passed, still scaled) is that norm when a loss
        scaler already computed it in its inf/NaN check (``peak.amp.GradScaler`` does); otherwise
        the step computes it (one read pass). Under ``torch.compile`` it runs eagerly."""
        if torch.compiler.is_compiling():  # (traced by Dynamo: torch.compile(opt.step))
            return _EAGER_FUSED_STEP(self, closure, grad_scale, found_inf, grad_norm)
        return self._fused_step(closure, grad_scale, found_inf, grad_norm)

    @torch.no_grad()
    def _fused_step(self, closure, grad_scale, found_inf, grad_norm):
        loss = None
        if closure is not None:  # first: what the step reads below is the closure's doing
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler hands these over as attributes of the optimizer instead.
        grad_scale = getattr(self, "grad_scale", None) if grad_scale is None else grad_scale
        found_inf = getattr(self, "found_inf", None) if found_inf is None else found_inf
        if type(found_inf) is int and found_inf == 0:  # (torch's scaler found no gradient: sum([]))
            found_inf = None
        for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf),
                        ("grad_norm", grad_norm)):  # (checked before anything changes)
            if t is not None and not (isinstance(t, Tensor) and t.numel() == 1
                                      and t.is_floating_point() and not t.is_meta):
                raise TypeError(f"{type(self).__name__}.step(): {name} must be a one-element "
                                f"floating tensor on the parameters' device, got {t!r}; e.g. "
                                f"{name}=torch.tensor([1.0], device=...)")
        check_fp32_sums(self, grad_scale)
        changed = storage_changes(self)  # (all checked before any state converts)
        if changed:  # (a step refused after the conversion would leave the state converted)
            check_steppable(self)
        follow_storage(self, changed)
        take_fp32_sums(self)
        take_fp32_masters(self)  # (loaded before the model's weights: NOTE in _master_loads.py)
        watch.weights_settled(self)
        check_steppable(self)
        sharded = any(is_sharded(p) for g in self.param_groups for p in g["params"])
        if sharded and found_inf is not None:  # one rank's inf skips every rank: the caller's
            agree_on_overflow(self, {found_inf.device: found_inf})  # flag too
        self._step_store_grads = (grad_scale is not None
                                  and getattr(self, "store_unscaled_grads", True))
        if grad_norm is None and self.clips_by_norm:
            grad_norm = self.grad_norm()
        self._step_grad_norm = grad_norm
        stepped_master_grads = False
        layouts = self.__dict__.setdefault("_layouts", LayoutWatch())
        for group in self.param_groups:
            buckets: dict[tuple, list[tuple]] = defaultdict(list)
            ready32, ready16 = self._ready_keys(group)
            for p in group["params"]:
                if p.grad is None:
                    layouts.sat_out(p, self.state)
                    continue
                state = self.state.get(p)
                if state is None or not state.keys() >= (ready32 if p.dtype == torch.float32
                                                          else ready16):
                    state = self._init_state(p, group)
                watch.follow_weight(self, p, state)
                if not sharded:
                    layouts.visit(p, state)
                master = self._master_list_entry(state)
                # (8-bit groups on shards hold bf16 moments where rows are not whole blocks)
                storage = _EXP_AVG_SCALE in state or _MOMENTUM_SCALE in state
                has_grads = master is not None and master.grad is not None
                kind = _MASTER_GRADS if has_grads else master is not None
                buckets[(p.device, p.dtype, kind, storage)].append((p, state, master))
            for (device, _dtype, kind, _storage), entries in buckets.items():
                lr_t = self._lr_tensor(group, device)
                gs, fi = self._on(grad_scale, device), self._on(found_inf, device)
                params, states, masters = (list(t) for t in zip(*entries))
                given = [p.grad for p in params]
                mgrads = [s[MASTER_KEY].grad for s in states] if kind is _MASTER_GRADS else []
                stepped_master_grads |= kind is _MASTER_GRADS
                self._bucket_shards, bucket = None, params
                if sharded:  # the kernels step the local shards (NOTE: [Sharded steps])
                    # (whole-tensor norms: every rank steps every shard, empty ones too)
                    keep = [self._takes_tensor_norms or local(p).numel() > 0 for p in params]
                    count_empty_steps([s for s, k in zip(states, keep) if not k], fi)
                    self._bucket_shards = params if self._takes_tensor_norms else None
                    states = local_states([s for s, k in zip(states, keep) if k])
                    masters = [self._master_list_entry(s) for s in states]
                    given, params, mgrads = ([local(t) for t, k in zip(ts, keep) if k]
                                             for ts in (given, params, mgrads))
                    if not params:
                        continue
                if kind is _MASTER_GRADS:
                    self._step_masters(group, params, states, mgrads, given, lr_t, gs, fi)
                else:
                    grads = [self._grad_like(p, g) for p, g in zip(params, given)]
                    self._launch(group, params, grads, masters if kind else [], states, lr_t,
                                 gs, fi)
                    if self._step_store_grads:
                        for g0, g in zip(given, grads):
                            if g is not g0:  # a re-laid-out copy was stepped
                                g0.copy_(g)
                watch.note_stepped(self, bucket)
        self._bucket_shards = None
        layouts.step_done()
        if stepped_master_grads:
            self.drop_master_grads()  # (the step used them)
        return loss

    @staticmethod
    def _lr_tensor(group: dict, device: torch.device) -> Tensor:
        """The learning rate the kernels read: a one-element float32 tensor on ``device``.
        NOTE: [Learning rate under CUDA-graph capture] A float lr becomes a new tensor each step,
        so a captured step keeps its value at capture, as torch's optimizers do. A float32 tensor
        lr on the parameters' device is read from its own memory (reshape is a view): changing it
        in place between replays (``group["lr"].fill_(x)``, as torch's LR schedulers do) changes
        the replayed step. A replay cannot read a CPU tensor (a host copy in a graph is refused or
        frozen): refused here, with the fix."""
        lr = group["lr"]
        if (isinstance(lr, Tensor) and lr.device != device and device.type == "cuda"
                and torch.cuda.is_current_stream_capturing()):
            raise ValueError(
                f"the learning rate is a tensor on {lr.device} but the parameters are on {device}: "
                "a step captured in a CUDA graph cannot read it at replay. Keep lr on the "
                f"parameters' device (param_groups[i]['lr'] = torch.tensor(lr, device='{device}')) "
                "and change it in place between replays")
        return ops.device_scalar(lr, device)

    def _step_masters(self, group, params, states, grads, given, lr, grad_scale, found_inf):
        """Step parameters whose fp32 masters were given fp32 gradients (``amp.master_params``,
        maybe clipped since): the masters are the weights stepped, with those gradients, then
        rounded into the model (as the kernel's own store would round them); the model's gradient
        becomes the one stepped. NOTE: [Fused master-weight step]."""
        masters = [s[MASTER_KEY] for s in states]
        store, self._step_store_grads = self._step_store_grads, False
        try:
            self._launch(group, masters, grads, [], states, lr, grad_scale, found_inf)
        finally:
            self._step_store_grads = store
        # (A step skipped on the device left the masters, so their rounding is the model as is.)
        copy_to_model(masters, params)
        if store and found_inf is None:
            copy_to_model(grads, given)

    @staticmethod
    def _rounding_seed(group: dict, params: list[Tensor]) -> int | None:
        """The kernel's stochastic_rounding_seed for a bucket: None (round to nearest) unless the
        group asks for stochastic rounding and the bucket holds bf16 weights (without masters)."""
        if not group.get("stochastic_rounding", False) or params[0].dtype != torch.bfloat16:
            return None
        return int(group["stochastic_rounding_seed"])

    def _moment_args(self, group: dict, states: list) -> dict:
        """The kernel's moment_rounding_seed for a bucket: stochastic rounding of bf16 moments
        and of 8-bit exp_avg_sq codes unless the group asks for round to nearest (NOTE: [Lean
        optimizer state], NOTE: [8-bit moments])."""
        lean = any(t.dtype == torch.bfloat16 or (k == "exp_avg_sq" and t.dtype == torch.uint8)
                   for s in states[:1] for k, t in s.items() if k in MOMENT_KEYS)
        if not lean or group.get("moment_rounding", "stochastic") != "stochastic":
            return {}
        # Its own key, apart from the weights' stochastic rounding (mixed in by the kernel).
        return {"moment_rounding_seed": int(group["stochastic_rounding_seed"])}

    @staticmethod
    def _scale_args(states: list, keys: dict) -> dict:
        """The kernel's scale lists (``{argument: state key}``) for the 8-bit moments of a
        bucket (NOTE: [8-bit moments]); none for other storage."""
        return {arg: [s[scale_key(key)] for s in states] for arg, key in keys.items()
                if states and states[0][key].dtype == torch.uint8}

    def _clip_args(self, group: dict, device) -> dict:
        """The kernel's clipping arguments for one bucket (NOTE: [Clipping inside the step])."""
        max_norm = float(group.get("max_grad_norm", 0.0))
        if max_norm <= 0 or self._step_grad_norm is None:
            return {}
        return {"grad_norm": self._on(self._step_grad_norm, device), "max_grad_norm": max_norm}

    @staticmethod
    def _grad_like(p: Tensor, g: Tensor) -> Tensor:
        # The kernels walk a parameter and its gradient in the same memory order.
        return g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)

    @staticmethod
    def _on(t: Tensor | None, device) -> Tensor | None:
        if t is None:
            return None
        return t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)

    def _launch(self, group, params, grads, masters, states, lr, grad_scale, found_inf):
        raise NotImplementedError  # each fused optimizer defines its kernel call

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """As torch's, with storage dtypes in param_groups by name ("bfloat16"), which every
        checkpointer takes (torch.distributed.checkpoint's gather does not take torch.dtype)."""
        watch.settle_loads(self)
        take_fp32_masters(self)
        sd = super().state_dict()
        masters_to_save(self, sd["state"])
        sd["param_groups"] = [{k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype)
                               else v for k, v in g.items()} for g in sd["param_groups"]]
        # Whether a group keeps 8-bit moments, and how (_checkpoint_check.EIGHT_BIT_LAYOUT): in
        # every group that can, as torch.distributed.checkpoint loads the loading side's keys.
        for saved, own in zip(sd["param_groups"], self.param_groups):
            if "exp_avg_dtype" in own or "momentum_dtype" in own:
                sharded = any(is_sharded(p) for p in own["params"])
                saved[EIGHT_BIT_LAYOUT] = (("rows" if sharded else "flat") if torch.uint8 in
                                           (own.get(k) for k in LEAN_KEYS) else None)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, except that fp32 state (moments, step counts, master weights) stays fp32
        and is copied bit for bit, and a torch.optim state dict of the same family loads too."""
        check_loadable(self, state_dict)  # a damaged checkpoint is refused before any change
        watch.settle_loads(self)  # (an earlier load's joins for weights that arrived since)
        saved_state = state_dict["state"]
        # amp O2 over this optimizer in a wrapper: its store's masters stand in the groups, and
        # the store's load hook takes their saved values
        keys = FP32_STATE_KEYS if store_of(self) is None else tuple(
            k for k in FP32_STATE_KEYS if k not in (MASTER_KEY, REMAINDER_KEY))
        fp32 = {pid: {k: v for k, v in st.items() if k in keys and v is not None}
                for pid, st in saved_state.items()}
        stripped = dict(state_dict)
        stripped["state"] = {pid: {k: v for k, v in st.items() if k not in keys}
                             for pid, st in saved_state.items()}
        # Apex's fused optimizers count steps per group (group["step"]): each parameter of the
        # group continues from that count (bias correction), instead of restarting at 1.
        groups = []
        for group in state_dict["param_groups"]:
            if "step" in group and group["step"] is not None:
                for pid in group["params"]:
                    if pid in saved_state:
                        fp32.setdefault(pid, {}).setdefault("step", group["step"])
                group = {k: v for k, v in group.items() if k != "step"}
            groups.append(group)
        stripped["param_groups"] = groups
        # The storage of the state is this optimizer's choice, not the checkpoint's: a checkpoint
        # saved with fp32 state loads into a lean optimizer (and back), converted below.
        storage = [{k: g[k] for k in LEAN_KEYS if k in g} for g in self.param_groups]
        kept = masters_before_load(self)
        via_torch = written_by_torch(state_dict["param_groups"])
        super().load_state_dict(stripped)
        own_keys = getattr(self, "_group_keys", tuple(self.defaults))
        for group, own in zip(self.param_groups, storage):
            group.update(own)
            self._translate_torch_group(group)  # a torch.optim checkpoint lacks our own options
            for key in own_keys:
                if key in self.defaults:
                    group.setdefault(key, self.defaults[key])
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        id_to_param = dict(zip(saved_ids, params))
        joined = {}  # parameter -> the remainder its fp32 master was joined from
        for pid, entries in fp32.items():
            p = id_to_param.get(pid)
            if p is None:
                continue
            state, group = self.state[p], self._group_of(p)
            for key, value in entries.items():
                if key in (MASTER_KEY, REMAINDER_KEY) or key in SCALE_KEYS:
                    continue  # below: the masters follow this optimizer's choice
                if isinstance(value, Tensor) and key in MOMENT_KEYS:
                    load_moment(state, key, value, entries.get(scale_key(key)),
                                self._state_dtype(group, key, p), p)
                elif isinstance(value, Tensor):  # 'step', Adagrad's 'sum': fp32, bit for bit
                    value = value.reshape(()) if key == "step" and value.numel() == 1 else value
                    state[key] = value.to(device=p.device, dtype=torch.float32, copy=True)
                else:  # a Python number (older torch 'step', Apex's group step)
                    state[key] = torch.tensor(float(value), dtype=torch.float32, device=p.device)
            if MASTER_KEY in entries or REMAINDER_KEY in entries or p not in kept:
                kept.pop(p, None)
            else:  # (a torch.optim or Apex checkpoint: the masters made from the model stay)
                entries = {**entries, MASTER_KEY: kept_master(p, kept[p])}
            joined[p] = load_master(self, p, state, group, entries, via_torch)
            self._complete_loaded_state(p, state)
        for p in kept.keys() - joined.keys():  # (no state in the checkpoint)
            load_master(self, p, self.state[p], self._group_of(p),
                        {MASTER_KEY: kept_master(p, kept[p])})
        for p in (p for g in self.param_groups for p in g["params"] if p in self.state):
            if not is_sharded(p):  # (the checkpoint's layout becomes p's)
                follow_layout(p, self.state[p])
        note_storage(self)
        masters_loaded(self, joined, kept, via_torch)

    def _translate_torch_group(self, group: dict) -> None:
        """Hook: map a torch.optim param group's options onto ours (before defaults fill in)."""

    def _complete_loaded_state(self, p: Tensor, state: dict) -> None:
        """Fill what a torch.optim checkpoint lacks (a master copy, a step count)."""
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if state["step"].dim() != 0:
            state["step"] = state["step"].reshape(())
        master_in_state(self, p, state)


# Under torch.compile the step runs as it is (its bookkeeping by parameter identity would
# recompile once per parameter) and its fused ops do the work: one graph break. torch's lazy
# torch.compiler.disable (as torch.optim uses it) spares an eager run Dynamo's import (a second);
# not on step itself: torch 2.10 compiles a bound method without its self then.
_EAGER_FUSED_STEP = torch._disable_dynamo(FusedOptimizer._fused_step)


# What a constructor sets beside torch's attributes, kept through pickling and deepcopy.
_CONSTRUCTOR_ATTRIBUTES = ("master_weights", "set_grad_none", "store_unscaled_grads",
                           "_group_keys", "reduced_precision_dtype", "_initial_step",
                           "_storage_seen")
_EXP_AVG_SCALE, _MOMENTUM_SCALE = scale_key("exp_avg"), scale_key("momentum_buffer")
_MASTER_GRADS = "master_grads"  # a bucket whose masters carry fp32 gradients to step with
