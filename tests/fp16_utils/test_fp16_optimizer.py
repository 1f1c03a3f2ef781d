"""peak.fp16_utils.FP16_Optimizer (Apex's deprecated wrapper)."""
import copy
import warnings

import pytest
import torch

from peak.fp16_utils import FP16_Optimizer

from peak_testing import assert_poisoned_steps_skipped, dtype_id, make_mlp, state_tensors


def model_and_data(dtype, seed=0):
    model = make_mlp(seed, 8, 1, hidden=16)
    fp32 = copy.deepcopy(model)
    return model.to(dtype), fp32, [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(6)]


def make(model, **kw):
    with pytest.warns(DeprecationWarning, match="amp.initialize"):
        return FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_static_scale_steps_the_masters_like_fp32_sgd(dtype):
    """Masters follow torch SGD on fp32 copies fed the same unscaled gradients; the model holds
    the masters rounded once."""
    model, _, data = model_and_data(dtype)
    opt = make(model, static_loss_scale=128.0)
    masters_ref = [m.detach().clone().requires_grad_() for m in opt.master_params]
    ref = torch.optim.SGD(masters_ref, lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        opt.backward(loss)
        for r, p in zip(masters_ref, opt.model_params):
            r.grad = (p.grad.float() / 128.0)
        opt.step()
        ref.step()
    for m, r, p in zip(opt.master_params, masters_ref, opt.model_params):
        assert torch.equal(m, r)
        assert torch.equal(p.detach(), m.detach().to(dtype))


def test_dynamic_overflow_skips_and_halves():
    model, _, data = model_and_data(torch.float16)
    opt = make(model, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 1024.0},
               verbose=False)
    x, y = data[0]

    def step(i, poison):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        opt.backward(loss * float("inf") if poison else loss)
        if poison:
            assert opt.overflow
        opt.step()

    # the skipped step leaves weights, masters and momentum buffers; the scale halves
    assert_poisoned_steps_skipped(step, 2, {1}, lambda: state_tensors(model, opt.optimizer),
                                  scale=lambda: opt.loss_scale)
    assert opt.loss_scale == 512.0


def test_growth_after_window_and_state_dict_round_trip():
    model, _, data = model_and_data(torch.float16)
    opt = make(model, dynamic_loss_scale=True,
               dynamic_loss_args={"init_scale": 256.0, "scale_window": 3}, verbose=False)
    for x, y in data:
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
        opt.step()
    assert opt.loss_scale == 1024.0  # 6 clean steps, window 3: two growths
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = make(model2, dynamic_loss_scale=True,
                dynamic_loss_args={"init_scale": 256.0, "scale_window": 3}, verbose=False)
    opt2.load_state_dict(sd)
    assert opt2.loss_scale == 1024.0
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)
    # a damaged scale (the next clean step would unscale by 1/0) is refused before anything loads
    for bad in (0.0, 1e-40, float("nan")):
        damaged = copy.deepcopy(sd)
        damaged["loss_scaler"]["loss_scale"] = bad
        damaged["dynamic_loss_scale"] = False
        with pytest.raises(ValueError, match="load_state_dict: the checkpoint's loss scale must"):
            opt2.load_state_dict(damaged)
        assert opt2.loss_scale == 1024.0 and opt2.dynamic_loss_scale is True


def test_bad_input():
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer"):
        with pytest.warns(DeprecationWarning):
            FP16_Optimizer(object())
    fp32 = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no float16/bfloat16 parameters"):
        make(fp32)
    model, _, _ = model_and_data(torch.float16)
    with pytest.raises(ValueError, match="unknown keys"):
        make(model, dynamic_loss_scale=True, dynamic_loss_args={"scale": 2.0})
    # an fp16 parameter twice: a master per entry, one update lost (as Apex, silently)
    weight = next(model.parameters())
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="held more than once"):
        FP16_Optimizer(torch.optim.SGD([weight, weight], lr=0.1))


def mixed_model(seed=0):
    """A half model with one fp32 part (as network_to_half keeps batch norm): Linear(fp16) ->
    Linear(fp32)."""
    torch.manual_seed(seed)
    low = torch.nn.Linear(4, 3).half()
    high = torch.nn.Linear(3, 1)
    return low, high


def mixed_loss(low, high, x):
    return high(low(x.half()).float()).sum()


def test_fp32_parameters_are_unscaled_and_checked_like_apex():
    """Apex divides every gradient in the optimizer (fp32 parameters too) by the scale and checks
    fp32 parameters for overflow: a gradient left scaled would move them loss_scale times too far."""
    low, high = mixed_model()
    ref = copy.deepcopy(high)
    opt = make(torch.nn.ModuleList([low, high]), static_loss_scale=128.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(5, 4)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(mixed_loss(low, high, x))
        ref_opt.zero_grad()
        ref(low(x.half()).float().detach()).sum().backward()
        for p, r in zip(high.parameters(), ref.parameters()):
            assert torch.equal(p.grad, r.grad)  # 128 is a power of two: unscaling is exact
        opt.step()
        ref_opt.step()
    for p, r in zip(high.parameters(), ref.parameters()):
        assert torch.equal(p, r)


def test_inf_in_an_fp32_gradient_skips_the_step():
    low, high = mixed_model()
    model = torch.nn.ModuleList([low, high])
    opt = make(model, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 1024.0},
               verbose=False)

    def step(i, poison):
        opt.zero_grad()
        opt.backward(mixed_loss(low, high, torch.randn(5, 4)))
        high.bias.grad.fill_(float("inf"))  # only the fp32 parameter overflows
        opt.update_master_grads()
        assert opt.overflow
        opt.step()

    assert_poisoned_steps_skipped(step, 1, {0}, lambda: state_tensors(model, opt.optimizer),
                                  scale=lambda: opt.loss_scale)
    assert opt.loss_scale == 512.0


@pytest.mark.parametrize("args,after_three_overflows", [
    ({"init_scale": 2.0}, 0.25), ({"init_scale": 2.0, "min_loss_scale": 1.0}, 1.0)])
def test_dynamic_scale_backs_off_as_apex_loss_scaler(args, after_three_overflows):
    """Apex's FP16_Optimizer over amp's LossScaler: halves on overflow, no floor unless
    ``min_loss_scale`` (the old DynamicLossScaler stopped at 1)."""
    model, _, data = model_and_data(torch.float16)
    opt = make(model, dynamic_loss_scale=True, dynamic_loss_args=args, verbose=False)
    x, y = data[0]
    for _ in range(3):
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y) * float("inf"))
        opt.step()
    assert opt.loss_scale == after_three_overflows


def test_dynamic_scale_defaults_and_ceiling_are_apex_loss_scalers():
    model, _, data = model_and_data(torch.float16)
    assert make(model, dynamic_loss_scale=True, verbose=False).loss_scale == 2.0 ** 16
    model, _, data = model_and_data(torch.bfloat16)  # (bf16: no overflow at these scales)
    opt = make(model, dynamic_loss_scale=True, verbose=False,
               dynamic_loss_args={"init_scale": 2.0 ** 30, "scale_window": 1})
    assert opt.loss_scale == 2.0 ** 24  # (max_loss_scale caps the initial scale too)
    opt.loss_scale = 2.0 ** 23
    for x, y in data[:2]:
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y))
        opt.step()
    assert opt.loss_scale == 2.0 ** 24  # grew once, then held at the ceiling


def test_loss_scale_param_groups_and_state_are_settable():
    model, _, data = model_and_data(torch.float16)
    opt = make(model, static_loss_scale=128.0)
    opt.loss_scale = 64.0
    assert opt.loss_scale == 64.0
    x, y = data[0]
    opt.zero_grad()
    opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
    for p, m in zip(opt.model_params, opt.master_params):
        assert torch.equal(m.grad, p.grad.float() / 64.0)
    for bad in (0.0, 1e-40, float("inf")):  # (1/1e-40 is inf in float32)
        with pytest.raises(ValueError, match=r"loss_scale must be finite and >= 2\*\*-127"):
            opt.loss_scale = bad
    assert opt.loss_scale == 64.0
    for bad in (dict(static_loss_scale=0.0), dict(static_loss_scale=1e-40),
                dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 0.0})):
        with pytest.raises(ValueError, match="FP16_Optimizer: the initial loss scale must be"):
            make(model, **bad)
    groups = opt.param_groups
    opt.param_groups = groups
    assert opt.optimizer.param_groups is groups
    state = opt.state
    opt.state = state
    assert opt.optimizer.state is state


def test_closure_with_static_scale_and_error_with_dynamic():
    """Apex: closures work with a static scale (the closure calls backward on the wrapper);
    dynamic scaling raises TypeError."""
    model, _, data = model_and_data(torch.float16)
    ref_model = copy.deepcopy(model)
    opt = make(model, static_loss_scale=128.0)
    ref = make(ref_model, static_loss_scale=128.0)
    x, y = data[0]

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        opt.backward(loss)
        return loss

    loss = opt.step(closure)
    ref.zero_grad()
    ref_loss = torch.nn.functional.mse_loss(ref_model(x.half()).float(), y)
    ref.backward(ref_loss)
    ref.step()
    assert torch.equal(loss, ref_loss)
    for a, b in zip(opt.master_params, ref.master_params):
        assert torch.equal(a, b)
    assert opt.first_closure_call_this_step
    dyn = make(copy.deepcopy(model), dynamic_loss_scale=True)
    with pytest.raises(TypeError, match="closure is currently not compatible with dynamic"):
        dyn.step(closure)


def test_state_dict_is_per_group_and_inspectable():
    low, high = mixed_model()
    params = [{"params": low.parameters()}, {"params": high.parameters(), "lr": 0.01}]
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(torch.optim.SGD(params, lr=0.1), static_loss_scale=4.0)
    assert [len(g) for g in opt.fp16_groups] == [2, 0]
    assert [len(g) for g in opt.fp32_from_fp32_groups] == [0, 2]
    sd = opt.state_dict()
    assert [len(g) for g in sd["fp32_from_fp16"]] == [2, 0]  # Apex's layout: a list per group
    x = torch.randn(3, 4)
    ref_low, ref_high = copy.deepcopy(low), copy.deepcopy(high)
    mixed_loss(ref_low, ref_high, x).backward()  # unscaled: the scale 4 is exact
    opt.zero_grad()
    opt.backward(mixed_loss(low, high, x))
    grads = opt.inspect_master_grad_data()  # as Apex's: every parameter the step reads
    assert [len(g) for g in grads] == [2, 2]
    for g, p in zip(grads[0], ref_low.parameters()):
        assert torch.equal(g, p.grad.float())
    for g, p in zip(grads[1], ref_high.parameters()):  # fp32 parameters: their own gradients
        assert g.dtype == torch.float32 and torch.equal(g, p.grad)
    with pytest.raises(RuntimeError, match="serialized using state_dict"):
        copy.deepcopy(opt)


def test_groups_keep_their_order_and_earlier_peak_checkpoints_load():
    """As Apex's FP16_Optimizer: masters take their parameters' places in the group (in place),
    fp32 and frozen parameters stay where they were, so the state's ids follow the original
    order. Checkpoints of earlier peaks load into it: 0.1's (this order, a flat
    'fp32_from_fp16') and later ones' (each group's masters first, then fp32, frozen left out)."""
    torch.manual_seed(0)
    frozen = torch.nn.Parameter(torch.randn(3).half(), requires_grad=False)
    a, b = torch.nn.Parameter(torch.randn(4, 4).half()), torch.nn.Parameter(torch.randn(5))
    c = torch.nn.Parameter(torch.randn(2).half())
    params = [a, frozen, b, c]  # original order: low, frozen, fp32, low
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(torch.optim.Adam(params, lr=0.1), static_loss_scale=4.0)
    group = opt.param_groups[0]["params"]
    assert group is params or len(group) == 4
    assert group[0] is opt.master_params[0] and group[1] is frozen and group[2] is b
    assert group[3] is opt.master_params[1]
    loss = (a.float().sum() + b.sum() + c.float().sum()) ** 2
    opt.backward(loss)
    opt.step()
    new = copy.deepcopy(opt.state_dict())
    state = new["optimizer_state_dict"]["state"]  # ids: 0 a's master, 2 b, 3 c's master
    assert sorted(state) == [0, 2, 3] and state[0]["exp_avg"].shape == (4, 4)
    v01 = copy.deepcopy(new)
    del v01["groups_in_place"]
    v01["fp32_from_fp16"] = [m for g in new["fp32_from_fp16"] for m in g]
    masters_first = copy.deepcopy(new)
    del masters_first["groups_in_place"]
    masters_first["optimizer_state_dict"]["state"] = {0: state[0], 1: state[3], 2: state[2]}
    masters_first["optimizer_state_dict"]["param_groups"][0]["params"] = [0, 1, 2]
    for sd in (new, v01, masters_first):
        with pytest.warns(DeprecationWarning):
            fresh = FP16_Optimizer(torch.optim.Adam([torch.nn.Parameter(p.detach().clone(),
                                                                        requires_grad=p.requires_grad)
                                                     for p in params], lr=0.1),
                                   static_loss_scale=4.0)
        fresh.load_state_dict(sd)
        for m, ref in zip(fresh.master_params, opt.master_params):
            assert torch.equal(m, ref)
        got = fresh.optimizer.state_dict()["state"]
        assert sorted(got) == [0, 2, 3]
        for k in state:
            assert torch.equal(got[k]["exp_avg"], state[k]["exp_avg"])


def test_lbfgs_steps_the_masters():
    """LBFGS keeps its group's parameter list from construction: the masters must be put into
    that list (as Apex does), else it steps the fp16 weights' stale list and never trains."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).half()
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5),
                             static_loss_scale=8.0)
    assert opt.optimizer._params[0] is opt.master_params[0]

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        opt.backward(loss)
        return loss

    losses = [float(opt.step(closure)) for _ in range(4)]
    assert losses[-1] < 0.9 * losses[0]


def test_a_parameter_unfrozen_after_construction_is_stepped_through_a_master():
    """Frozen when FP16_Optimizer was built, then unfrozen (gradual unfreezing): it gets a master
    in its place at its first gradient and steps as if it had been trainable from the start.
    It was left out of the groups, never stepped, and nothing said so."""
    def run(freeze):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).half()
        offset = torch.nn.Parameter(torch.full((1,), 0.5))  # an fp32 one too
        params = [model[0].weight, offset, model[0].bias, model[1].weight, model[1].bias]
        if freeze:
            model[0].weight.requires_grad_(False)
            offset.requires_grad_(False)
        with pytest.warns(DeprecationWarning):
            opt = FP16_Optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                 static_loss_scale=16.0)
        model[0].weight.requires_grad_(True)
        offset.requires_grad_(True)
        for step in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            out = (model(x.half()).float() + offset).pow(2).mean()
            opt.backward(out)
            opt.step()
        return [p.detach().clone() for p in params], opt

    (unfrozen, opt), (ref, ref_opt) = run(True), run(False)
    for x, y in zip(unfrozen, ref):
        assert torch.equal(x, y)
    for group, ref_group in zip(opt.fp32_from_fp16_groups, ref_opt.fp32_from_fp16_groups):
        assert len(group) == len(ref_group) and all(map(torch.equal, group, ref_group))
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        assert all(map(torch.equal, group["params"], ref_group["params"]))  # (same places)


def test_parameter_frozen_after_stepping_keeps_its_place_and_state():
    """Frozen after it was stepped (fine-tuning: state loaded, then layers frozen): it stays in
    its group with its state, as in Apex, so state_dict() works and a fresh optimizer loads it."""
    a = torch.nn.Parameter(torch.randn(3).half())
    b = torch.nn.Parameter(torch.randn(3).half())
    inner = torch.optim.Adam([a, b], lr=0.1)
    a.grad, b.grad = torch.ones(3).half(), torch.ones(3).half()
    inner.step()
    b.requires_grad_(False)
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(inner, static_loss_scale=2.0)
    assert opt.param_groups[0]["params"][1] is b
    sd = opt.state_dict()
    assert sorted(sd["optimizer_state_dict"]["state"]) == [0, 1]
    with pytest.warns(DeprecationWarning):
        fresh = FP16_Optimizer(torch.optim.Adam([torch.nn.Parameter(a.detach().clone()),
                                                 torch.nn.Parameter(b.detach().clone(),
                                                                    requires_grad=False)],
                                                lr=0.1), static_loss_scale=2.0)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.optimizer.state_dict()["state"][1]["exp_avg"],
                       sd["optimizer_state_dict"]["state"][1]["exp_avg"])


@pytest.mark.parametrize("update_between", [True, False])
def test_several_backward_calls_sum_the_gradients_of_fp32_parameters_too(update_between):
    """backward(loss) per micro-batch: fp32 parameters' gradients (unscaled in place) are not
    divided by the scale a second time: the sum equals one backward over the whole batch (in
    float64). An overflow in the first micro-batch still skips the step."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    grads = {}
    for calls in (1, 2):
        low, high = mixed_model()
        opt = make(torch.nn.Sequential(low, high), static_loss_scale=128.0, verbose=False)
        parts = [x] if calls == 1 else [x[:4], x[4:]]
        for i, part in enumerate(parts):
            opt.backward(mixed_loss(low, high, part),
                         update_master_grads=update_between or i == len(parts) - 1)
        grads[calls] = [p.grad.double() for p in high.parameters()]
    for two, one in zip(grads[2], grads[1]):
        torch.testing.assert_close(two, one, rtol=1e-6, atol=1e-7)

    low, high = mixed_model()
    opt = make(torch.nn.Sequential(low, high), dynamic_loss_scale=True, verbose=False)
    before = [p.detach().clone() for p in high.parameters()]
    opt.backward(mixed_loss(low, high, x[:4]) * float("inf"))
    opt.backward(mixed_loss(low, high, x[4:]))
    assert opt.overflow
    opt.step()
    for p, b in zip(high.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_a_backward_that_raises_keeps_the_completed_passes_gradients():
    """Apex's accumulation (update_master_grads=False), a pass that raises before any gradient
    arrives, a retry: the sum is that of the completed passes, for fp32 parameters too."""
    class Fails(torch.autograd.Function):
        armed = False

        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            if Fails.armed:
                raise RuntimeError("a failing backward")
            return g

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    parts = [x[:2], x[2:4], x[4:]]
    low, high = mixed_model()
    opt = make(torch.nn.Sequential(low, high), static_loss_scale=128.0, verbose=False)
    opt.backward(mixed_loss(low, high, parts[0]))
    opt.backward(mixed_loss(low, high, parts[1]), update_master_grads=False)
    Fails.armed = True
    with pytest.raises(RuntimeError, match="a failing backward"):
        opt.backward(Fails.apply(mixed_loss(low, high, parts[2])), update_master_grads=False)
    Fails.armed = False
    opt.backward(Fails.apply(mixed_loss(low, high, parts[2])), update_master_grads=False)
    opt.update_master_grads()
    low_ref, high_ref = mixed_model()
    opt_ref = make(torch.nn.Sequential(low_ref, high_ref), static_loss_scale=128.0, verbose=False)
    opt_ref.backward(mixed_loss(low_ref, high_ref, x))
    for p, r in zip(high.parameters(), high_ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_the_documented_pre_2019_dynamic_scaler_recipe():
    """docs/migrating.md: the old DynamicLossScaler's start (2**32), window and floor."""
    model, _, _ = model_and_data(torch.bfloat16)
    opt = make(model, dynamic_loss_scale=True, verbose=False, dynamic_loss_args={
        "init_scale": 2**32, "scale_window": 1000, "min_loss_scale": 1, "max_loss_scale": None})
    assert opt.loss_scale == 2.0 ** 32


@pytest.mark.parametrize("then", ["step", "zero_grad_and_backward"])
def test_a_backward_that_raises_then_step_or_zero_grad_as_torch(then):
    """A failed pass keeps what it wrote (torch's rule); step() unscales it and adds the earlier
    fp32 gradients back, zero_grad() zeroes them all (nothing set aside leaks into a later step).
    Reference: the same fp32 network under plain torch."""
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("a failing backward")

    low, high = mixed_model()
    low_ref, high_ref = copy.deepcopy(low).float(), copy.deepcopy(high)
    opt = make(torch.nn.Sequential(low, high), static_loss_scale=128.0, verbose=False)
    ref = torch.optim.SGD(list(low_ref.parameters()) + list(high_ref.parameters()), lr=0.1,
                          momentum=0.9)  # (as make())
    x1, x2, x3 = (torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    opt.zero_grad()
    opt.backward(high(low(x1.half()).float()).sum())
    high_ref(low_ref(x1)).sum().backward()
    with pytest.raises(RuntimeError, match="a failing backward"):
        opt.backward(high(Fails.apply(low(x2.half()).float())).sum())
    with pytest.raises(RuntimeError, match="a failing backward"):
        high_ref(Fails.apply(low_ref(x2))).sum().backward()
    if then == "zero_grad_and_backward":
        opt.zero_grad()
        ref.zero_grad(set_to_none=False)
    else:  # (the step consumes what was set aside: the next step's gradients are its own)
        opt.step()
        ref.step()
        torch.nn.Sequential(low, high).zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
    opt.backward(high(low(x3.half()).float()).sum())
    high_ref(low_ref(x3)).sum().backward()
    opt.step()
    ref.step()
    torch.testing.assert_close(high.weight.detach(), high_ref.weight.detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_sparse_embedding_gradients_step_as_dense_ones(dtype):
    """nn.Embedding(sparse=True) in a half model (and one kept fp32): its sparse gradient is
    unscaled on its values into a sparse fp32 master gradient (it raised in the multi-tensor
    kernel), and the run equals the same model with dense embeddings bit for bit, through an
    overflow (skipped, the scale backed off alike)."""
    results = []
    for sparse in (True, False):
        torch.manual_seed(0)
        low = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=sparse),
                                  torch.nn.Linear(4, 1)).to(dtype)
        kept = torch.nn.Embedding(10, 1, sparse=sparse)  # an fp32 parameter in the groups
        with pytest.warns(DeprecationWarning, match="amp.initialize"):
            opt = FP16_Optimizer(
                torch.optim.SGD([*low.parameters(), *kept.parameters()], lr=0.1),
                dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**10})
        for step in range(4):
            idx = torch.tensor([1, 2, 3]) if step % 2 else torch.tensor([5, 2, 7])
            loss = (low(idx).float() + kept(idx)).sum() * (float("inf") if step == 1 else 1.0)
            opt.backward(loss)
            assert low[0].weight.grad.is_sparse is sparse
            opt.step()
            opt.zero_grad()
        results.append(([p.detach().clone() for p in [*low.parameters(), *kept.parameters()]],
                        [m.detach().clone() for m in opt.master_params], opt.loss_scale))
    (weights, masters, scale), (weights_d, masters_d, scale_d) = results
    assert scale == scale_d < 2.0**10
    for a, b in zip(weights + masters, weights_d + masters_d):
        assert torch.equal(a, b)
    assert not torch.equal(masters[0], masters[0].new_zeros(()).expand_as(masters[0]))


def test_clip_master_grads_returns_the_norm_as_a_tensor_as_apex():
    """Apex returns clip_grad_norm_'s result (a tensor): scripts call .item() on it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).half()
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0)
    opt.backward(model(torch.randn(4, 6).half()).float().pow(2).sum())
    expected = torch.cat([m.grad.double().flatten() for m in opt.master_params]).norm()
    norm = opt.clip_master_grads(1e9)
    assert isinstance(norm, torch.Tensor)
    torch.testing.assert_close(norm.double().item(), expected.item(), rtol=1e-6, atol=0)


def test_loads_an_apex_checkpoint_with_its_loss_scaler_object():
    """Apex's state_dict stores its LossScaler object under 'loss_scaler' (and its groups in
    their own order, which is this optimizer's): its scale is read through loss_scale()."""
    from peak.amp import LossScaler

    torch.manual_seed(0)
    low, fp32 = torch.nn.Parameter(torch.randn(3).half()), torch.nn.Parameter(torch.randn(2))
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(torch.optim.SGD([fp32, low], lr=0.1, momentum=0.9),
                             dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 16.0})
    opt.backward((low.float().sum() + fp32.sum()) ** 2)
    opt.step()
    sd = opt.state_dict()
    apex = dict(sd, loss_scaler=LossScaler("dynamic", init_scale=512.0))
    del apex["groups_in_place"]
    with pytest.warns(DeprecationWarning):
        fresh = FP16_Optimizer(torch.optim.SGD([torch.nn.Parameter(fp32.detach().clone()),
                                                torch.nn.Parameter(low.detach().clone())],
                                               lr=0.1, momentum=0.9), dynamic_loss_scale=True)
    fresh.load_state_dict(apex)
    assert fresh.loss_scale == 512.0
    got, want = fresh.optimizer.state_dict()["state"], sd["optimizer_state_dict"]["state"]
    assert sorted(got) == sorted(want) == [0, 1]
    for k in want:  # fp32 first, as given: the ids are the groups' own order
        assert torch.equal(got[k]["momentum_buffer"], want[k]["momentum_buffer"])
    assert torch.equal(fresh.master_params[0], opt.master_params[0])


def _gradual_unfreezing(steps_frozen, steps_after, opt=None, model=None):
    """A model whose first layer is frozen when FP16_Optimizer is built and unfrozen later."""
    if model is None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).half()
        model[0].weight.requires_grad_(False)
    if opt is None:
        with pytest.warns(DeprecationWarning):
            opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                 static_loss_scale=16.0)
    for step in range(steps_frozen + steps_after):
        if step == steps_frozen:
            model[0].weight.requires_grad_(True)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        opt.backward(model(x.half()).float().pow(2).mean())
        opt.step()
    return model, opt


def test_a_run_that_unfroze_resumes_into_an_optimizer_built_frozen():
    """A gradual-unfreezing script resumes by building the optimizer with the layer frozen
    again: the checkpoint's layout (which places were stepped) takes those places, so it loads
    and continues bit for bit as the uninterrupted run."""
    model, opt = _gradual_unfreezing(1, 2)
    sd, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    full, _ = _gradual_unfreezing(0, 2, opt, model)  # the uninterrupted run, two more steps
    torch.manual_seed(1)
    again = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).half()
    again.load_state_dict(weights)
    again[0].weight.requires_grad_(False)  # as the script builds it
    with pytest.warns(DeprecationWarning):
        resumed = FP16_Optimizer(torch.optim.Adam(again.parameters(), lr=1e-2),
                                 static_loss_scale=16.0)
    resumed.load_state_dict(sd)
    again[0].weight.requires_grad_(True)
    _gradual_unfreezing(0, 2, resumed, again)
    for a, b in zip(again.parameters(), full.parameters()):
        assert torch.equal(a, b)


def test_fp16_state_moved_onto_a_master_is_fp32():
    """State the wrapped optimizer holds in fp16 (loaded into the fp16 weights) moves onto the
    master in fp32 (Apex recasts it): Adam raised on the mixed dtypes at the next step."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4).half())
    inner = torch.optim.Adam([w], lr=1e-2)
    inner.load_state_dict({"state": {0: {"step": torch.tensor(3.0),
                                         "exp_avg": torch.full((4,), 0.5),
                                         "exp_avg_sq": torch.full((4,), 0.25)}},
                           "param_groups": [dict(inner.state_dict()["param_groups"][0])]})
    assert inner.state[w]["exp_avg"].dtype == torch.float16  # (torch casts it to the weight's)
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(inner, static_loss_scale=4.0)
    opt.backward((w.float() ** 2).sum())
    opt.step()
    state = opt.optimizer.state[opt.master_params[0]]
    assert state["exp_avg"].dtype == torch.float32 and torch.isfinite(w).all()


def test_a_group_added_to_the_wrapped_optimizer_gets_masters():
    """A group added to the wrapped optimizer after construction (Apex offers no way) is stepped
    through masters from its first gradient, as the others: it was stepped with the scaled
    gradient (a weight of 1.0 went to -101 at scale 1024)."""
    torch.manual_seed(0)
    first, added = torch.nn.Parameter(torch.ones(2).half()), torch.nn.Parameter(torch.ones(2).half())
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(torch.optim.SGD([first], lr=0.1), static_loss_scale=1024.0)
    opt.optimizer.add_param_group({"params": [added]})
    opt.backward((first.float().sum() + added.float().sum()))
    opt.step()
    assert torch.equal(added, torch.full((2,), 0.9).half())
    assert opt.fp16_groups[1] == [added] and opt.param_groups[1]["params"][0] is opt.master_params[1]


def test_a_wrongly_read_layout_is_refused_not_loaded():
    """A checkpoint whose state would land on parameters of another shape (a masters-first
    checkpoint without its mark, a different model) is refused; it was loaded silently."""
    torch.manual_seed(0)
    b, a = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3).half())
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(torch.optim.SGD([b, a], lr=0.1, momentum=0.9), static_loss_scale=2.0)
    opt.backward(b.sum() ** 2 + a.float().sum() ** 2)
    opt.step()
    sd = opt.state_dict()
    del sd["groups_in_place"]  # now read as masters first: a's state would land on b
    with pytest.raises(ValueError, match="do not fit"):
        opt.load_state_dict(sd)


def test_an_optimizer_whose_fp16_weights_are_all_frozen_at_first_is_accepted():
    """Only an fp32 head trains at first (Apex accepts it); the fp16 body gets its masters when
    unfrozen."""
    body, head = torch.nn.Parameter(torch.ones(2).half(), requires_grad=False), \
        torch.nn.Parameter(torch.ones(2))
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(torch.optim.SGD([body, head], lr=0.1), static_loss_scale=8.0)
    body.requires_grad_(True)
    opt.backward(body.float().sum() + head.sum())
    opt.step()
    assert torch.equal(body, torch.full((2,), 0.9).half()) and opt.fp16_groups == [[body]]


def test_a_run_that_added_a_group_resumes_with_the_group_added_again():
    """A layer unfrozen through add_param_group on the wrapped optimizer: the resumed script
    adds the group again before loading, and continues bit for bit (the added group was unknown
    to the load until its first gradient, and the load was refused)."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).half()
        with pytest.warns(DeprecationWarning):
            opt = FP16_Optimizer(torch.optim.Adam(model[1].parameters(), lr=1e-2),
                                 static_loss_scale=16.0)
        opt.optimizer.add_param_group({"params": list(model[0].parameters()), "lr": 5e-3})
        return model, opt

    def train(model, opt, steps):
        for step in steps:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            opt.backward(model(x.half()).float().pow(2).mean())
            opt.step()

    model, opt = build()
    train(model, opt, range(2))
    sd, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    train(model, opt, range(2, 4))
    again, resumed = build()
    again.load_state_dict(weights)
    resumed.load_state_dict(sd)
    train(again, resumed, range(2, 4))
    for a, b in zip(again.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_masters_loaded_into_an_unrestored_model_win_at_the_step(dtype):
    """Apex's FP16_Optimizer makes its masters at construction: an optimizer checkpoint loaded
    into a model whose weights were not restored gives its masters to the model at the next
    step (lr 0 here: the step changes no master)."""
    model, _, data = model_and_data(dtype)
    opt = make(model, static_loss_scale=128.0)
    for x, y in data[:3]:
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y))
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    other, _, _ = model_and_data(dtype, seed=9)
    opt2 = make(other, static_loss_scale=128.0)
    opt2.load_state_dict(saved)
    for group in opt2.param_groups:
        group["lr"] = 0.0
    x, y = data[3]
    opt2.zero_grad()
    opt2.backward(torch.nn.functional.mse_loss(other(x.to(dtype)).float(), y))
    opt2.step()
    for m, s, p in zip(opt2.master_params, opt.master_params, other.parameters()):
        assert torch.equal(m, s) and torch.equal(p, s.to(dtype))


def test_apex_flat_views_and_clip_grad_norm_attribute():
    """Apex's FP16_Optimizer attributes scripts read: the flat lists of its groups and
    clip_grad_norm (fp16util's function), which clips the masters as clip_master_grads does."""
    low, high = mixed_model()
    params = [{"params": low.parameters()}, {"params": high.parameters(), "lr": 0.01}]
    with pytest.warns(DeprecationWarning):
        opt = FP16_Optimizer(torch.optim.SGD(params, lr=0.1), static_loss_scale=4.0)
    assert opt.all_fp16_params == list(low.parameters())
    assert opt.all_fp32_from_fp32_params == list(high.parameters())
    masters = opt.all_fp32_from_fp16_params
    assert [m.dtype for m in masters] == [torch.float32] * 2
    assert all(m is q for m, q in zip(masters, opt.optimizer.param_groups[0]["params"]))
    opt.backward(mixed_loss(low, high, torch.randn(3, 4)))
    fp32 = masters + opt.all_fp32_from_fp32_params
    expected = torch.cat([p.grad.double().flatten() for p in fp32]).norm()
    norm = opt.clip_grad_norm(fp32, 1e-3)
    torch.testing.assert_close(float(norm), expected.item(), rtol=1e-6, atol=0)
    clipped = torch.cat([p.grad.double().flatten() for p in fp32]).norm()
    torch.testing.assert_close(clipped.item(), 1e-3, rtol=1e-4, atol=0)


def test_a_group_added_to_the_wrapped_optimizer_repeating_a_weight_is_refused():
    """The wrapped optimizer's groups hold masters, so torch's own duplicate check cannot see an
    fp16 weight given again in a group added to it: two masters would step one weight (the
    model taking the last copied). Refused, with the weight, its master and the state as before."""
    w = torch.nn.Parameter(torch.ones(4).half())
    inner = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        opt = FP16_Optimizer(inner, static_loss_scale=1.0, verbose=False)
    opt.zero_grad()
    opt.backward(w.float().sum())
    opt.step()
    inner.add_param_group({"params": [w], "lr": 0.5})
    before = (w.detach().clone(), [m.detach().clone() for m in opt.all_fp32_from_fp16_params],
              copy.deepcopy(inner.state_dict()["state"]))
    with pytest.raises(ValueError, match="held more than once"):
        opt.zero_grad()
        opt.backward(w.float().sum())
        opt.step()
    assert torch.equal(w, before[0])
    assert all(torch.equal(m, b) for m, b in zip(opt.all_fp32_from_fp16_params, before[1]))
    assert all(torch.equal(inner.state_dict()["state"][k]["momentum_buffer"], v["momentum_buffer"])
               for k, v in before[2].items())
