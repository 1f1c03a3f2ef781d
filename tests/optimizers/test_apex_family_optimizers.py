"""FusedAdagrad, FusedNovoGrad, FusedMixedPrecisionLamb, FusedAdamW and LARC against independent
references: torch.optim.Adagrad/AdamW, float64 NovoGrad / LAMB / LARC written from Apex's
documented math; masters, overflow skips, checkpoints, groups, schedulers, amp O2, GradScaler."""
import copy
import math
import pickle

import pytest
import torch

from peak import amp, ops
from peak.optimizers import (LARC, FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB,
                             FusedMixedPrecisionLamb,
                             FusedNovoGrad, FusedSGD)

from peak_testing import (opcheck_op, DEVICES, TOLERANCES, dtype_id,
                          assert_poisoned_steps_skipped, assert_resumes_bit_for_bit_in_a_new_process,
                          make_mlp, state_tensors, step_on_cpu_and_emulated_grid, amp_steps,
                          assert_bitwise_equal, bitwise_equal)
from test_fused_optimizers import grads_for, lamb_reference, make_params, run, snapshot

LOW = [torch.float16, torch.bfloat16]
STEPS = 20

# Masters of fp16/bf16 models against an fp32/fp64 reference fed the same low-precision
# gradients: only fp32 rounding separates them (the reference sees the very same gradients), so
# the tolerance does not depend on the model dtype; the weights are the masters rounded once.
MASTER_TOL = {torch.float16: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=1e-4, atol=1e-5)}
FP32_TOL = dict(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- references
def novograd_reference(start, grads_per_step, steps, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=0.0, reg_inside_moment=False, grad_averaging=True,
                       norm_type=2, init_zero=False, bias_correction=True):
    """Apex's FusedNovoGrad (multi_tensor_novograd) in float64: per-tensor norm moment v (the
    norm, not its square), blended L2-wise or linearly (inf norm), element-wise momentum."""
    w = [p.detach().double().clone() for p in start]
    m = [torch.zeros_like(x) for x in w]
    v = [0.0 for _ in w]
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0
    for step in range(1, steps + 1):
        for i, g in enumerate(grads_per_step(step - 1)):
            g = g.double()
            n = float(g.norm()) if norm_type == 2 else float(g.abs().max())
            if step == 1 and not init_zero:
                v[i] = n
            elif norm_type == 2:
                v[i] = math.sqrt(b2 * v[i] ** 2 + (1 - b2) * n * n)
            else:
                v[i] = b2 * v[i] + (1 - b2) * n
            bc1 = 1 - b1 ** step if bias_correction else 1.0
            bc2 = math.sqrt(1 - b2 ** step) if bias_correction else 1.0
            denom = v[i] / bc2 + eps
            if reg_inside_moment:
                g = g / denom + weight_decay * w[i]
                m[i] = b1 * m[i] + b3 * g
                w[i] = w[i] - lr * (m[i] / bc1)
            else:
                m[i] = b1 * m[i] + b3 * g
                w[i] = w[i] - lr * ((m[i] / bc1) / denom + weight_decay * w[i])
    return w


def adagrad_w_reference(start, grads_per_step, steps, lr, eps, weight_decay):
    """Apex's FusedAdagrad with adagrad_w_mode=True (decoupled decay), float64."""
    w = [p.detach().double().clone() for p in start]
    h = [torch.zeros_like(x) for x in w]
    for step in range(steps):
        for i, g in enumerate(grads_per_step(step)):
            g = g.double()
            h[i] = h[i] + g * g
            w[i] = w[i] - lr * (g / (h[i].sqrt() + eps) + weight_decay * w[i])
    return w


def larc_reference(start, grads_per_step, steps, lr, momentum, weight_decay, trust, clip, eps):
    """Apex's LARC around torch.optim.SGD(momentum), float64: per-tensor local rate from the
    weight and gradient norms, weight decay folded into the gradient, SGD without decay."""
    w = [p.detach().double().clone() for p in start]
    buf = [None for _ in w]
    for step in range(steps):
        for i, g in enumerate(grads_per_step(step)):
            g = g.double()
            pn, gn = float(w[i].norm()), float(g.norm())
            if pn != 0 and gn != 0:
                rate = trust * pn / (gn + pn * weight_decay + eps)
                if clip:
                    rate = min(rate / lr, 1.0)
                g = (g + weight_decay * w[i]) * rate
            buf[i] = g.clone() if buf[i] is None else momentum * buf[i] + g
            w[i] = w[i] - lr * buf[i]
    return w


def low_grads(params):
    return lambda s: grads_for(s, params)


# ---------------------------------------------------------------------------- Adagrad
ADAGRAD_CONFIGS = {
    "plain": dict(lr=0.1),
    "l2": dict(lr=0.1, weight_decay=0.1, eps=1e-6),
    "lr_decay_init": dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.3),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", list(ADAGRAD_CONFIGS))
def test_adagrad_matches_torch_fp32(device, cfg):
    kw = ADAGRAD_CONFIGS[cfg]
    ours = make_params(torch.float32, device)
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedAdagrad(ours, **kw)
    torch_opt = torch.optim.Adagrad(ref, **kw)
    run(opt, ours, STEPS)
    run(torch_opt, ref, STEPS)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, **FP32_TOL)
        torch.testing.assert_close(opt.state[p]["sum"], torch_opt.state[q]["sum"], rtol=1e-6,
                                   atol=1e-7)


def test_adagrad_w_mode_matches_float64_reference():
    ours = make_params(torch.float32, "cpu")
    start = [p.detach().clone() for p in ours]
    opt = FusedAdagrad(ours, lr=0.05, weight_decay=0.1, adagrad_w_mode=True)
    run(opt, ours, STEPS)
    expected = adagrad_w_reference(start, low_grads(ours), STEPS, 0.05, 1e-10, 0.1)
    for p, e in zip(ours, expected):
        torch.testing.assert_close(p.detach().double(), e, **FP32_TOL)


# ---------------------------------------------------------------------------- NovoGrad
NOVOGRAD_CONFIGS = {
    "default": dict(),
    "decay": dict(weight_decay=0.01),
    "reg_inside_moment": dict(weight_decay=0.01, reg_inside_moment=True),
    "init_zero_inf_norm": dict(init_zero=True, norm_type=0, betas=(0.95, 0.98)),
    "no_averaging_no_bias_correction": dict(grad_averaging=False, bias_correction=False),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", list(NOVOGRAD_CONFIGS))
def test_novograd_matches_float64_reference(device, cfg):
    kw = NOVOGRAD_CONFIGS[cfg]
    ours = make_params(torch.float32, device)
    start = [p.detach().cpu().clone() for p in ours]
    opt = FusedNovoGrad(ours, lr=1e-2, **kw)
    run(opt, ours, STEPS)
    expected = novograd_reference(start, lambda s: [g.cpu() for g in grads_for(s, ours)], STEPS,
                                  lr=1e-2, **kw)
    for p, e in zip(ours, expected):
        torch.testing.assert_close(p.detach().cpu().double(), e, rtol=1e-5, atol=2e-6)
    assert all(opt.state[p]["exp_avg_sq"].dim() == 0 for p in ours)


# ---------------------------------------------------------------------------- mixed-precision LAMB
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_mixed_precision_lamb_fp32_matches_float64_reference(device, max_grad_norm):
    ours = make_params(torch.float32, device)
    start = [p.detach().cpu().clone() for p in ours]
    opt = FusedMixedPrecisionLamb(ours, lr=1e-2, weight_decay=0.01, max_grad_norm=max_grad_norm)
    run(opt, ours, STEPS)
    expected = lamb_reference(start, lambda s: [g.cpu() for g in grads_for(s, ours)], 1e-2,
                              (0.9, 0.999), 1e-6, 0.01, max_grad_norm, STEPS)
    for p, e in zip(ours, expected):
        torch.testing.assert_close(p.detach().cpu().double(), e, rtol=1e-5, atol=2e-6)


def test_mixed_precision_lamb_apex_arguments():
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    opt = FusedMixedPrecisionLamb([p], 1e-3, 10, reduced_precision_dtype=torch.bfloat16)
    p.grad = torch.randn(5, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[p]["step"].item() == 11  # counts on from Apex's `step` argument
    assert opt.state[p]["master_param"].dtype == torch.float32
    with pytest.raises(ValueError, match="reduced_precision_dtype"):
        FusedMixedPrecisionLamb([p], reduced_precision_dtype=torch.float64)
    with pytest.raises(ValueError, match="step .* must be an int"):
        FusedMixedPrecisionLamb([p], step=-1)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedMixedPrecisionLamb([p], amsgrad=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        opt.step(grad_scalar=None)


# ---------------------------------------------------------------------------- AdamW
@pytest.mark.parametrize("device", DEVICES)
def test_fused_adamw_is_torch_adamw(device):
    ours = make_params(torch.float32, device)
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedAdamW(ours, lr=1e-2)  # torch.optim.AdamW's default weight_decay (1e-2)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    assert opt.param_groups[0]["weight_decay"] == torch_opt.param_groups[0]["weight_decay"]
    run(opt, ours, STEPS)
    run(torch_opt, ref, STEPS)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, **FP32_TOL)
    with pytest.raises(ValueError, match="FusedAdam"):
        FusedAdamW(ours, adam_w_mode=False)
    # a torch Adam (L2) checkpoint loaded here still steps as AdamW
    opt.load_state_dict(torch.optim.Adam(ref, lr=1e-2).state_dict())
    assert opt.param_groups[0]["adam_w_mode"] is True


# ---------------------------------------------------------------------------- low precision
FAMILIES = {
    "adagrad": (lambda ps: FusedAdagrad(ps, lr=0.05, weight_decay=0.01),
                lambda start, grads: None),
    "novograd": (lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
                 lambda start, grads: novograd_reference(start, grads, STEPS, lr=1e-2,
                                                         weight_decay=0.01)),
    "mp_lamb": (lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, weight_decay=0.01),
                lambda start, grads: lamb_reference(start, grads, 1e-2, (0.9, 0.999), 1e-6, 0.01,
                                                    1.0, STEPS)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_masters_follow_the_reference_and_weights_are_rounded_masters(device, dtype, family):
    make, reference = FAMILIES[family]
    ours = make_params(dtype, device)
    start = [p.detach().float().cpu() for p in ours]
    opt = make(ours)
    run(opt, ours, STEPS)
    grads = lambda s: [g.cpu().double() for g in grads_for(s, ours)]  # the same low-precision grads
    if family == "adagrad":
        ref = [s.clone().requires_grad_() for s in start]
        torch_opt = torch.optim.Adagrad(ref, lr=0.05, weight_decay=0.01)
        for s in range(STEPS):
            for r, g in zip(ref, grads(s)):
                r.grad = g.float()
            torch_opt.step()
        expected = [r.detach().double() for r in ref]
    else:
        expected = reference(start, grads)
    for p, e in zip(ours, expected):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and p.dtype == dtype
        torch.testing.assert_close(master.cpu().double(), e, **MASTER_TOL[dtype])
        assert torch.equal(p.detach(), master.to(dtype))
        # and the model weight is within half an ulp of its dtype of the exact reference
        torch.testing.assert_close(p.detach().cpu().double(), e, **TOLERANCES[dtype])


MAKERS = {
    "adagrad": lambda ps: FusedAdagrad(ps, lr=0.05, weight_decay=0.01),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
    "novograd_inf": lambda ps: FusedNovoGrad(ps, lr=1e-2, norm_type=0, reg_inside_moment=True),
    "mp_lamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2),
    "adamw": lambda ps: FusedAdamW(ps, lr=1e-2, amsgrad=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
@pytest.mark.parametrize("family", list(MAKERS))
@pytest.mark.parametrize("flag", [1.0, 3.0, float("nan")], ids=["one", "sum", "nan"])
def test_overflow_skips_everything_bit_for_bit(device, dtype, family, flag):
    params = make_params(dtype, device)
    opt = MAKERS[family](params)
    run(opt, params, 3)
    before_params, before_state = snapshot(opt, params)
    for p, g in zip(params, grads_for(7, params)):
        p.grad = g
    params[1].grad[5] = float("inf")
    params[2].grad[0, 0, 0] = float("nan")
    opt.step(grad_scale=torch.full((1,), 1024.0, device=device),
             found_inf=torch.full((1,), flag, device=device))  # (any nonzero flag skips)
    for p, b in zip(params, before_params):
        assert torch.equal(p.detach(), b)
    for p in params:
        for k, v in opt.state[p].items():
            assert torch.equal(v, before_state[id(p)][k]), k
    for p, g in zip(params, grads_for(8, params)):
        p.grad = g
    opt.step(found_inf=torch.zeros(1, device=device))
    assert all(opt.state[p]["step"].item() == 4 for p in params)
    assert all(torch.isfinite(p).all() for p in params)
    if family.startswith("novograd"):  # the norms moved on from the saved ones, finite
        assert all(torch.isfinite(opt.state[p]["exp_avg_sq"]) for p in params)


@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
@pytest.mark.parametrize("family", list(MAKERS))
def test_grad_scale_unscales_inside_the_step_exactly(dtype, family):
    a = make_params(dtype, "cpu")
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_a, opt_b = MAKERS[family](a), MAKERS[family](b)
    scale = 2.0 ** 10  # a power of two: unscaling is exact, so the results must be identical
    for step in range(5):
        for p, q, g in zip(a, b, grads_for(step, a)):
            p.grad, q.grad = g, (g.float() * scale).to(dtype)
        opt_a.step()
        opt_b.step(grad_scale=torch.tensor([scale]), found_inf=torch.zeros(1))
    for p, q in zip(a, b):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------- scalers
@pytest.mark.parametrize("family", list(MAKERS))
@pytest.mark.parametrize("scaler_kind", ["peak", "torch"])
def test_grad_scaler_skips_overflow_and_unscales(family, scaler_kind):
    """Step 1's loss is inf: skipped bit for bit, the scale backs off once, and the run ends bit
    for bit where one without step 1 and without scaling ends (a power-of-two scale: unscaling
    is exact)."""
    model = make_mlp(0, 5, 3, hidden=4)
    ref = copy.deepcopy(model)
    opt, ref_opt = MAKERS[family](model.parameters()), MAKERS[family](ref.parameters())
    scaler = (amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler_kind == "peak"
              else torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    x = torch.randn(4, 5)

    def step(i, poison):
        opt.zero_grad()
        loss = model(x).square().mean() * (float("inf") if poison else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def reference_step(i):
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()

    assert_poisoned_steps_skipped(step, 4, {1}, lambda: state_tensors(model, opt),
                                  scale=scaler.get_scale, reference_step=reference_step,
                                  reference_state=lambda: state_tensors(ref, ref_opt))
    assert scaler.get_scale() == 2.0 ** 7  # one backoff


@pytest.mark.parametrize("how", ["keyword", "positional", "closure"])
def test_mixed_precision_lamb_takes_apex_grad_scaler_argument(how):
    """Apex's contract: optimizer.step(grad_scaler=scaler), or step(None, scaler) as Apex's
    signature step(closure=None, grad_scaler=None) allows, asks the scaler for its scale and
    inf/NaN check (Apex's scripts call it so); step(closure, scaler) checks the gradients the
    closure made (the check ran first, on the previous ones: an overflow stepped, or raised)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-2,
                                  reduced_precision_dtype=torch.bfloat16)
    ref_opt = FusedMixedPrecisionLamb(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    x = torch.randn(4, 5, dtype=torch.bfloat16)

    def step(i, poison):
        def closure():
            opt.zero_grad()
            loss = model(x).float().square().mean() * (float("inf") if poison else 1.0)
            scaler.scale(loss).backward()
            return loss

        if how == "closure":
            assert opt.step(closure, scaler) is not None  # (the closure's loss)
        else:
            closure()
            if how == "positional":
                opt.step(None, scaler)
            else:
                opt.step(grad_scaler=scaler)
        scaler.update()

    def reference_step(i):
        ref_opt.zero_grad()
        ref(x).float().square().mean().backward()
        ref_opt.step()

    assert_poisoned_steps_skipped(step, 3, {1}, lambda: state_tensors(model, opt),
                                  scale=scaler.get_scale, reference_step=reference_step)
    assert scaler.get_scale() == 2.0 ** 3
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master_param"], ref_opt.state[q]["master_param"])


# ---------------------------------------------------------------------------- amp O2
@pytest.mark.parametrize("family", list(MAKERS))
@pytest.mark.parametrize("dtype,scale", [(torch.float16, 2.0 ** 16), (torch.bfloat16, 1.0)],
                         ids=["f16_dynamic", "bf16_static"])
def test_amp_o2_fused_path_equals_the_optimizer_by_hand(family, dtype, scale):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(6)]
    model = make_mlp()
    opt = MAKERS[family](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=dtype,
                                verbosity=0)
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    ref = make_mlp()
    masters = [p.detach().clone() for p in ref.parameters()]
    ref = ref.to(dtype)
    ref_opt = MAKERS[family](ref.parameters())
    for p, m in zip(ref.parameters(), masters):
        ref_opt.state[p]["master_param"] = m
    for x, y in data:
        ref_opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x.to(dtype)).float(), y)
        (loss * scale).backward()
        ref_opt.step(grad_scale=torch.tensor([scale]))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == dtype
        assert torch.equal(opt.state[p]["master_param"], ref_opt.state[q]["master_param"])
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------- groups, schedulers
def test_adagrad_add_param_group_and_scheduler_follow_torch():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    ref = copy.deepcopy(net)
    # (initial_accumulator_value in the constructor: torch starts an added group's sums from
    # its defaults' value, ignoring the group's own; peak uses the group's.)
    opt = FusedAdagrad([{"params": net[0].parameters(), "lr": 0.05}], lr=0.1, weight_decay=0.01,
                       initial_accumulator_value=0.1)
    torch_opt = torch.optim.Adagrad([{"params": ref[0].parameters(), "lr": 0.05}], lr=0.1,
                                    weight_decay=0.01, initial_accumulator_value=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    torch_sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=4, gamma=0.5)
    for step in range(STEPS):
        if step == 5:
            opt.add_param_group({"params": net[1].parameters(), "lr": 0.2})
            torch_opt.add_param_group({"params": ref[1].parameters(), "lr": 0.2})
            for p in ref[1].parameters():
                # torch before 2.12 made the sums in __init__ only (an added group's step then
                # raised KeyError); from 2.12 on it makes them from the defaults, as here.
                torch_opt.state.setdefault(p, {
                    "step": torch.tensor(0.0),
                    "sum": torch.full_like(p, torch_opt.defaults["initial_accumulator_value"])})
        x = torch.randn(5, 6)
        for model, o in ((net, opt), (ref, torch_opt)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
        sched.step()
        torch_sched.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, **FP32_TOL)


def test_novograd_add_param_group_and_scheduler_follow_the_reference():
    """A group added mid-run starts its own step counts and norms; the scheduler's lr changes
    (StepLR, which also drives the added group) reach the kernel."""
    a = make_params(torch.float32, "cpu")
    first, second = a[:3], a[3:]
    start = [p.detach().clone() for p in a]
    opt = FusedNovoGrad(first, lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    for step in range(STEPS):
        if step == 6:
            opt.add_param_group({"params": second})
        live = first if step < 6 else a
        for p, g in zip(live, grads_for(step, live)):
            p.grad = g
        opt.step()
        sched.step()
    # By hand in float64, per tensor, with each group's lr at each global step t.
    for idx, p in enumerate(a):
        begin = 0 if idx < 3 else 6
        live_at = lambda s: first if s < 6 else a
        grads = lambda k, idx=idx, begin=begin: [grads_for(begin + k, live_at(begin + k))[idx]]
        lr_at = ((lambda t: 1e-2 * 0.5 ** (t // 4)) if idx < 3
                 else (lambda t: 1e-2 * 0.5 ** (t // 4 - 1)))
        expected = _novograd_scheduled_reference([start[idx]], grads, begin, STEPS - begin, lr_at)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=2e-6)
        assert opt.state[p]["step"].item() == STEPS - begin


def _novograd_scheduled_reference(w, grads, begin, steps, lr_at):
    """One tensor's NovoGrad in float64 with the learning rate lr_at(global step)."""
    state = dict(w=w[0].double().clone(), m=None, v=None)
    b1, b2 = 0.9, 0.999
    for k in range(1, steps + 1):
        lr = lr_at(begin + k - 1)
        g = grads(k - 1)[0].double()
        n = float(g.norm())
        state["v"] = n if k == 1 else math.sqrt(b2 * state["v"] ** 2 + (1 - b2) * n * n)
        state["m"] = (1 - b1) * g if state["m"] is None else b1 * state["m"] + (1 - b1) * g
        denom = state["v"] / math.sqrt(1 - b2 ** k) + 1e-8
        state["w"] = state["w"] - lr * ((state["m"] / (1 - b1 ** k)) / denom
                                        + 0.01 * state["w"])
    return state["w"]


def test_mp_lamb_add_param_group_and_scheduler():
    """LAMB clips by the norm of all gradients, so its reference runs on the whole set."""
    a = make_params(torch.float32, "cpu")
    b = [p.detach().clone().requires_grad_() for p in a]
    opt = FusedMixedPrecisionLamb(a[:3], lr=1e-2)
    opt.add_param_group({"params": a[3:], "lr": 5e-3})
    ref = FusedMixedPrecisionLamb([{"params": b[:3]}, {"params": b[3:], "lr": 5e-3}], lr=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    ref_sched = torch.optim.lr_scheduler.ExponentialLR(ref, gamma=0.9)
    for step in range(STEPS):
        for p, q, g in zip(a, b, grads_for(step, a)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    # the float64 reference over constant lr for the same grads, group lrs differing
    start = make_params(torch.float32, "cpu")
    c = [p.detach().clone().requires_grad_() for p in start]
    lamb = FusedMixedPrecisionLamb(c, lr=1e-2)
    run(lamb, c, STEPS)
    expected = lamb_reference(start, low_grads(c), 1e-2, (0.9, 0.999), 1e-6, 0.01, 1.0, STEPS)
    for p, e in zip(c, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=2e-6)


# ---------------------------------------------------------------------------- checkpoints
RESUME_CASES = [(f, d) for f in ("adagrad", "novograd", "novograd_inf", "mp_lamb", "adamw")
                for d in ("float32", "bfloat16", "float16")]

def make_resumable(family, dtype):
    params = make_params(getattr(torch, dtype), "cpu")
    return params, MAKERS[family](params)


def test_checkpoint_resumes_bit_for_bit_in_a_new_process(tmp_path):
    assert_resumes_bit_for_bit_in_a_new_process(tmp_path, __file__, RESUME_CASES, make_resumable,
                                                run)


def test_adagrad_loads_a_torch_adagrad_checkpoint():
    a = make_params(torch.float32, "cpu")
    torch_opt = torch.optim.Adagrad(a, lr=0.1)
    run(torch_opt, a, 4)
    b = [p.detach().clone().requires_grad_() for p in a]
    ours = FusedAdagrad(b, lr=0.1)
    ours.load_state_dict(torch_opt.state_dict())
    run(torch_opt, a, 6, seed=5)
    run(ours, b, 6, seed=5)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, **FP32_TOL)
    maximizing = torch.optim.Adagrad(a, lr=0.1, maximize=True)
    run(maximizing, a, 1)
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(ValueError, match=r"param_groups\[0\] comes from .*maximize=True"):
        ours.load_state_dict(maximizing.state_dict())
    after = ours.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][i]["sum"], before["state"][i]["sum"])
               for i in before["state"])


# ---------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_new_fused_ops(device):
    params = make_params(torch.bfloat16, device)
    grads = grads_for(0, params)
    masters = [p.detach().float() for p in params]
    zeros = lambda: [torch.zeros_like(m) for m in masters]
    scalars = lambda v=0.0: [torch.full((), v, device=device) for _ in params]
    lr = torch.tensor([1e-2], device=device)
    fi = torch.zeros(1, device=device)
    gs = torch.tensor([2.0], device=device)
    opcheck_op(torch.ops.peak.fused_adagrad_.default,
                          ([p.detach() for p in params], grads, masters, zeros(), scalars(), lr,
                           1e-10, 0.01, False, 0.0, gs, fi))
    for norm_type in (2, 0):
        opcheck_op(torch.ops.peak.fused_novograd_.default,
                              ([p.detach() for p in params], grads, masters, zeros(),
                               scalars(1.0), scalars(), lr, 0.9, 0.999, 1e-8, 0.01, True, False,
                               True, norm_type, False, gs, fi))
        opcheck_op(torch.ops.peak.fused_novograd_.default,
                              ([p.detach() for p in params], grads, masters, zeros(),
                               scalars(1.0), scalars(), lr, 0.9, 0.999, 1e-8, 0.01, True, False,
                               True, norm_type, False, gs, fi),
                              kwargs={"grad_norms": torch.ones(len(params), device=device)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [2, 0])
def test_novograd_given_norms_are_the_ones_it_computes(norm_type, device):
    """grad_norms (what a caller reduces over shards) replaces the op's own per-tensor norms:
    handed the op's own (ATen's foreach norm of the gradients as passed), the bits are the same;
    handed other norms, the step differs."""
    results = []
    for given in (None, "own", "doubled"):
        params = [p.detach().clone() for p in make_params(torch.float32, device)]
        moments = [torch.zeros_like(p) for p in params]
        norms = [torch.zeros((), device=device) for _ in params]
        steps = [torch.zeros((), device=device) for _ in params]
        for step in range(3):
            grads = grads_for(step, params)
            extra = {}
            if given is not None:
                own = torch.stack(torch._foreach_norm(grads, 2.0 if norm_type == 2 else
                                                      float("inf"), dtype=torch.float32))
                extra["grad_norms"] = own * (2.0 if given == "doubled" else 1.0)
            ops.fused_novograd_(params, grads, [], moments, norms, steps,
                                lr=torch.tensor([1e-2], device=device), beta1=0.9, beta2=0.98, eps=1e-8,
                                weight_decay=0.0, grad_averaging=True, reg_inside_moment=False,
                                bias_correction=True, norm_type=norm_type,
                                grad_scale=torch.tensor([4.0], device=device), **extra)
        results.append([params, moments, norms])
    assert_bitwise_equal(results[1], results[0])
    assert not bitwise_equal(results[2], results[0])
    with pytest.raises(RuntimeError, match="one norm per param"):
        ops.fused_novograd_(params, grads, [], moments, norms, steps, lr=torch.tensor([1e-2], device=device),
                            beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.0,
                            grad_averaging=True, reg_inside_moment=False, bias_correction=True,
                            grad_norms=torch.ones(1, device=device))


def test_fake_kernels_take_the_schema_defaults():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        p, g = [torch.empty(5)], [torch.empty(5)]
        st = [torch.zeros(())]
        torch.ops.peak.fused_adagrad_(p, g, [], [torch.zeros(5)], st, lr=torch.ones(1), eps=1e-10,
                                      weight_decay=0.0, adagrad_w_mode=False)
        torch.ops.peak.fused_novograd_(p, g, [], [torch.zeros(5)], [torch.zeros(())], st,
                                       lr=torch.ones(1), beta1=0.9, beta2=0.99, eps=1e-8,
                                       weight_decay=0.0, grad_averaging=True,
                                       reg_inside_moment=False, bias_correction=True)
        assert p[0].shape == (5,) and st[0].shape == ()  # (in place: the fakes change nothing)


def _call(ns, family, params, grads, masters, state, lr, found_inf, chunk):
    op = getattr(torch.ops, ns)
    if family == "adagrad":
        op.fused_adagrad_(params, grads, masters, state["m"], state["steps"], lr=lr, eps=1e-10,
                          weight_decay=0.01, adagrad_w_mode=False, lr_decay=0.01,
                          grad_scale=torch.tensor([4.0]), found_inf=found_inf, chunk_size=chunk)
    else:
        op.fused_novograd_(params, grads, masters, state["m"], state["v"], state["steps"], lr=lr,
                           beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_averaging=True,
                           reg_inside_moment=family == "novograd_inside", bias_correction=True,
                           norm_type=0 if family == "novograd_inside" else 2, init_zero=False,
                           grad_scale=torch.tensor([4.0]), found_inf=found_inf, chunk_size=chunk)


@pytest.mark.parametrize("family", ["adagrad", "novograd", "novograd_inside"])
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
@pytest.mark.parametrize("with_master", [True, False], ids=["master", "no_master"])
@pytest.mark.parametrize("grid", [(3, 4, 5), (0, 0, 0)], ids=["tiny_grid", "cuda_grid"])
def test_emulated_cuda_grid_equals_cpu_bitwise(family, dtype, with_master, grid):
    """The CUDA launcher's plan and per-block code, run on the CPU, give the CPU kernels' bits
    (NovoGrad's per-tensor norms are ATen's foreach norm on every backend, so they agree)."""
    runs = step_on_cpu_and_emulated_grid(
        grid, dtype, with_master,
        lambda sizes: {"m": [torch.full((n,), 0.1) for n in sizes],
                       "v": [torch.full((), 0.5) for _ in sizes],
                       "steps": [torch.tensor(float(i % 3)) for i in range(len(sizes))]},
        lambda ns, *args: _call(ns, family, *args, 64))
    (p1, m1, s1), (p2, m2, s2) = runs["peak"], runs["peak_emulated"]
    for a, b in zip(p1 + m1 + s1["m"] + s1["v"] + s1["steps"],
                    p2 + m2 + s2["m"] + s2["v"] + s2["steps"]):
        assert torch.equal(a, b)
    assert s1["steps"][1].item() == 1 + 3  # started at 1, 4 calls, one skipped


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(MAKERS))
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
def test_cuda_equals_cpu(family, dtype):
    results = {}
    for device in ("cpu", "cuda"):
        params = make_params(dtype, device)
        run(MAKERS[family](params), params, 10)
        results[device] = [p.detach().cpu() for p in params]
    for a, b in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(a, b, **(TOLERANCES[a.dtype] if a.dtype in LOW
                                            else dict(rtol=1e-5, atol=1e-6)))


def test_bad_arguments_name_the_argument_and_change_nothing():
    p = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="norm_type must be 2"):
        FusedNovoGrad(p, norm_type=1)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedNovoGrad(p, amsgrad=True)
    with pytest.raises(ValueError, match="Invalid lr_decay"):
        FusedAdagrad(p, lr_decay=-1.0)
    with pytest.raises(ValueError, match="adagrad_w_mode must be"):
        FusedAdagrad(p, adagrad_w_mode=1)
    params = [torch.ones(4)]
    grads = [torch.ones(4)]
    steps = [torch.zeros(())]
    with pytest.raises(RuntimeError, match="exp_avg_sqs has 0 tensors"):
        torch.ops.peak.fused_novograd_(params, grads, [], [torch.zeros(4)], [], steps,
                                       lr=torch.ones(1), beta1=0.9, beta2=0.99, eps=1e-8,
                                       weight_decay=0.0, grad_averaging=True,
                                       reg_inside_moment=False, bias_correction=True)
    with pytest.raises(RuntimeError, match="norm_type must be 2"):
        torch.ops.peak.fused_novograd_(params, grads, [], [torch.zeros(4)], [torch.zeros(())],
                                       steps, lr=torch.ones(1), beta1=0.9, beta2=0.99, eps=1e-8,
                                       weight_decay=0.0, grad_averaging=True,
                                       reg_inside_moment=False, bias_correction=True, norm_type=1)
    with pytest.raises(RuntimeError, match="state_sums must be float32"):
        torch.ops.peak.fused_adagrad_(params, grads, [], [torch.zeros(4, dtype=torch.float16)],
                                      steps, lr=torch.ones(1), eps=1e-10, weight_decay=0.0,
                                      adagrad_w_mode=False)
    assert steps[0].item() == 0 and torch.equal(params[0], torch.ones(4))  # nothing moved


# ---------------------------------------------------------------------------- LARC
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "scale"])
@pytest.mark.parametrize("inner", ["sgd", "fused_sgd"])
def test_larc_matches_float64_reference(clip, inner):
    ours = make_params(torch.float32, "cpu")
    start = [p.detach().clone() for p in ours]
    lr, wd = 0.1, 1e-3
    cls = torch.optim.SGD if inner == "sgd" else FusedSGD
    opt = LARC(cls(ours, lr=lr, momentum=0.9, weight_decay=wd), trust_coefficient=0.02,
               clip=clip)
    run(opt, ours, STEPS)
    assert opt.param_groups[0]["weight_decay"] == wd  # given back after each step
    expected = larc_reference(start, low_grads(ours), STEPS, lr, 0.9, wd, 0.02, clip, 1e-8)
    for p, e in zip(ours, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)


def test_larc_steps_float64_parameters_in_float64():
    """As Apex's LARC (torch.norm): float64 parameters work, their norms in float64 (the norms
    were asked for in float32, which torch refuses for float64 input)."""
    ours = make_params(torch.float64, "cpu")
    start = [p.detach().clone() for p in ours]
    opt = LARC(torch.optim.SGD(ours, lr=0.1, momentum=0.9, weight_decay=1e-3),
               trust_coefficient=0.02, clip=True)
    run(opt, ours, STEPS)
    expected = larc_reference(start, low_grads(ours), STEPS, 0.1, 0.9, 1e-3, 0.02, True, 1e-8)
    for p, e in zip(ours, expected):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p.detach(), e, rtol=1e-12, atol=1e-12)


def test_larc_leaves_zero_norm_gradients_alone_and_checks_arguments():
    w = torch.nn.Parameter(torch.zeros(3))
    opt = LARC(torch.optim.SGD([w], lr=0.5))
    w.grad = torch.ones(3)
    opt.step()
    assert torch.equal(w.detach(), torch.full((3,), -0.5))  # ||w|| == 0: plain SGD step
    with pytest.raises(TypeError, match="LARC wraps a torch.optim.Optimizer"):
        LARC(object())
    with pytest.raises(ValueError, match="trust_coefficient must be"):
        LARC(torch.optim.SGD([w], lr=0.1), trust_coefficient=-1)
    with pytest.raises(ValueError, match="clip must be"):
        LARC(torch.optim.SGD([w], lr=0.1), clip="yes")


def test_larc_state_dict_round_trip_and_scheduler():
    a = make_params(torch.float32, "cpu")
    opt = LARC(torch.optim.SGD(a, lr=0.1, momentum=0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for s in range(5):
        run(opt, a, 1, seed=10 + s)
        sched.step()
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd) == {"state", "param_groups"}  # the wrapped optimizer's, nothing of LARC's
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_b = LARC(torch.optim.SGD(b, lr=0.1, momentum=0.9))
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 2
    run(opt, a, 4, seed=3)
    run(opt_b, b, 4, seed=3)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    opt_b.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.3})
    assert len(opt_b.optim.param_groups) == 2


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_amp_initialize_accepts_larc(opt_level):
    """Apex's tests/L0/run_amp/test_larc.py: a LARC-wrapped SGD through initialize, then steps;
    with O0 it must equal LARC without amp, and any level must train (finite, changed)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(3)]
    model = make_mlp()
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3))
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0,
                                low_precision_dtype=torch.bfloat16)
    assert isinstance(opt, LARC)
    amp_steps(model, opt, data)
    ref = make_mlp()
    ref_opt = LARC(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3))
    for x, y in data:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    tol = FP32_TOL if opt_level == "O0" else TOLERANCES[torch.bfloat16] | dict(atol=2e-2)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.float(), q, **tol)
    if opt_level == "O2":  # masters in the groups, saved with the checkpoint
        sd = opt.state_dict()
        assert any("master_param" in st for st in sd["state"].values())


@pytest.mark.parametrize("scaler_kind", ["peak", "torch"])
def test_larc_with_grad_scaler_sees_unscaled_gradients(scaler_kind):
    """A scaler unscales before LARC's step (LARC does not take grad_scale: its norms need the
    true gradients); an overflow skips the whole step, inner optimizer included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    opt = LARC(FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3))
    ref_opt = LARC(FusedSGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3))
    scaler = (amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler_kind == "peak"
              else torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    x = torch.randn(4, 5)
    for poison in (False, True, False):
        opt.zero_grad()
        loss = model(x).square().mean() * (float("inf") if poison else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if not poison:
            ref_opt.zero_grad()
            ref(x).square().mean().backward()
            ref_opt.step()
    assert opt.param_groups[0]["weight_decay"] == 1e-3
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_larc_inside_fp16_optimizer_as_apex_documents():
    """Apex's LARC docstring: LARC can be wrapped by FP16_Optimizer (LARC then sees the fp32
    masters and their unscaled gradients): it trains, and the scale is static here, so no step
    is skipped."""
    import warnings

    from peak.fp16_utils import FP16_Optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 2)).half()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        opt = FP16_Optimizer(LARC(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                  trust_coefficient=0.5), static_loss_scale=128.0)
    x, y = torch.randn(32, 8).half(), torch.randn(32, 2)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert torch.equal(model[0].weight.detach(), opt.fp32_from_fp16_groups[0][0].half())


# ---------------------------------------------------------------------------- Apex checkpoints
def _apex_layout(sd, novograd=False, params=None):
    """A peak checkpoint rewritten as Apex's fused optimizers save theirs: the step count per
    group (an int), and for NovoGrad the running norms per group, [fp16 norms, fp32 norms]."""
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        steps = {int(sd["state"][pid].pop("step").item()) for pid in g["params"] if pid in sd["state"]}
        assert len(steps) == 1
        g["step"] = steps.pop()
        if novograd:
            half = [pid for pid, p in zip(g["params"], params) if p.dtype != torch.float32]
            full = [pid for pid, p in zip(g["params"], params) if p.dtype == torch.float32]
            g["exp_avg_sq"] = [torch.stack([sd["state"][pid].pop("exp_avg_sq").reshape(())
                                            for pid in ids]) if ids else torch.zeros(0)
                               for ids in (half, full)]
    return sd


@pytest.mark.parametrize("family", ["adam", "lamb", "novograd"])
def test_apex_checkpoint_with_group_steps_continues_where_it_stopped(family):
    """Apex keeps `step` (and NovoGrad's norms) per group: such a checkpoint must continue the
    bias correction and the norms, as resuming peak's own checkpoint does (same bits)."""
    make = {"adam": lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=True),
            "lamb": lambda ps: FusedLAMB(ps, lr=1e-2),
            "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2)}[family]

    def params():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(7).half())]

    def train(ps, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()

    ps = params()
    opt = make(ps)
    train(ps, opt, 5, 1)
    sd = opt.state_dict()
    results = []
    for layout in (sd, _apex_layout(sd, family == "novograd", ps)):
        qs = [p.detach().clone().requires_grad_() for p in ps]
        fresh = make(qs)
        fresh.load_state_dict(layout)
        assert all(float(fresh.state[q]["step"]) == 5 for q in qs)
        assert "step" not in fresh.param_groups[0] and "exp_avg_sq" not in fresh.param_groups[0]
        train(qs, fresh, 3, 2)
        results.append([q.detach().clone() for q in qs])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("norm_type", [2, 0], ids=["l2", "inf"])
def test_novograd_steps_past_an_empty_parameter(norm_type):
    # An empty gradient's norm is 0 (ATen refuses the infinity norm of an empty tensor): the
    # others step as without it, and a refused call moves no step count.
    torch.manual_seed(0)
    start = torch.randn(5)
    with_empty = [torch.nn.Parameter(start.clone()), torch.nn.Parameter(torch.randn(0))]
    alone = [torch.nn.Parameter(start.clone())]
    opts = [FusedNovoGrad(ps, lr=1e-2, norm_type=norm_type) for ps in (with_empty, alone)]
    for _ in range(3):
        g = torch.randn(5)
        with_empty[0].grad, with_empty[1].grad, alone[0].grad = g.clone(), torch.zeros(0), g
        for opt in opts:
            opt.step()
    assert_bitwise_equal(with_empty[0], alone[0])
    assert [opts[0].state[p]["step"].item() for p in with_empty] == [3.0, 3.0]
    steps = [torch.zeros(())]
    with pytest.raises(RuntimeError, match="grad_norms must be a float32 vector"):
        ops.fused_novograd_([torch.randn(3)], [torch.randn(3)], [], [torch.zeros(3)],
                            [torch.zeros(())], steps, lr=torch.tensor([1e-2]), beta1=0.9,
                            beta2=0.99, eps=1e-8, weight_decay=0.0, grad_averaging=True,
                            reg_inside_moment=False, bias_correction=True, norm_type=norm_type,
                            grad_norms=torch.zeros(2))
    assert steps[0].item() == 0.0


def test_larc_pickles_as_torchs_optimizers_do():
    """A LARC with an LR scheduler (which wraps the instance's step) or a step hook did not
    pickle (torch.save(optimizer)), where torch's optimizers do: as theirs, its pickle leaves the
    hooks and the scheduler's wrapper out, and the copy steps as the original."""
    a = make_params(torch.float32, "cpu")
    opt = LARC(torch.optim.SGD(a, lr=0.1, momentum=0.9))
    torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    opt.register_step_pre_hook(lambda *_: None)
    run(opt, a, 2, seed=4)
    copy_ = pickle.loads(pickle.dumps(opt))
    b = [p for g in copy_.param_groups for p in g["params"]]
    assert isinstance(copy_, LARC) and not copy_._optimizer_step_pre_hooks
    copy_.register_step_post_hook(lambda *_: None)  # (the hooks' machinery is back)
    run(opt, a, 3, seed=5)
    run(copy_, b, 3, seed=5)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_larc_under_amp_pickles_as_torchs_optimizers_do():
    """Under amp O2 a LARC's pickle carried amp's state of it (a weak reference in the masters'
    store, lambdas): torch.save(optimizer) raised, where a torch optimizer under amp saves its
    groups and state. Now the same: the copy steps the fp32 masters as the original's inner step."""
    from peak import amp
    model = torch.nn.Linear(8, 4)
    model, opt = amp.initialize(model, LARC(torch.optim.SGD(model.parameters(), lr=0.1)),
                                opt_level="O2", verbosity=0)
    try:
        with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        copy_ = pickle.loads(pickle.dumps(opt))
        assert isinstance(copy_, LARC) and "_amp_stash" not in vars(copy_)
        masters = [p.detach() for g in opt.param_groups for p in g["params"]]
        copied = [p.detach() for g in copy_.param_groups for p in g["params"]]
        assert [p.dtype for p in copied] == [torch.float32] * len(masters)
        for p, q in zip(masters, copied):
            assert torch.equal(p, q)
    finally:
        amp._amp_state.reset()


def test_step_hooks_run_once_for_optimizers_with_a_step_of_their_own():
    """FusedMixedPrecisionLamb and the Apex alias's FusedAdam have a step of their own over their
    base class's: once an instance of the base class was built, torch's hook machinery had
    wrapped the base's step too, and every step hook ran twice (an EMA in a post-hook twice)."""
    import peak.compat
    peak.compat.install_apex_alias()
    try:
        from apex.optimizers import FusedAdam as ApexFusedAdam
        for make, base in ((FusedMixedPrecisionLamb, FusedLAMB), (ApexFusedAdam, FusedAdam)):
            base([torch.nn.Parameter(torch.ones(2))])  # (hooks the base class's step)
            w = torch.nn.Parameter(torch.ones(3))
            opt, calls = make([w], lr=0.1), []
            opt.register_step_pre_hook(lambda *_: calls.append("pre"))
            opt.register_step_post_hook(lambda *_: calls.append("post"))
            w.grad = torch.ones(3)
            opt.step()
            assert calls == ["pre", "post"], make
    finally:
        peak.compat.uninstall_apex_alias()
