"""O2 master weights: fp32 masters in param_groups, model refresh, add_param_group, optimizer state dicts."""
import copy
import warnings

import pytest
import torch
from torch import nn

from peak import amp
from peak.amp._amp_state import _amp_state

import amp_helpers as H

LOWS = [pytest.param(d, id=n) for n, d in H.DTYPES.items()]


def _o2(low, opt_cls=torch.optim.SGD, seed=0, **opt_kwargs):
    model = H.make_cnn(seed)
    opt_kwargs.setdefault("lr", 0.05)
    opt = opt_cls(model.parameters(), **opt_kwargs)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=low, verbosity=0)
    return model, opt


def _step(model, opt, step, scaled=True):
    x, y = H.batch(step, n=8, shape=(3, 6, 6))
    opt.zero_grad()
    if not scaled:  # (a bf16 model without amp)
        nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
        return opt.step()
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled_loss:
        scaled_loss.backward()
    opt.step()


@pytest.mark.parametrize("low", LOWS)
def test_masters_replace_low_params_in_param_groups(low):
    model = H.make_cnn()
    fp32_values = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=low, verbosity=0)
    masters = list(amp.master_params(opt))
    assert all(a is b for a, b in zip(masters, opt.param_groups[0]["params"]))
    for p, m, v in zip(model.parameters(), masters, fp32_values):
        assert m.dtype == torch.float32 and m.requires_grad
        if p.dtype == torch.float32:  # batch norm: its own master
            assert m is p
        else:
            assert m is not p and p.dtype == low
            assert torch.equal(m, v)  # the master starts as the exact fp32 weight
            assert torch.equal(p, v.to(low))


@pytest.mark.parametrize("low", LOWS)
def test_o2_training_equals_manual_master_weight_loop(low):
    """Reference: a hand-cast model (conv/linear low, BN fp32), fp32 masters kept by hand, torch SGD on
    the masters, grads divided by the scale, model refreshed with master.to(low)."""
    model = H.make_cnn()
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.to(low)
    # masters start as the exact fp32 weights
    ref_masters = [nn.Parameter(q.detach().clone()) if p.dtype == low else p
                   for p, q in zip(ref.parameters(), model.parameters())]
    ref_opt = torch.optim.SGD(ref_masters, lr=0.05, momentum=0.9, weight_decay=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=low, verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    for step in range(4):
        S = scaler.loss_scale()
        _step(model, opt, step)
        x, y = H.batch(step, n=8, shape=(3, 6, 6))
        ref_opt.zero_grad()
        ref.zero_grad()
        (nn.functional.cross_entropy(ref(x.to(low)).float(), y) * S).backward()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), ref_masters):
                m.grad = p.grad.float() / S if m is not p else p.grad / S
            ref_opt.step()
            for p, m in zip(ref.parameters(), ref_masters):
                if m is not p:
                    p.copy_(m)
    for a, b in zip(amp.master_params(opt), ref_masters):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("low", LOWS)
def test_add_param_group_after_initialize(low):
    def run(late):
        m0, m1 = H.make_mlp(1), H.make_mlp(2)
        with torch.no_grad():  # masters made by a late add_param_group start from the low-precision weights
            for p in m1.parameters():
                p.copy_(p.to(low))
        groups = [{"params": list(m0.parameters())}]
        if not late:
            groups.append({"params": list(m1.parameters()), "lr": 0.01})
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        amp.initialize([m0, m1], opt, opt_level="O2", cast_model_type=low, verbosity=0)
        if late:
            opt.add_param_group({"params": m1.parameters(), "lr": 0.01})
        for step in range(3):
            x, y = H.batch(step, n=8, shape=(6,))
            opt.zero_grad()
            loss = nn.functional.cross_entropy((m0(x) + m1(x)).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        return m0, m1, opt

    late = run(True)
    early = run(False)
    assert all(p.dtype == torch.float32 for p in late[2].param_groups[1]["params"])
    for a, b in zip(list(late[0].parameters()) + list(late[1].parameters()),
                    list(early[0].parameters()) + list(early[1].parameters())):
        assert a.dtype == low and torch.equal(a, b)
    H.assert_bitwise_equal(list(amp.master_params(late[2])), list(amp.master_params(early[2])))


def test_add_param_group_error_leaves_nothing_registered():
    m0 = H.make_mlp(1)
    opt = torch.optim.SGD(m0.parameters(), lr=0.1)
    amp.initialize(m0, opt, opt_level="O2", verbosity=0)
    n = len(opt._amp_stash.masters)
    with pytest.raises(ValueError):  # torch: a parameter may appear in one group only
        opt.add_param_group({"params": [m0[0].weight]})
    assert len(opt._amp_stash.masters) == n and len(opt.param_groups) == 1
    with pytest.raises(TypeError, match="Please use a list instead"):
        opt.add_param_group({"params": {m0[0].weight}})


@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
@pytest.mark.parametrize("low", LOWS)
def test_optimizer_state_dict_restores_masters_bit_for_bit(low, order):
    model, opt = _o2(low, torch.optim.Adam, lr=1e-2)
    for step in range(3):
        _step(model, opt, step)
    sd = opt.state_dict()
    masters = list(amp.master_params(opt))
    saved = {i: st["master_param"] for i, st in sd["state"].items() if "master_param" in st}
    assert set(saved) == {i for i, m in enumerate(masters) if m.dtype == torch.float32
                          and any(m is s for s in opt._amp_stash.masters)}
    assert any(not torch.equal(m.to(low).float(), m) for m in saved.values())  # masters hold more bits
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": sd, "amp": amp.state_dict()})

    model2, opt2 = _o2(low, torch.optim.Adam, seed=1, lr=1e-2)
    if order == "model_first":
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
    else:
        opt2.load_state_dict(ckpt["opt"])
        model2.load_state_dict(ckpt["model"])
    amp.load_state_dict(ckpt["amp"])
    H.assert_bitwise_equal(list(amp.master_params(opt2)), masters)
    H.assert_bitwise_equal(H.snapshot(model2, opt2), H.snapshot(model, opt))
    # and training continues identically (the first run's objects are stale now, so re-run it fresh)
    for step in range(3, 5):
        _step(model2, opt2, step)
    reference_model, reference_opt = _o2(low, torch.optim.Adam, lr=1e-2)
    for step in range(5):
        _step(reference_model, reference_opt, step)
    H.assert_bitwise_equal(H.snapshot(model2, opt2), H.snapshot(reference_model, reference_opt))


def test_loading_new_model_weights_refreshes_masters():
    model, opt = _o2(torch.float16)
    other = H.make_cnn(seed=7)
    model.load_state_dict(other.state_dict())
    for p, m, q in zip(model.parameters(), amp.master_params(opt), other.parameters()):
        if p.dtype == torch.float16:
            assert torch.equal(m, q.detach())  # the fp32 weights loaded, exactly
        assert torch.equal(p.float(), q.detach().to(p.dtype).float())
    _step(model, opt, 0)  # the step starts from the loaded weights, not the old masters
    assert torch.allclose(model[0].weight.float(), other[0].weight, atol=0.2)


@pytest.mark.parametrize("low,opt_name", [
    *[pytest.param(d, name, id=f"{n}-{name}") for n, d in H.DTYPES.items()
      for name in ("SGD", "FusedSGD", "FusedAdam")],
    pytest.param(torch.bfloat16, "FusedAdam_remainders", id="bf16-FusedAdam_remainders")])
def test_a_write_through_data_before_the_first_step_is_trained_from(low, opt_name):
    """Apex makes its masters at the first scale_loss, so weights set through ``.data`` after
    initialize (pretrained vectors, a custom init) are what trains: the same run as with those
    weights set before initialize, bit for bit (a remainder joins the written weight with its
    old low bits: within an ulp of it)."""
    from peak.optimizers import FusedAdam, FusedSGD

    make = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            "FusedSGD": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
            "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3),
            "FusedAdam_remainders": lambda ps: FusedAdam(ps, lr=1e-3,
                                                         store_param_remainders=True)}[opt_name]
    pretrained = torch.randn_like(H.make_cnn(0)[0].weight).to(low).float()  # (representable)
    runs = []
    for before in (True, False):
        model = H.make_cnn(0)
        if before:
            model[0].weight.data.copy_(pretrained)
        opt = make(model.parameters())
        amp.initialize(model, opt, opt_level="O2", cast_model_type=low, verbosity=0)
        if not before:
            model[0].weight.data.copy_(pretrained)
        for step in range(3):
            _step(model, opt, step)
        runs.append(H.snapshot(model, opt) if opt_name != "FusedAdam_remainders"
                    else [p.detach().float() for p in model.parameters()])
    if opt_name == "FusedAdam_remainders":
        for a, b in zip(*runs):
            # (an Adam step moves an element by at most about lr, whatever its gradient)
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=3e-3)
    else:
        H.assert_bitwise_equal(*runs)


@pytest.mark.parametrize("opt_name", ["Adam", "FusedAdam", "FusedSGD", "FusedAdam-no-amp"])
@pytest.mark.parametrize("write", ["prune", "vector_to_parameters"])
def test_a_weight_given_new_memory_after_steps_is_followed(opt_name, write):
    """torch's ``prune.remove`` and ``vector_to_parameters`` write ``p.data = ...`` (new memory,
    no version bump): the masters follow it as they follow the same values written in place
    (before, the next step put the pruned weights back from the masters, even at lr=0)."""
    from torch.nn.utils import parameters_to_vector, prune, vector_to_parameters
    from peak.optimizers import FusedAdam, FusedSGD

    make = {"Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
            "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2),
            "FusedAdam-no-amp": lambda ps: FusedAdam(ps, lr=1e-2),
            "FusedSGD": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9)}[opt_name]
    runs = []
    for in_place in (False, True):
        model = H.make_cnn(0)
        opt = make(model.parameters())
        if opt_name == "FusedAdam-no-amp":
            model.to(torch.bfloat16)
        else:
            amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                           verbosity=0)
        for step in range(2):
            _step(model, opt, step, scaled=opt_name != "FusedAdam-no-amp")
        conv = model[0]
        if write == "prune":
            prune.l1_unstructured(conv, "weight", amount=0.5)
            mask = conv.weight_mask.clone()
            if in_place:
                prune.remove(conv, "weight")  # (back to a plain parameter, then in place)
                with torch.no_grad():
                    conv.weight.copy_(conv.weight.detach() * mask)
            else:
                prune.remove(conv, "weight")
        else:
            params = list(conv.parameters())  # (one dtype: the vector's)
            values = parameters_to_vector(params).mul(0.5)
            if in_place:
                with torch.no_grad():
                    offset = 0
                    for p in params:
                        p.copy_(values[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
            else:
                vector_to_parameters(values, params)
        written = [p.detach().clone() for p in model.parameters()]
        lrs = [group["lr"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["lr"] = 0.0
        _step(model, opt, 2, scaled=opt_name != "FusedAdam-no-amp")
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), written))
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        for step in range(3, 5):
            _step(model, opt, step, scaled=opt_name != "FusedAdam-no-amp")
        runs.append([p.detach().clone() for p in model.parameters()])
    H.assert_bitwise_equal(*runs)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_model_and_master_grads(set_to_none):
    model, opt = _o2(torch.float16)
    x, y = H.batch(0, n=8, shape=(3, 6, 6))
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in list(model.parameters()) + list(amp.master_params(opt)):
        assert p.grad is None if set_to_none else (p.grad is None or not p.grad.any())


def test_lr_scheduler_created_after_initialize():
    model, opt = _o2(torch.float16)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for step in range(2):
            _step(model, opt, step)
            sched.step()
    assert opt.param_groups[0]["lr"] == 0.05 * 0.25


def test_closure():
    model, opt = _o2(torch.float16)
    assert opt.step(lambda: 0.0) == 0.0  # run first, then the step (closures with scale_loss:
    m = H.make_mlp()                      # tests/amp/test_user_paths.py)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", verbosity=0)
    assert o.step(lambda: torch.tensor(3.0)) == 3.0  # O1 passes closures through


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
                                     torch.optim.SGD], ids=lambda c: c.__name__)
def test_any_torch_optimizer(opt_cls):
    model, opt = _o2(torch.bfloat16, opt_cls, lr=1e-3)
    for step in range(2):
        _step(model, opt, step)
    for p, m in zip(model.parameters(), amp.master_params(opt)):
        assert torch.equal(p, m.to(p.dtype))
        for v in opt.state[m].values():
            if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                assert v.dtype == torch.float32


def test_clip_grad_norm_on_master_params():
    model, opt = _o2(torch.float16)
    x, y = H.batch(0, n=8, shape=(3, 6, 6))
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    total = nn.utils.clip_grad_norm_(amp.master_params(opt), 1e-3)
    assert 1e-3 < total < 1e3  # the unscaled norm, not the scaled one
    norm = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in amp.master_params(opt)]))
    assert norm <= 1e-3 * 1.001


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("opt_name", ["FusedAdam", "Adam"])
def test_reading_master_params_without_gradients_changes_nothing(opt_name, set_to_none):
    """amp.master_params(opt) where no gradient exists (right after initialize; after zero_grad,
    for an EMA or a log) yields the weights and leaves the next step as it would have been: the
    same bits as a run that never read them, with peak's fused optimizers as with torch's. After
    zero_grad(set_to_none=False) the zeroed gradients it may give the masters are dropped by the
    next scale_loss (no backward handed them over)."""
    from peak.optimizers import FusedAdam

    opt_cls = FusedAdam if opt_name == "FusedAdam" else torch.optim.Adam

    def train(read):
        model, opt = _o2(torch.bfloat16, opt_cls, lr=1e-2)
        ema = [m.detach().clone() for m in amp.master_params(opt)] if read else None
        for step in range(3):  # (no zero_grad between a read and the next scale_loss)
            x, y = H.batch(step, n=8, shape=(3, 6, 6))
            with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            if read:
                ema = [0.9 * e + 0.1 * m.detach() for e, m in zip(ema, amp.master_params(opt))]
        return H.snapshot(model, opt)

    H.assert_bitwise_equal(train(read=True), train(read=False))


def test_existing_optimizer_state_moves_to_masters():
    model = H.make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = H.batch(0, n=8, shape=(3, 6, 6))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    momenta = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for m, buf in zip(amp.master_params(opt), momenta):
        assert torch.equal(opt.state[m]["momentum_buffer"], buf)


def test_earlier_amp_layout_still_loads():
    """amp wrote its masters as a top-level {flat index: master} ("amp_master_params") before
    they had one owner: such a checkpoint restores the masters bit for bit."""
    model, opt = _o2(torch.float16, torch.optim.Adam, lr=1e-2)
    for step in range(2):
        _step(model, opt, step)
    sd = copy.deepcopy(opt.state_dict())
    earlier = {"state": {}, "param_groups": sd["param_groups"], "amp_master_params": {}}
    for i, st in sd["state"].items():
        st = dict(st)
        if "master_param" in st:
            earlier["amp_master_params"][i] = st.pop("master_param")
        earlier["state"][i] = st
    assert earlier["amp_master_params"]
    model2, opt2 = _o2(torch.float16, torch.optim.Adam, seed=3, lr=1e-2)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(earlier)
    H.assert_bitwise_equal(H.snapshot(model2, opt2), H.snapshot(model, opt))


@pytest.mark.parametrize("direction", ["fused_to_torch", "torch_to_fused"])
def test_one_layout_cross_loads_between_fused_and_torch_optimizers(direction):
    """peak's fused optimizers and amp over a torch optimizer write the same layout
    (state[i]["master_param"] beside the moments): each loads the other's, masters bit for bit."""
    from peak.optimizers import FusedAdam

    src_cls, dst_cls = ((FusedAdam, torch.optim.Adam) if direction == "fused_to_torch"
                        else (torch.optim.Adam, FusedAdam))
    model, opt = _o2(torch.float16, src_cls, lr=1e-2)
    for step in range(2):
        _step(model, opt, step)
    sd = copy.deepcopy(opt.state_dict())
    saved = {i: st["master_param"] for i, st in sd["state"].items() if "master_param" in st}
    assert saved and all(
        {"exp_avg", "exp_avg_sq", "step"} <= set(sd["state"][i]) for i in saved)
    model2, opt2 = _o2(torch.float16, dst_cls, seed=3, lr=1e-2)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    sd2 = opt2.state_dict()
    for i, master in saved.items():
        H.assert_bitwise_equal(sd2["state"][i]["master_param"], master)
        H.assert_bitwise_equal(sd2["state"][i]["exp_avg"], sd["state"][i]["exp_avg"])
    # The torch layout saves masters as Parameters: loaded, they are plain state (no autograd
    # history that would warn at every step and refuse a deepcopy).
    assert all(not v.requires_grad and v.grad_fn is None for st in opt2.state.values()
               for v in st.values() if isinstance(v, torch.Tensor))
    copy.deepcopy(opt2.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model2, opt2, 2)  # and it steps
    assert all(torch.isfinite(p).all() for p in model2.parameters())


def test_loading_new_model_weights_refreshes_a_fused_optimizers_masters():
    """amp O2 + a peak fused optimizer keeps the masters in the optimizer's state: a model
    reloaded after initialize (without an optimizer checkpoint) re-derives them, as a store's, so
    the first step starts from the loaded weights instead of undoing the load."""
    from peak.optimizers import FusedAdam

    model, opt = _o2(torch.float16, FusedAdam, lr=1e-3)
    other = H.make_cnn(seed=7)
    model.load_state_dict(other.state_dict())
    _step(model, opt, 0)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.allclose(p.float(), q.detach(), atol=5e-2), "the step undid the load"


@pytest.mark.parametrize("order", ["model_first", "optimizer_first", "model_only"])
def test_remainder_masters_after_a_model_reload(order):
    """Remainder-kept masters (bf16 + FusedAdam(store_param_remainders=True)) after
    model.load_state_dict: a checkpoint of model and optimizer restores the exact masters in
    either order; a model alone (new weights, no optimizer state) re-splits them from the loaded
    fp32 values, exactly, so the first step starts from the loaded weights."""
    from peak.optimizers import FusedAdam

    def build(seed):
        model = H.make_cnn(seed)
        opt = FusedAdam(model.parameters(), lr=1e-2, store_param_remainders=True)
        amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
        return model, opt

    model, opt = build(0)
    for step in range(3):
        _step(model, opt, step)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    exact = {n: opt.master_of(p).clone() for n, p in model.named_parameters()
             if opt.master_of(p) is not None}
    model2, opt2 = build(1)
    _step(model2, opt2, 0)  # (its own remainders, which a reload must not keep)
    if order == "model_first":
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
    elif order == "optimizer_first":
        opt2.load_state_dict(ckpt["opt"])
        model2.load_state_dict(ckpt["model"])
    if order != "model_only":
        for n, p in model2.named_parameters():
            if n in exact:
                H.assert_bitwise_equal(opt2.master_of(p), exact[n], n)
        return
    other = H.make_cnn(seed=7)  # fp32 weights
    model2.load_state_dict(other.state_dict())
    for (n, p), q in zip(model2.named_parameters(), other.parameters()):
        if p.dtype == torch.bfloat16 and "master_param_remainder" in opt2.state.get(p, {}):
            H.assert_bitwise_equal(opt2.master_of(p), q.detach(), n)  # the loaded fp32, exactly


@pytest.mark.parametrize("scale", [128.0, "dynamic"])
def test_parameter_frozen_at_initialize_then_unfrozen_is_stepped_through_a_master(scale):
    """Gradual unfreezing: a layer frozen at initialize gets its master (or, fp32 batch norm,
    its unscaled gradient) at the first backward that reaches it, not the scaled gradient."""
    model, ref = H.make_cnn(), H.make_cnn()
    for m in (model, ref):
        m[0].requires_grad_(False)
        m[1].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.float16, loss_scale=scale,
                   verbosity=0)
    _step(model, opt, 0)
    for m in (model, ref):
        m[0].requires_grad_(True)
        m[1].requires_grad_(True)
    before = [p.detach().float().clone() for p in list(model[0].parameters()) + list(model[1].parameters())]
    _step(model, opt, 1)
    x, y = H.batch(1, n=8, shape=(3, 6, 6))
    ref_opt.zero_grad()
    nn.functional.cross_entropy(ref(x), y).backward()
    moved = [p.detach().float() - b for p, b in
             zip(list(model[0].parameters()) + list(model[1].parameters()), before)]
    expected = [-0.05 * p.grad for p in list(ref[0].parameters()) + list(ref[1].parameters())]
    for got, want in zip(moved, expected):  # fp16 forward and rounding: a few percent
        torch.testing.assert_close(got, want, rtol=0.1, atol=2e-3)
    assert all(m.dtype == torch.float32 for m in amp.master_params(opt))  # (none left fp16)


@pytest.mark.parametrize("how", ["Adagrad", "fp32-checkpoint"])
def test_state_of_a_parameter_frozen_at_initialize_is_fp32_on_its_master(how):
    """initialize (as Apex) or a load casts a frozen weight's state to its dtype: unfrozen, its
    master steps with that state widened to fp32, as every master's (Adagrad makes its state in
    its constructor: the bf16 sum was silently stepped; a loaded fp32 checkpoint's bf16 Adam
    moments made the step raise)."""
    def build():
        model = H.make_cnn(0)
        model[0].bias.requires_grad_(False)
        if how == "Adagrad":
            opt = torch.optim.Adagrad(model.parameters(), lr=0.05, initial_accumulator_value=0.1)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, opt

    model, opt = build()
    if how == "fp32-checkpoint":  # (a plain fp32 run's checkpoint, the bias trained there)
        fp32_model, fp32_opt = H.make_cnn(0), None
        fp32_opt = torch.optim.Adam(fp32_model.parameters(), lr=1e-2)
        x, y = H.batch(0, n=8, shape=(3, 6, 6))
        nn.functional.cross_entropy(fp32_model(x), y).backward()
        fp32_opt.step()
    amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    if how == "fp32-checkpoint":
        model.load_state_dict(fp32_model.state_dict())
        opt.load_state_dict(fp32_opt.state_dict())
    _step(model, opt, 0)
    model[0].bias.requires_grad_(True)
    _step(model, opt, 1)
    for master in amp.master_params(opt):
        for value in opt.state[master].values():
            assert not value.is_floating_point() or value.dtype == torch.float32
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.SGD])
def test_zero_grad_keeping_tensors_steps_unused_parameters_as_torch(opt_cls):
    """zero_grad(set_to_none=False): a parameter without a gradient in a step keeps a zero one,
    and torch's optimizer steps it (momentum, Adam's moments), at O2 as in fp32 (O0)."""
    kw = {"lr": 0.01} if opt_cls is torch.optim.Adam else {"lr": 0.05, "momentum": 0.9}
    runs = {}
    for level in ("O0", "O2"):
        _amp_state.reset()
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        opt = opt_cls(model.parameters(), **kw)
        amp.initialize(model, opt, opt_level=level, loss_scale=1.0, verbosity=0,
                       **({"cast_model_type": torch.bfloat16} if level == "O2" else {}))
        weights = []
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            out = model["a"](x.to(model["a"].weight.dtype))
            if step == 0:  # b gets a gradient at step 0 only
                out = model["b"](out)
            with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            weights.append(model["b"].weight.detach().float().clone())
        runs[level] = weights
    for level, weights in runs.items():  # b moves at steps 1 and 2 too, by its momentum
        assert not torch.equal(weights[1], weights[0]) and not torch.equal(weights[2], weights[1]), level
    torch.testing.assert_close(runs["O2"][2], runs["O0"][2], rtol=0, atol=4e-3)  # bf16 rounding


def _o2_linear(opt_cls=torch.optim.AdamW, seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = opt_cls(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, loss_scale=1.0,
                   verbosity=0)
    return model, opt


def _train_o2(model, opt, steps):
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        with amp.scale_loss((model(x.bfloat16()).float() - y).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()


def test_a_stale_master_does_not_overwrite_the_model_loaded_before_it():
    """O2 over a torch optimizer: a checkpoint trained on in plain fp32 torch (which keeps the
    'master_param' entries as they were) resumes with the weights it reached, in the documented
    order (model, then optimizer)."""
    model, opt = _o2_linear()
    _train_o2(model, opt, range(3))
    plain = nn.Linear(4, 2)
    plain.load_state_dict(model.state_dict())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.1)
    plain_opt.load_state_dict(opt.state_dict())
    for i in range(3, 8):
        g = torch.Generator().manual_seed(i)
        plain_opt.zero_grad()
        (plain(torch.randn(8, 4, generator=g)) - torch.randn(8, 2, generator=g)).pow(2).mean().backward()
        plain_opt.step()
    assert "master_param" in plain_opt.state_dict()["state"][0]  # (stale: torch kept it)
    _amp_state.reset()
    resumed, resumed_opt = _o2_linear(seed=1)
    resumed.load_state_dict(plain.state_dict())
    resumed_opt.load_state_dict(plain_opt.state_dict())
    for p, q, m in zip(resumed.parameters(), plain.parameters(), amp.master_params(resumed_opt)):
        H.assert_bitwise_equal(p.detach(), q.detach().to(torch.bfloat16))
        assert torch.equal(m, q.detach())  # the fp32 weights loaded, exactly


def _larc_fused_adam(params, lr):
    from peak.optimizers import LARC, FusedAdam
    return LARC(FusedAdam(params, lr=lr))


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, _larc_fused_adam],
                         ids=["AdamW", "LARC(FusedAdam)"])
def test_a_remainder_checkpoint_loads_into_o2_over_a_torch_optimizer_and_back(opt_cls):
    """A fused optimizer's remainder masters (store_param_remainders=True) join with the weights
    into exact fp32 masters of a torch optimizer under O2 (or of a fused one in a wrapper, whose
    masters amp's store keeps: it refused them), in either load order, and its checkpoint loads
    back into the remainder optimizer."""
    from peak.optimizers import FusedAdam
    from peak.optimizers.masters import join_remainder, masters_by_param
    torch.manual_seed(0)
    model = nn.Linear(4, 2).bfloat16()
    fused = FusedAdam(model.parameters(), lr=0.1, store_param_remainders=True)
    for i in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).bfloat16()
        fused.step()
    exact = [join_remainder(p.detach(), fused.state[p]["master_param_remainder"]).clone()
             for p in model.parameters()]
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": fused.state_dict()})
    for model_first in (True, False):
        _amp_state.reset()
        o2, o2_opt = _o2_linear(opt_cls, seed=3)
        if model_first:
            o2.load_state_dict(ckpt["model"])
        o2_opt.load_state_dict(ckpt["opt"])
        if not model_first:
            o2.load_state_dict(ckpt["model"])
        for m, e in zip(amp.master_params(o2_opt), exact):
            H.assert_bitwise_equal(m.detach(), e)
        assert all("master_param_remainder" not in s for s in o2_opt.state.values())
        assert len(masters_by_param(o2_opt)) == 2
    back = FusedAdam(model.parameters(), lr=0.1, store_param_remainders=True)
    back.load_state_dict(o2_opt.state_dict())
    for p, e in zip(model.parameters(), exact):
        H.assert_bitwise_equal(join_remainder(p.detach(), back.state[p]["master_param_remainder"]), e)


def test_a_remainder_checkpoint_into_larc_fused_adam_over_fp16_weights_is_refused_whole():
    """A remainder needs the bf16 weight it completes: into LARC(FusedAdam) under O2 with fp16
    weights (amp's store keeps the masters) it is refused, naming the remainder, and nothing of
    the optimizer's state changes."""
    from peak.optimizers import FusedAdam
    torch.manual_seed(0)
    model = nn.Linear(4, 2).bfloat16()
    fused = FusedAdam(model.parameters(), lr=0.1, store_param_remainders=True)
    for p in model.parameters():
        p.grad = torch.randn(p.shape).bfloat16()
    fused.step()
    ckpt = copy.deepcopy(fused.state_dict())
    _amp_state.reset()
    torch.manual_seed(3)
    o2 = nn.Linear(4, 2)
    o2_opt = _larc_fused_adam(o2.parameters(), lr=0.1)
    amp.initialize(o2, o2_opt, opt_level="O2", cast_model_type=torch.float16, loss_scale=1.0,
                   verbosity=0)
    masters_before = [m.detach().clone() for m in amp.master_params(o2_opt)]
    before = copy.deepcopy(o2_opt.state_dict())
    with pytest.raises(RuntimeError, match="a remainder master .* a bf16 weight needed"):
        o2_opt.load_state_dict(ckpt)
    after = o2_opt.state_dict()
    assert before["state"].keys() == after["state"].keys()
    for m, b in zip(amp.master_params(o2_opt), masters_before):
        H.assert_bitwise_equal(m.detach(), b)


def _frozen_then_unfrozen(seed):
    _amp_state.reset()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, loss_scale=1.0,
                   verbosity=0)
    return model, opt


def test_a_run_resumed_after_an_unfreeze_continues_bit_for_bit():
    """The checkpoint has a master for a parameter the resumed script froze at initialize: it
    gets its master before torch loads the state (Adam's moments onto it, in fp32)."""
    model, opt = _frozen_then_unfrozen(0)
    _train_o2(model, opt, range(2))
    model[0].requires_grad_(True)
    _train_o2(model, opt, range(2, 4))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    _train_o2(model, opt, range(4, 6))
    resumed, resumed_opt = _frozen_then_unfrozen(1)
    resumed[0].requires_grad_(True)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    assert all(v.dtype == torch.float32 for s in resumed_opt.state.values() for v in s.values()
               if v.is_floating_point())
    _train_o2(resumed, resumed_opt, range(4, 6))
    for p, q in zip(resumed.parameters(), model.parameters()):
        H.assert_bitwise_equal(p.detach(), q.detach())


def test_a_frozen_parameter_cannot_join_a_second_group():
    model, opt = _frozen_then_unfrozen(0)
    model[0].requires_grad_(True)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[0].weight], "lr": 0.0})


def test_the_bypass_warning_with_zero_grad_keeping_tensors():
    """A plain loss.backward() under O2 warns at step() also when zero_grad(set_to_none=False)
    left zero gradients on the masters."""
    model, opt = _o2(torch.bfloat16, momentum=0.9)
    _step(model, opt, 0)
    opt.zero_grad(set_to_none=False)
    x, y = H.batch(1, n=8, shape=(3, 6, 6))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match="run the backward pass as"):
        opt.step()


def test_a_remainder_with_a_rounding_tie_joins_exactly_in_either_order():
    """A master whose low half is exactly 0x8000 rounds to nearest even one way and the remainder
    split the other: a join must not be taken for a master of other weights."""
    from peak.optimizers import FusedAdam
    from peak.optimizers.masters import join_remainder
    torch.manual_seed(0)
    model = nn.Linear(64, 64).bfloat16()
    fused = FusedAdam(model.parameters(), lr=1e-3, store_param_remainders=True)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    fused.step()
    with torch.no_grad():  # one exact tie: low half 0x8000, its weight the split's rounding
        tie = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32)
        from peak.optimizers.masters import split_master
        weight, remainder = split_master(tie)
        # (through .data: a seen write would clear the remainder, at the next step and in a save)
        model.weight.data.view(-1)[:1].copy_(weight)
        fused.state[model.weight]["master_param_remainder"].view(-1)[:1].copy_(remainder)
    exact = join_remainder(model.weight.detach(), fused.state[model.weight]["master_param_remainder"])
    assert exact.view(-1)[0].item() == tie.item()
    assert exact.view(-1)[0].to(torch.bfloat16) != model.weight.view(-1)[0]  # (RNE differs)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": fused.state_dict()})
    for model_first in (True, False):
        _amp_state.reset()
        torch.manual_seed(3)
        o2 = nn.Linear(64, 64)
        o2_opt = torch.optim.AdamW(o2.parameters(), lr=0.1)
        amp.initialize(o2, o2_opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
        if model_first:
            o2.load_state_dict(ckpt["model"])
        o2_opt.load_state_dict(ckpt["opt"])
        if not model_first:
            o2.load_state_dict(ckpt["model"])
        H.assert_bitwise_equal(next(iter(amp.master_params(o2_opt))).detach(), exact)


def test_a_partial_model_load_leaves_the_other_masters_to_the_optimizer_checkpoint():
    """model.load_state_dict(strict=False) without some weights: the optimizer checkpoint's
    masters of those (not stale: their weights were not loaded) restore them."""
    model, opt = _frozen_then_unfrozen(0)
    model[0].requires_grad_(True)
    _train_o2(model, opt, range(3))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed, resumed_opt = _frozen_then_unfrozen(1)
    resumed[0].requires_grad_(True)
    partial = {k: v for k, v in ckpt["model"].items() if not k.startswith("1.")}
    resumed.load_state_dict(partial, strict=False)
    resumed_opt.load_state_dict(ckpt["opt"])
    for p, q in zip(resumed.parameters(), model.parameters()):
        H.assert_bitwise_equal(p.detach(), q.detach())


@pytest.mark.parametrize("frozen", ["trainable", "unfrozen_before_load", "still_frozen"])
def test_a_stale_master_never_overwrites_loaded_weights_frozen_or_not(frozen):
    model, opt = _frozen_then_unfrozen(0)
    model[0].requires_grad_(True)
    _train_o2(model, opt, range(3))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    new_weight = (ckpt["model"]["0.weight"] + 0.5).bfloat16()  # not the masters' weights
    ckpt["model"]["0.weight"] = new_weight
    resumed, resumed_opt = _frozen_then_unfrozen(1)
    if frozen != "still_frozen":
        resumed[0].requires_grad_(True)
    if frozen == "trainable":
        _amp_state.reset()
        torch.manual_seed(1)
        resumed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
        amp.initialize(resumed, resumed_opt, opt_level="O2", cast_model_type=torch.bfloat16,
                       loss_scale=1.0, verbosity=0)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    H.assert_bitwise_equal(resumed[0].weight.detach(), new_weight)


@pytest.mark.parametrize("damage", ["master_shape", "group_count"])
def test_a_refused_optimizer_load_leaves_frozen_parameters_as_they_were(damage):
    model, opt = _frozen_then_unfrozen(0)
    model[0].requires_grad_(True)
    _train_o2(model, opt, range(2))
    bad = copy.deepcopy(opt.state_dict())
    if damage == "master_shape":
        bad["state"][3]["master_param"] = torch.zeros(5)
    else:
        bad["param_groups"].append(dict(bad["param_groups"][0], params=[99]))
    resumed, resumed_opt = _frozen_then_unfrozen(1)
    groups = [list(g["params"]) for g in resumed_opt.param_groups]
    with pytest.raises((RuntimeError, ValueError)):
        resumed_opt.load_state_dict(bad)
    assert all(a is b for g, h in zip(groups, resumed_opt.param_groups)
               for a, b in zip(g, h["params"]))
    with torch.no_grad():
        resumed[0].weight.fill_(0.25)  # a frozen weight the user sets stays through a step
    _train_o2(resumed, resumed_opt, range(1))
    assert bool((resumed[0].weight == 0.25).all())


@pytest.mark.parametrize("steps", ["stepped", "skipped"])
def test_a_remainder_join_does_not_outlive_the_next_step(steps):
    """A remainder checkpoint loaded model-first queues a join with a later model load only until
    the next step, or its skip: fp32 weights loaded after that make exact masters."""
    from peak.optimizers import FusedAdam
    torch.manual_seed(0)
    src = nn.Linear(16, 16).bfloat16()
    fused = FusedAdam(src.parameters(), lr=1e-3, store_param_remainders=True)
    for p in src.parameters():
        p.grad = torch.randn_like(p)
    fused.step()
    ckpt = copy.deepcopy({"model": src.state_dict(), "opt": fused.state_dict()})
    fp32 = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(7))
            for k, v in src.state_dict().items()}
    _amp_state.reset()
    torch.manual_seed(3)
    model = nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0,
                   loss_scale=1.0 if steps == "stepped" else "dynamic")
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    for i in range(2):
        opt.zero_grad()
        loss = model(torch.randn(4, 16).bfloat16()).float().pow(2).mean()
        with amp.scale_loss(loss * (1.0 if steps == "stepped" else float("inf")), opt) as s:
            s.backward()
        opt.step()
    model.load_state_dict(fp32)
    for m, key in zip(amp.master_params(opt), ("weight", "bias")):
        assert torch.equal(m, fp32[key])


@pytest.mark.parametrize("order", ["model_first", "optimizer_first", "optimizer_only"])
def test_a_fused_optimizers_masters_restore_weights_a_partial_model_load_left_out(order):
    """amp O2 with a peak fused optimizer: its loaded masters refresh the model (as the torch
    optimizer's store does), so weights a strict=False model load left out (or no model load)
    come back from the checkpoint, and the run resumes bit for bit."""
    from peak.optimizers import FusedAdam

    def build(seed):
        _amp_state.reset()
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        opt = FusedAdam(model.parameters(), lr=0.01)
        amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                       loss_scale=1.0, verbosity=0)
        return model, opt

    model, opt = build(0)
    _train_o2(model, opt, range(3))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    _train_o2(model, opt, range(3, 5))
    resumed, resumed_opt = build(1)
    partial = {k: v for k, v in ckpt["model"].items() if not k.startswith("1.")}
    if order == "model_first":
        resumed.load_state_dict(partial, strict=False)
    resumed_opt.load_state_dict(ckpt["opt"])
    if order == "optimizer_first":
        resumed.load_state_dict(partial, strict=False)
    _train_o2(resumed, resumed_opt, range(3, 5))
    for p, q in zip(resumed.parameters(), model.parameters()):
        H.assert_bitwise_equal(p.detach(), q.detach())


def test_a_fused_optimizer_keeps_no_master_for_a_frozen_parameter_until_it_steps_it():
    """Fine-tuning freezes most of a model: no fp32 master for a frozen weight under O2 with a
    fused optimizer either, until it is unfrozen and stepped."""
    from peak.optimizers import FusedAdam
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    opt = FusedAdam(model.parameters(), lr=0.01)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, loss_scale=1.0,
                   verbosity=0)
    assert "master_param" not in opt.state.get(model[0].weight, {})
    assert "master_param" in opt.state[model[1].weight]
    _train_o2(model, opt, range(1))
    assert "master_param" not in opt.state.get(model[0].weight, {})
    model[0].requires_grad_(True)
    _train_o2(model, opt, range(1, 2))
    assert torch.equal(opt.state[model[0].weight]["master_param"].to(torch.bfloat16),
                       model[0].weight.detach())


@pytest.mark.parametrize("world_size", ["1", "2"])
@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
@pytest.mark.parametrize("opt_name", ["FusedAdam", "FusedAdam-remainders", "FusedSGD"])
def test_a_plain_fp32_torch_checkpoint_gives_a_fused_optimizer_exact_masters(opt_name, order,
                                                                              world_size,
                                                                              monkeypatch):
    """A checkpoint of plain fp32 training (torch.optim, no masters in it) resumed under amp O2
    with a peak fused optimizer, in either order: the masters are the checkpoint's fp32 weights,
    bit for bit (the optimizer's load keeps the masters the model load made), also for a
    parameter with no state in the checkpoint; the next step starts from them. In a multi-rank
    run too (a launcher's WORLD_SIZE), where amp made no masters from the model's fp32 weights:
    the model load makes them (docs/distributed.md; they came from the cast weights)."""
    from peak import optimizers as po

    monkeypatch.setenv("WORLD_SIZE", world_size)

    fused_cls = po.FusedSGD if opt_name == "FusedSGD" else po.FusedAdam
    torch_cls = torch.optim.SGD if opt_name == "FusedSGD" else torch.optim.Adam
    extra = {"momentum": 0.9} if opt_name == "FusedSGD" else {}
    low = torch.float16 if opt_name == "FusedSGD" else torch.bfloat16
    ref = H.make_cnn(0)
    frozen = next(p for p in ref.parameters() if p.dim() == 1)
    frozen.requires_grad_(False)  # (no state for it in the checkpoint)
    ropt = torch_cls(ref.parameters(), lr=1e-2, **extra)
    for step in range(2):
        x, y = H.batch(step, n=8, shape=(3, 6, 6))
        ropt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ropt.step()
    frozen.requires_grad_(True)
    ckpt = copy.deepcopy({"model": ref.state_dict(), "opt": ropt.state_dict()})
    model = H.make_cnn(5)
    opt = fused_cls(model.parameters(), lr=1e-2, **extra,
                    store_param_remainders=opt_name.endswith("remainders"))
    amp.initialize(model, opt, opt_level="O2", cast_model_type=low, verbosity=0)
    for load in (["model", "opt"] if order == "model_first" else ["opt", "model"]):
        (model if load == "model" else opt).load_state_dict(ckpt[load])
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.dtype == low:
            H.assert_bitwise_equal(opt.master_of(p), q.detach(), n)
    for group in opt.param_groups:
        group["lr"] = 0.0  # (the step leaves the masters it starts from as they are)
    _step(model, opt, 2)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.dtype == low:
            H.assert_bitwise_equal(opt.master_of(p), q.detach(), n)


@pytest.mark.parametrize("where", ["another optimizer", "twice in the new group"])
def test_add_param_group_refuses_a_parameter_a_second_master_would_step(where):
    """Under O2 a parameter added to a second optimizer (or twice to the new group) got a second
    master, and only one of the two updates reached the model."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    model, (first, second) = amp.initialize(model, [first, second], opt_level="O2", verbosity=0)
    added = [model[0].weight] if where == "another optimizer" else [model[1].bias] * 2
    target = second if where == "another optimizer" else first
    groups = len(target.param_groups)
    with pytest.raises(ValueError, match="more than one parameter group, of this or another"):
        target.add_param_group({"params": added})
    assert len(target.param_groups) == groups


def test_zero_grad_keeping_tensors_zeroes_gradients_that_are_views():
    """DistributedDataParallel(gradient_as_bucket_view=True) makes each gradient a view into its
    bucket: zero_grad(set_to_none=False) detached it in place, which torch refuses for a view."""
    model, opt = _o2(torch.bfloat16, momentum=0.9)
    _step(model, opt, 0)
    views = [p for p in model.parameters() if p.dtype == torch.bfloat16]  # (and fp32 ones)
    bucket = torch.ones(sum(p.numel() for p in views), dtype=torch.bfloat16)
    offset = 0
    for p in views:  # (as DDP lays the gradients out: views of one flat buffer)
        p.grad = bucket[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad._base is bucket for p in views) and not bucket.any()
