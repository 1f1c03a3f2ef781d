"""peak.optimizers against torch.optim (SGD/Adam/AdamW) and a float64 LAMB reference."""
import copy
import math
import warnings

import pytest
import torch

from peak import amp, ops
from peak.optimizers import FusedAdam, FusedLAMB, FusedSGD, export_fp32_state_dict

from peak_testing import (opcheck_op, DEVICES, TOLERANCES, dtype_id, assert_bitwise_equal,
                          assert_poisoned_steps_skipped, assert_resumes_bit_for_bit_in_a_new_process,
                          state_tensors, step_on_cpu_and_emulated_grid)

LOW = [torch.float16, torch.bfloat16]
SHAPES = [(7, 13), (130,), (3, 5, 2), (1,), (65536 + 3,)]  # straddles a chunk boundary

SGD_CONFIGS = {
    "plain": dict(lr=0.05),
    "momentum": dict(lr=0.05, momentum=0.9),
    "nesterov_wd": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "dampening_maximize": dict(lr=0.05, momentum=0.8, dampening=0.3, maximize=True),
}
ADAM_CONFIGS = {
    "adam": (dict(lr=1e-2), torch.optim.Adam, {}),
    "adam_l2": (dict(lr=1e-2, weight_decay=0.1), torch.optim.Adam, {}),
    "adamw": (dict(lr=1e-2, weight_decay=0.1, adam_w_mode=True), torch.optim.AdamW, {}),
    "amsgrad": (dict(lr=1e-2, amsgrad=True), torch.optim.Adam, {}),
    "maximize_betas": (dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, maximize=True),
                       torch.optim.Adam, {}),
}


def make_params(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_()
            for s in SHAPES]


def grads_for(step, params, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype) for p in params]


def run(opt, params, steps, seed=1, transform=None, grads_like=None):
    """``steps`` steps with reproducible grads, drawn in the dtype of ``grads_like`` (default:
    the params) and passed through ``transform``."""
    for step in range(steps):
        for p, g in zip(params, grads_for(step, grads_like or params, seed)):
            p.grad = transform(g) if transform else g
        opt.step()


def torch_kwargs(cfg):
    return {k: v for k, v in cfg.items() if k not in ("adam_w_mode",)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", list(SGD_CONFIGS))
def test_sgd_matches_torch_fp32(device, cfg):
    ours = make_params(torch.float32, device)
    ref = [p.detach().clone().requires_grad_() for p in ours]
    run(FusedSGD(ours, **SGD_CONFIGS[cfg]), ours, 20)
    run(torch.optim.SGD(ref, **SGD_CONFIGS[cfg]), ref, 20)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", list(ADAM_CONFIGS))
def test_adam_matches_torch_fp32(device, cfg):
    ours_cfg, torch_cls, _ = ADAM_CONFIGS[cfg]
    ours = make_params(torch.float32, device)
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedAdam(ours, **ours_cfg)
    run(opt, ours, 25)
    torch_opt = torch_cls(ref, **torch_kwargs(ours_cfg))
    run(torch_opt, ref, 25)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-9)
        assert opt.state[p]["step"].item() == 25


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("family", ["sgd", "adamw"])
def test_master_weights_low_precision_model(device, dtype, family):
    """fp16/bf16 params + grads: the fp32 masters follow torch.optim on fp32 copies fed the same
    (low-precision) grads; the model weights are exactly the masters rounded once."""
    ours = make_params(dtype, device)
    ref = [p.detach().float().requires_grad_() for p in ours]
    if family == "sgd":
        opt = FusedSGD(ours, lr=0.05, momentum=0.9)
        torch_opt = torch.optim.SGD(ref, lr=0.05, momentum=0.9)
    else:
        opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=True)
        torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    run(opt, ours, 20)
    run(torch_opt, ref, 20, transform=lambda g: g.float(), grads_like=ours)
    for p, r in zip(ours, ref):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and p.dtype == dtype
        torch.testing.assert_close(master, r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), master.to(dtype))


def lamb_reference(params, grads_per_step, lr, betas, eps, wd, max_grad_norm, steps):
    """Apex FusedLAMB's algorithm in float64 (adam_w_mode, grad averaging, bias correction)."""
    w = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    b1, b2 = betas
    for step in range(1, steps + 1):
        grads = [g.double() for g in grads_per_step(step - 1)]
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        clip = norm / max_grad_norm if max_grad_norm > 0 and norm > max_grad_norm else 1.0
        for i, g in enumerate(grads):
            g = g / clip
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            update = (m[i] / (1 - b1 ** step)) / ((v[i] / (1 - b2 ** step)).sqrt() + eps)
            update = update + wd * w[i]
            wn, un = float(w[i].norm()), float(update.norm())
            ratio = lr * (wn / un) if (wd != 0 and wn != 0 and un != 0) else lr
            w[i] = w[i] - ratio * update
    return w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_lamb_matches_float64_reference(device, dtype, max_grad_norm):
    ours = make_params(dtype, device)
    start = [p.detach().float().clone() for p in ours]
    opt = FusedLAMB(ours, lr=1e-2, weight_decay=0.01, max_grad_norm=max_grad_norm)
    run(opt, ours, 20)
    expected = lamb_reference(start, lambda s: grads_for(s, ours), 1e-2, (0.9, 0.999), 1e-6,
                              0.01, max_grad_norm, 20)
    for p, e in zip(ours, expected):
        got = opt.state[p]["master_param"] if dtype != torch.float32 else p.detach()
        torch.testing.assert_close(got.double(), e.to(got.device), rtol=1e-4, atol=1e-5)


def snapshot(opt, params):
    return [p.detach().clone() for p in params], {
        id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
@pytest.mark.parametrize("make", [
    lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    lambda ps: FusedAdam(ps, lr=1e-2, amsgrad=True),
    lambda ps: FusedLAMB(ps, lr=1e-2)], ids=["sgd", "adam", "lamb"])
# Any nonzero flag skips: torch's GradScaler hands a model on two devices the sum of their flags,
# a SUM all-reduce gives up to the world size, a flag from a NaN norm is NaN.
@pytest.mark.parametrize("flag", [1.0, 3.0, float("nan")], ids=["one", "sum", "nan"])
def test_overflow_skips_everything_bit_for_bit(device, dtype, make, flag):
    params = make_params(dtype, device)
    opt = make(params)
    run(opt, params, 3)  # state exists and is non-trivial
    before_params, before_state = snapshot(opt, params)
    for p, g in zip(params, grads_for(7, params)):
        p.grad = g
    params[1].grad[5] = float("inf")
    found = torch.full((1,), flag, device=device)
    opt.step(grad_scale=torch.full((1,), 1024.0, device=device), found_inf=found)
    for p, b in zip(params, before_params):
        assert torch.equal(p.detach(), b)
    for p in params:
        for k, v in opt.state[p].items():
            assert torch.equal(v, before_state[id(p)][k]), k
    # and the next clean step proceeds from there, counting from the old step
    for p, g in zip(params, grads_for(8, params)):
        p.grad = g
    opt.step(found_inf=torch.zeros(1, device=device))
    assert all(opt.state[p]["step"].item() == 4 for p in params)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
def test_grad_scale_unscales_inside_the_step(device, dtype):
    a = make_params(dtype, device)
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_a, opt_b = FusedAdam(a, lr=1e-2), FusedAdam(b, lr=1e-2)
    scale = 2.0 ** 10  # a power of two: scaling is exact, so results must be identical
    for step in range(5):
        for p, q, g in zip(a, b, grads_for(step, a)):
            p.grad, q.grad = g, (g.float() * scale).to(dtype)
        opt_a.step()
        opt_b.step(grad_scale=torch.tensor([scale], device=device),
                   found_inf=torch.zeros(1, device=device))
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_frozen_params_missing_grads_groups_and_add_param_group():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    ref = copy.deepcopy(net)
    net[0].bias.requires_grad_(False)
    ref[0].bias.requires_grad_(False)
    groups = lambda m: [{"params": [m[0].weight, m[0].bias], "lr": 0.01},
                        {"params": [], "lr": 0.5},
                        {"params": [m[1].weight], "weight_decay": 0.1}]
    opt = FusedAdam(groups(net), lr=0.02, weight_decay=0.01, adam_w_mode=True)
    torch_opt = torch.optim.AdamW(groups(ref), lr=0.02)
    extra, extra_ref = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    torch_sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=3, gamma=0.5)
    for step in range(12):
        if step == 4:
            opt.add_param_group({"params": [extra, net[1].bias], "lr": 0.03})
            torch_opt.add_param_group({"params": [extra_ref, ref[1].bias], "lr": 0.03})
        x = torch.randn(5, 6)
        for model, o, e in ((net, opt, extra), (ref, torch_opt, extra_ref)):
            o.zero_grad()
            # e gets a grad every other step only: its step count must lag the others'
            loss = model(x).square().mean() + ((e * 2).sum() if step % 2 else 0.0)
            loss.backward()
            o.step()
        sched.step()
        torch_sched.step()
    for a, b in zip(list(net.parameters()) + [extra], list(ref.parameters()) + [extra_ref]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert net[0].bias.grad is None and net[0].bias not in opt.state
    assert opt.state[extra]["step"].item() == torch_opt.state[extra_ref]["step"].item() == 4


def test_lr_as_tensor():
    a = make_params(torch.float32, "cpu")
    b = [p.detach().clone().requires_grad_() for p in a]
    run(FusedSGD(a, lr=torch.tensor(0.05)), a, 3)
    run(FusedSGD(b, lr=0.05), b, 3)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_bad_hyperparameters_and_inputs():
    p = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="Invalid learning rate"):
        FusedAdam(p, lr=-1)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        FusedAdam(p, betas=(0.9, 1.0))
    for betas in (True, (0.9,)):  # Apex's positional order (bias_correction third), a short pair
        with pytest.raises(ValueError, match=r"betas must be a pair .*bias_correction third"):
            FusedAdam(p, 1e-3, betas)
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        FusedSGD(p, nesterov=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB(p, amsgrad=True)
    with pytest.raises(ValueError, match="master_weights must be"):
        FusedAdam(p, master_weights="yes")
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    q.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(TypeError, match="supports float32, float16 and bfloat16"):
        FusedAdam([q]).step()
    r = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    r.grad_dtype = None  # torch >= 2.13 otherwise refuses the mismatched grad itself
    r.grad = torch.ones(3)
    with pytest.raises(TypeError, match="gradient has dtype torch.float32 but its parameter"):
        FusedSGD([r]).step()


@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
def test_state_dict_round_trip_in_memory(dtype):
    a = make_params(dtype, "cpu")
    opt = FusedAdam(a, lr=1e-2, amsgrad=True)
    run(opt, a, 5)
    sd = copy.deepcopy(opt.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_b = FusedAdam(b, lr=1e-2, amsgrad=True)
    opt_b.load_state_dict(sd)
    for p, q in zip(a, b):
        for k, v in opt.state[p].items():
            assert opt_b.state[q][k].dtype == torch.float32
            assert torch.equal(opt_b.state[q][k], v), k
    run(opt, a, 5, seed=3)
    run(opt_b, b, 5, seed=3)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_loads_a_torch_adam_state_dict():
    a = make_params(torch.float32, "cpu")
    torch_opt = torch.optim.Adam(a, lr=1e-2)
    run(torch_opt, a, 4)
    b = [p.detach().clone().requires_grad_() for p in a]
    ours = FusedAdam(b, lr=1e-2)
    ours.load_state_dict(torch_opt.state_dict())
    run(torch_opt, a, 6, seed=5)
    run(ours, b, 6, seed=5)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_export_fp32_state_dict_uses_the_masters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    sd = export_fp32_state_dict(model, opt)
    assert all(v.dtype == torch.float32 for k, v in sd.items() if "num_batches" not in k)
    assert torch.equal(sd["0.weight"], opt.state[model[0].weight]["master_param"])
    assert not torch.equal(sd["0.weight"], model[0].weight.float())  # the masters are finer


RESUME_CASES = [(f, d) for f in ("adam", "sgd", "lamb") for d in ("float32", "bfloat16", "float16")]

def make_resumable(family, dtype):
    cls = {"adam": FusedAdam, "sgd": FusedSGD, "lamb": FusedLAMB}[family]
    kw = {"sgd": dict(lr=0.05, momentum=0.9)}.get(family, dict(lr=1e-2, weight_decay=0.01))
    params = make_params(getattr(torch, dtype), "cpu")
    return params, cls(params, **kw)


def test_checkpoint_resumes_bit_for_bit_in_a_new_process(tmp_path):
    """6 steps, save, load in a NEW process, 5 more steps == 11 uninterrupted steps, bitwise,
    for every family and dtype (masters and fp32 state come back exactly)."""
    assert_resumes_bit_for_bit_in_a_new_process(tmp_path, __file__, RESUME_CASES, make_resumable,
                                                run)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
def test_cuda_equals_cpu(dtype):
    results = {}
    for device in ("cpu", "cuda"):
        params = make_params(dtype, device)
        opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, adam_w_mode=True)
        run(opt, params, 10)
        results[device] = [p.detach().cpu() for p in params]
    for a, b in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_fused_ops(device):
    params = make_params(torch.bfloat16, device)
    grads = grads_for(0, params)
    masters = [p.detach().float() for p in params]
    zeros = lambda: [torch.zeros_like(m) for m in masters]
    steps = lambda: [torch.zeros((), device=device) for _ in params]
    lr = torch.tensor([1e-2], device=device)
    fi = torch.zeros(1, device=device)
    gs = torch.tensor([2.0], device=device)
    opcheck_op(torch.ops.peak.fused_adam_.default,
                          ([p.detach() for p in params], grads, masters, zeros(), zeros(), zeros(),
                           steps(), lr, 0.9, 0.999, 1e-8, 0.0, True, False, False, True, gs, fi))
    opcheck_op(torch.ops.peak.fused_sgd_.default,
                          ([p.detach() for p in params], grads, masters, zeros(), steps(), lr,
                           0.9, 0.0, 0.0, False, False, gs, fi))
    opcheck_op(torch.ops.peak.fused_lamb_.default,
                          ([p.detach() for p in params], grads, masters, zeros(), zeros(), steps(),
                           lr, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False, None, gs, fi))
    opcheck_op(torch.ops.peak.multi_tensor_check_finite_.default,
                          (grads, fi, 64, torch.zeros(len(grads), device=device)))
    # the variants that write the unscaled gradients back (NOTE: [Unscaled gradients after the step])
    store = {"store_unscaled_grads": True}
    opcheck_op(torch.ops.peak.fused_adam_.default,
                          ([p.detach() for p in params], grads, masters, zeros(), zeros(), zeros(),
                           steps(), lr, 0.9, 0.999, 1e-8, 0.0, True, False, False, True, gs, fi),
                          kwargs=store)
    opcheck_op(torch.ops.peak.fused_sgd_.default,
                          ([p.detach() for p in params], grads, masters, zeros(), steps(), lr,
                           0.9, 0.0, 0.0, False, False, gs, fi), kwargs=store)
    opcheck_op(torch.ops.peak.fused_lamb_.default,
                          ([p.detach() for p in params], grads, masters, zeros(), zeros(), steps(),
                           lr, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False, None, gs, fi),
                          kwargs=store)

    # LAMB in two calls (NOTE: [LAMB in two calls]): stage 1 into updates, stage 2 from norms
    updates = [torch.empty_like(m) for m in masters]
    norm = torch.ones(1, device=device)
    opcheck_op(torch.ops.peak.fused_lamb_.default,
                          ([p.detach() for p in params], grads, masters, zeros(), zeros(), steps(),
                           lr, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False, norm, gs, fi),
                          kwargs={"updates": updates})
    norms = torch.ones(len(params), device=device)
    opcheck_op(torch.ops.peak.fused_lamb_.default,
                          ([p.detach() for p in params], grads, masters, zeros(), zeros(), steps(),
                           lr, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False, None, gs, fi),
                          kwargs={"updates": updates, "weight_norms": norms,
                                  "update_norms": norms})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_master", [False, True], ids=["fp32 weights", "bf16 + masters"])
def test_lamb_in_two_calls_is_the_one_call_bit_for_bit(with_master, device):
    """Stage 1 into the caller's updates, the per-tensor norms (here this process's own), then
    stage 2: the bits of the one-call step, skipped steps included."""
    dtype = torch.bfloat16 if with_master else torch.float32
    runs = []
    for two_calls in (False, True):
        params = [p.detach().clone() for p in make_params(dtype, device)]
        masters = [p.float() for p in params] if with_master else []
        state = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in range(2)]
        steps = [torch.zeros((), device=device) for _ in params]
        for step in range(4):
            grads = grads_for(step, params)
            found_inf = torch.tensor([1.0 if step == 2 else 0.0], device=device)
            grad_norm, _ = ops.multi_tensor_l2norm(grads)  # (on shards: reduced over the mesh)
            args = (params, grads, masters, state[0], state[1], steps)
            kwargs = dict(lr=torch.tensor([1e-2], device=device), beta1=0.9, beta2=0.999,
                          eps=1e-6, weight_decay=0.01, adam_w_mode=True, grad_averaging=True,
                          bias_correction=True, max_grad_norm=1.0, use_nvlamb=False,
                          grad_scale=torch.tensor([2.0], device=device), found_inf=found_inf,
                          grad_norm=grad_norm)
            if not two_calls:
                ops.fused_lamb_(*args, **kwargs)
                continue
            updates = [torch.empty_like(p, dtype=torch.float32) for p in params]
            ops.fused_lamb_(*args, **kwargs, updates=updates)
            _, weight_norms = ops.multi_tensor_l2norm(masters or params, per_tensor=True)
            _, update_norms = ops.multi_tensor_l2norm(updates, per_tensor=True)
            ops.fused_lamb_(*args, **kwargs, updates=updates, weight_norms=weight_norms,
                            update_norms=update_norms)
        runs.append([params, masters, state, steps])
    assert_bitwise_equal(runs[1], runs[0])


def test_lamb_stage_arguments_are_checked():
    params = [torch.zeros(4)]
    base = ([p.clone() for p in params], [torch.ones(4)], [], [torch.zeros(4)], [torch.zeros(4)],
            [torch.zeros(())])
    kwargs = dict(lr=torch.tensor([1e-2]), beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                  adam_w_mode=True, grad_averaging=True, bias_correction=True, max_grad_norm=1.0,
                  use_nvlamb=False)
    with pytest.raises(RuntimeError, match="pass the updates that stage 1 wrote"):
        ops.fused_lamb_(*base, **kwargs, weight_norms=torch.ones(1), update_norms=torch.ones(1))
    with pytest.raises(RuntimeError, match="only one of the two norm tensors"):
        ops.fused_lamb_(*base, **kwargs, updates=[torch.zeros(4)], weight_norms=torch.ones(1))
    with pytest.raises(RuntimeError, match=r"updates\[0\] must be a contiguous float32"):
        ops.fused_lamb_(*base, **kwargs, updates=[torch.zeros(3)])
    with pytest.raises(RuntimeError, match="one norm per param"):
        ops.fused_lamb_(*base, **kwargs, updates=[torch.zeros(4)], weight_norms=torch.ones(2),
                        update_norms=torch.ones(2))
    with pytest.raises(RuntimeError, match="pass grad_norm"):  # (clipping by a shard's norm)
        ops.fused_lamb_(*base, **kwargs, updates=[torch.zeros(4)])


def _fused_call(ns, family, params, grads, masters, state, lr, found_inf, chunk, store=False):
    op = getattr(torch.ops, ns)
    steps = state["steps"]
    if family == "adam":
        op.fused_adam_(params, grads, masters, state["m"], state["v"], state["vmax"], steps, lr=lr,
                       beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, amsgrad=True,
                       adam_w_mode=True, maximize=False, bias_correction=True,
                       grad_scale=torch.tensor([4.0]), found_inf=found_inf, chunk_size=chunk,
                       store_unscaled_grads=store)
    elif family == "sgd":
        op.fused_sgd_(params, grads, masters, state["m"], steps, lr=lr, momentum=0.9, dampening=0.1,
                      weight_decay=0.01, nesterov=False, maximize=False,
                      grad_scale=torch.tensor([4.0]), found_inf=found_inf, chunk_size=chunk,
                      store_unscaled_grads=store)
    else:
        op.fused_lamb_(params, grads, masters, state["m"], state["v"], steps, lr=lr, beta1=0.9,
                       beta2=0.99, eps=1e-6, weight_decay=0.01, adam_w_mode=True,
                       grad_averaging=True, bias_correction=True, max_grad_norm=1.0,
                       use_nvlamb=False, grad_norm=None, grad_scale=torch.tensor([4.0]),
                       found_inf=found_inf, chunk_size=chunk, store_unscaled_grads=store)


@pytest.mark.parametrize("family", ["adam", "sgd", "lamb"])
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
@pytest.mark.parametrize("with_master", [True, False], ids=["master", "no_master"])
@pytest.mark.parametrize("grid", [(3, 4, 5), (0, 0, 0)], ids=["tiny_grid", "cuda_grid"])
def test_unscaled_grads_written_back_on_every_backend(family, dtype, with_master, grid):
    """store_unscaled_grads: after a step the gradients hold grad / grad_scale (exact for the
    power-of-two scale), on the CPU launcher and through the emulated CUDA grid alike; the weights
    are those of the step without the store; a skipped step leaves the gradients as they were."""
    peak_C = __import__("peak")._C
    g = torch.Generator().manual_seed(5)
    sizes = [((i * 71) % 300) + 1 for i in range(30)]
    base = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads0 = [(torch.randn(n, generator=g) * 8).to(dtype) for n in sizes]
    results = {}
    peak_C.emulated.set_grid_shape(*grid)
    try:
        for ns in ("peak", "peak_emulated"):
            for store in (False, True):
                for skip in (0.0, 1.0):
                    params = [b.clone() for b in base]
                    masters = [b.float().clone() for b in base] if with_master else []
                    state = {"m": [torch.zeros(n) for n in sizes],
                             "v": [torch.zeros(n) for n in sizes],
                             "vmax": [torch.zeros(n) for n in sizes],
                             "steps": [torch.tensor(0.0) for _ in sizes]}
                    grads = [gr.clone() for gr in grads0]
                    _fused_call(ns, family, params, grads, masters, state, torch.tensor([1e-2]),
                                torch.tensor([skip]), 64, store=store)
                    results[(ns, store, skip)] = (params, grads)
    finally:
        peak_C.emulated.set_grid_shape(0, 0, 0)
    for ns in ("peak", "peak_emulated"):
        for skip in (0.0, 1.0):
            p_plain, g_plain = results[(ns, False, skip)]
            p_store, g_store = results[(ns, True, skip)]
            for a, b in zip(p_plain, p_store):
                assert torch.equal(a, b)
            for before, a, b in zip(grads0, g_plain, g_store):
                assert torch.equal(a, before)
                assert torch.equal(b, before if skip else (before.float() / 4).to(dtype))
    if family != "lamb":  # (LAMB's norms sum in another order on the grid: see below)
        for key in [(False, 0.0), (True, 0.0)]:
            for a, b in zip(*(results[(ns,) + key][0] for ns in ("peak", "peak_emulated"))):
                assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["adam", "sgd", "lamb"])
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
@pytest.mark.parametrize("with_master", [True, False], ids=["master", "no_master"])
@pytest.mark.parametrize("grid", [(3, 4, 5), (0, 0, 0)], ids=["tiny_grid", "cuda_grid"])
def test_emulated_cuda_grid_equals_cpu_bitwise(family, dtype, with_master, grid):
    """The CUDA launcher's plan, its metadata (with per-tensor step pointers) and its per-block
    code, run on the CPU, give the CPU kernels' bits -- over several launches, with a skipped
    step and tensors whose step counts differ."""
    runs = step_on_cpu_and_emulated_grid(
        grid, dtype, with_master,
        lambda sizes: {"m": [torch.zeros(n) for n in sizes], "v": [torch.zeros(n) for n in sizes],
                       "vmax": [torch.zeros(n) for n in sizes],
                       "steps": [torch.tensor(float(i % 3)) for i in range(len(sizes))]},
        lambda ns, *args: _fused_call(ns, family, *args, 64))
    (p1, m1, s1), (p2, m2, s2) = runs["peak"], runs["peak_emulated"]
    for a, b in zip(p1 + m1 + s1["m"] + s1["v"] + s1["steps"], p2 + m2 + s2["m"] + s2["v"] + s2["steps"]):
        if family == "lamb":
            # LAMB's norms are sums in a different order on the grid (per thread, then per
            # block) than on the CPU (per lane): equal up to fp32 summation error only, which
            # may flip the rounding of a low-precision weight by one ulp.
            torch.testing.assert_close(a, b, **(TOLERANCES[a.dtype] if a.dtype in LOW
                                               else dict(rtol=1e-5, atol=1e-6)))
        else:
            assert torch.equal(a, b)
    assert s1["steps"][1].item() == 1 + 3  # started at 1, 4 calls, one skipped


@pytest.mark.parametrize("family", ["adam", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=dtype_id)
def test_grid_vector_and_element_paths_step_alike(family, dtype):
    """NOTE: [Aligned vector access]: an optimizer step through the emulated grid moves four
    elements per list at once when the lists are aligned, one at a time for views at an odd
    offset into flat buffers (Apex's flattened parameters); both give the CPU kernels' bits."""
    peak_C = __import__("peak")._C
    g = torch.Generator().manual_seed(21)
    sizes = [130, 7, 3, 64, 257]
    base = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads0 = [(torch.randn(n, generator=g) * 4).to(dtype) for n in sizes]

    def at(offset, tensors):
        views = []
        for t in tensors:
            buf = torch.zeros(t.numel() + offset + 4, dtype=t.dtype)
            views.append(buf[offset:offset + t.numel()])
            views[-1].copy_(t)
        return views

    runs = {}
    for ns, offset in (("peak", 0), ("peak_emulated", 0), ("peak_emulated", 1)):
        params, grads = at(offset, base), at(offset, grads0)
        masters = at(offset, [b.float() for b in base]) if dtype != torch.float32 else []
        state = {"m": at(offset, [torch.zeros(n) for n in sizes]),
                 "v": at(offset, [torch.zeros(n) for n in sizes]),
                 "vmax": at(offset, [torch.zeros(n) for n in sizes]),
                 "steps": [torch.tensor(0.0) for _ in sizes]}
        peak_C.emulated.take_vectorised_blocks()
        for _ in range(2):
            _fused_call(ns, family, params, grads, masters, state, torch.tensor([1e-2]),
                        torch.tensor([0.0]), 64)
        took = peak_C.emulated.take_vectorised_blocks()
        if ns == "peak_emulated":  # 2 steps x (2 + 1 + 0 + 1 + 4 blocks of >= 4 elements)
            assert took == (16 if offset == 0 else 0)
        runs[(ns, offset)] = params + masters + state["m"] + state["v"]
    for a, b, c in zip(*runs.values()):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("make",
                         [lambda p: FusedAdam(p, lr=1e-2), lambda p: FusedSGD(p, lr=0.1, momentum=0.9)],
                         ids=["adam", "sgd"])
def test_torch_grad_scaler_hands_off_by_attributes(make):
    """torch.amp.GradScaler sets optimizer.grad_scale / found_inf (not keywords): an overflow must
    skip the step, and a clean step must unscale -- same result as no scaler at all."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
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

    assert_poisoned_steps_skipped(step, 3, {1}, lambda: state_tensors(model, opt),
                                  reference_step=reference_step)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_export_fp32_state_dict_tied_weights_get_the_master_under_both_names():
    emb = torch.nn.Embedding(10, 4)
    out = torch.nn.Linear(4, 10, bias=False)
    out.weight = emb.weight  # tied, as language models do
    model = torch.nn.ModuleDict({"emb": emb, "out": out}).to(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model["out"](model["emb"](torch.arange(3))).float().sum().backward()
    opt.step()
    sd = export_fp32_state_dict(model, opt)
    master = opt.state[emb.weight]["master_param"]
    assert torch.equal(sd["emb.weight"], master) and torch.equal(sd["out.weight"], master)


def test_export_fp32_state_dict_from_amp_o2_and_fp16_optimizer():
    from peak import amp
    from peak.fp16_utils import FP16_Optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                low_precision_dtype=torch.bfloat16)
    with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    sd = export_fp32_state_dict(model, opt)
    assert torch.equal(sd["weight"], amp.master_params(opt).__next__())

    half = torch.nn.Linear(4, 4).half()
    with pytest.warns(DeprecationWarning):
        wrapped = FP16_Optimizer(torch.optim.SGD(half.parameters(), lr=0.1), static_loss_scale=8.)
    wrapped.backward(half(torch.randn(3, 4).half()).float().sum())
    wrapped.step()
    sd = export_fp32_state_dict(half, wrapped)
    assert torch.equal(sd["weight"], wrapped.master_params[0])
    assert not torch.equal(sd["weight"], half.weight.float())


def test_torch_adamw_checkpoint_keeps_stepping_as_adamw():
    """torch's AdamW state dict says 'decoupled_weight_decay'; loading it into a FusedAdam built
    without adam_w_mode must not turn it into L2 Adam (and ours loads into torch's Adam as AdamW)."""
    ref = make_params(torch.float32, "cpu")
    ours = [p.detach().clone().requires_grad_() for p in ref]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.5)
    run(torch_opt, ref, 3)
    with torch.no_grad():
        for a, b in zip(ours, ref):
            a.copy_(b)
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.5)
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["adam_w_mode"] is True
    run(opt, ours, 5, seed=7)
    run(torch_opt, ref, 5, seed=7)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    back = torch.optim.Adam([p.detach().clone().requires_grad_() for p in ours], lr=1e-2)
    back.load_state_dict(opt.state_dict())
    assert back.param_groups[0]["decoupled_weight_decay"] is True
    # torch's Adam (L2) checkpoint into FusedAdamW, as into torch's AdamW: the group says what the
    # step does (it said decoupled_weight_decay=False while stepping as AdamW)
    from peak.optimizers import FusedAdamW
    l2 = torch.optim.Adam([p.detach().clone().requires_grad_() for p in ours], weight_decay=0.1)
    for into in (FusedAdamW([p.detach().clone().requires_grad_() for p in ours]),
                 torch.optim.AdamW([p.detach().clone().requires_grad_() for p in ours])):
        into.load_state_dict(l2.state_dict())
        assert into.param_groups[0]["decoupled_weight_decay"] is True


@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_momentum_switched_on_mid_run_follows_torch(dampening):
    """A momentum warm-up from 0 (OneCycleLR/CyclicLR with base_momentum=0 do this): torch seeds
    the new buffer with the gradient."""
    ours = make_params(torch.float32, "cpu")
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedSGD(ours, lr=0.05, momentum=0.0, dampening=dampening)
    torch_opt = torch.optim.SGD(ref, lr=0.05, momentum=0.0, dampening=dampening)
    for o, params in ((opt, ours), (torch_opt, ref)):
        run(o, params, 3)
        o.param_groups[0]["momentum"] = 0.9
        run(o, params, 4, seed=3)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_apex_constructor_arguments():
    p = torch.nn.Parameter(torch.randn(3))
    for cls in (FusedSGD, FusedAdam, FusedLAMB):
        opt = cls([p], lr=0.1, set_grad_none=False)
        p.grad = torch.ones(3)
        opt.zero_grad()
        assert p.grad is not None and not p.grad.any()  # zeroed, as Apex's set_grad_none=False
        opt.zero_grad(set_to_none=True)
        assert p.grad is None
        assert cls([p], lr=0.1).set_grad_none is True  # torch's default
    # Apex's positional order for FusedSGD and FusedLAMB
    FusedSGD([p], 0.1, 0.9, 0.0, 0.0, False, False, True, False)
    lamb = FusedLAMB([p], 1e-3, True, (0.9, 0.999), 1e-6, 0.01, False, True, True, False, 2.0)
    assert lamb.param_groups[0]["max_grad_norm"] == 2.0 and lamb.set_grad_none is False
    with pytest.raises(NotImplementedError, match="wd_after_momentum"):
        FusedSGD([p], lr=0.1, wd_after_momentum=True)
    FusedSGD([p], lr=0.1, materialize_master_grads=False)  # a no-op for peak (never materialized)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        FusedAdam([p], lr=torch.tensor(-1.0))


@pytest.mark.parametrize("optimizer", [FusedAdam, FusedSGD, FusedLAMB], ids=lambda c: c.__name__)
def test_compiled_step_is_the_eager_step_without_recompiles(optimizer):
    """``opt.step = torch.compile(opt.step)`` (as with torch's optimizers) under peak's GradScaler:
    the eager step's bits, and no graph compiled per parameter (24 here, over Dynamo's recompile
    limit of 8) nor any recompile warning."""
    from torch._dynamo.utils import counters

    def train(compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)]).to(torch.bfloat16)
        opt = optimizer(model.parameters(), lr=1e-2)
        if compiled:
            opt.step = torch.compile(opt.step)
        scaler = amp.GradScaler("cpu")
        for _ in range(3):
            loss = model(torch.randn(4, 8, dtype=torch.bfloat16)).float().square().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return state_tensors(model, opt)

    eager = train(False)
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train(True)
    assert_bitwise_equal(compiled, eager)
    assert counters["stats"]["unique_graphs"] == 0
    assert not [str(w.message) for w in caught
                if "recompile" in str(w.message) or "Dynamo" in str(w.message)]


@pytest.mark.parametrize("inner", ["SGD", "FusedAdam"])
def test_export_fp32_state_dict_through_an_optimizer_wrapper_under_amp_o2(inner):
    """LARC (or any wrapper sharing the param_groups) around the optimizer amp O2 set up: the
    export takes the masters of amp's store (it took the bf16 weights, widened), for the wrapper
    and the inner optimizer alike; so does export_fp32_optimizer_state_dict."""
    from peak import amp
    from peak.optimizers import LARC, export_fp32_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    make = torch.optim.SGD if inner == "SGD" else FusedAdam
    opt = LARC(make(model.parameters(), lr=0.1))
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                low_precision_dtype=torch.bfloat16)
    for _ in range(2):
        with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
    masters = [m.detach() for m in amp.master_params(opt)]
    assert not torch.equal(masters[0], model.weight.float())
    for optimizer in (opt, opt.optim):
        sd = export_fp32_state_dict(model, optimizer)
        assert torch.equal(sd["weight"], masters[0]) and torch.equal(sd["bias"], masters[1])
    exported = export_fp32_optimizer_state_dict(opt)
    assert torch.equal(exported["state"][0]["master_param"], masters[0])


def test_export_fp32_state_dict_through_a_wrapper_around_fp16_optimizer():
    """A wrapper that keeps FP16_Optimizer (not a torch.optim.Optimizer) in .optimizer and shares
    its param_groups, as Accelerate's AcceleratedOptimizer does: the export takes its masters (it
    took the half weights, widened)."""
    from peak.fp16_utils import FP16_Optimizer

    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        param_groups = property(lambda self: self.optimizer.param_groups)
        state = property(lambda self: self.optimizer.state)

    torch.manual_seed(0)
    half = torch.nn.Linear(4, 4).bfloat16()
    with pytest.warns(DeprecationWarning):
        inner = FP16_Optimizer(torch.optim.SGD(half.parameters(), lr=0.1), static_loss_scale=8.)
    for _ in range(2):
        inner.backward(half(torch.randn(3, 4).bfloat16()).float().sum())
        inner.step()
    sd = export_fp32_state_dict(half, Wrapper(Wrapper(inner)))
    assert torch.equal(sd["weight"], inner.master_params[0])
    assert not torch.equal(sd["weight"], half.weight.float())


@pytest.mark.parametrize("order", ["model_first", "optimizer_first", "no_model"])
def test_low_precision_checkpoint_into_fp32_parameters_takes_the_exact_masters(order):
    """A FusedAdamW checkpoint of a bf16 model (fp32 masters in its state) resumed over an fp32
    model: the parameters take the exact masters when the model's state_dict saved with them is
    loaded, before or after the optimizer's (the masters were dropped and the run went on from the
    rounded weights); without it, none does, not even a LayerNorm weight whose fresh ones are the
    bf16 rounding of masters near 1. The next step equals one from fp32 weights and state
    exported from the bf16 run."""
    from peak.optimizers import FusedAdamW, export_fp32_optimizer_state_dict

    def make():
        return torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.LayerNorm(3))

    def set_grads(model, seed):
        for p in model.parameters():
            g = torch.Generator().manual_seed(seed)
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

    torch.manual_seed(0)
    low = make().bfloat16()
    low_opt = FusedAdamW(low.parameters(), lr=1e-3)
    for i in range(3):
        set_grads(low, i)
        low_opt.step()
    ckpt = copy.deepcopy({"model": low.state_dict(), "opt": low_opt.state_dict()})
    exact, exact_opt = export_fp32_state_dict(low, low_opt), export_fp32_optimizer_state_dict(low_opt)
    assert (exact["1.weight"].bfloat16() == 1).any()  # (near 1: some round to the fresh 1s)

    torch.manual_seed(1)
    model = make()
    start = copy.deepcopy(model.state_dict())
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    if order == "model_first":
        model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    if order == "optimizer_first":
        model.load_state_dict(ckpt["model"])
    set_grads(model, 7)
    opt.step()

    ref = make()
    ref.load_state_dict(start if order == "no_model" else exact)
    ref_opt = FusedAdamW(ref.parameters(), lr=1e-3)
    ref_opt.load_state_dict({"state": {k: {n: v for n, v in s.items() if n != "master_param"}
                                       for k, s in exact_opt["state"].items()},
                             "param_groups": exact_opt["param_groups"]})
    set_grads(ref, 7)
    ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)
    assert not torch.equal(exact["0.weight"], exact["0.weight"].bfloat16().float())


def test_stale_masters_a_torch_optimizer_kept_do_not_become_fp32_weights():
    """A peak bf16 checkpoint trained on in fp32 by torch's AdamW (which keeps the unknown
    'master_param' entries as they were) with the LayerNorm frozen, then loaded into an fp32
    FusedAdamW: the trained weights no longer round from their masters, so no saved master
    replaces a weight, not even the frozen LayerNorm's, whose did not move."""
    from peak.optimizers import FusedAdamW

    def make():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))

    torch.manual_seed(0)
    x = torch.randn(5, 4)
    low = make().bfloat16()
    low_opt = FusedAdamW(low.parameters(), lr=1e-3)
    for _ in range(3):
        low(x.bfloat16()).float().pow(2).sum().backward()
        low_opt.step()
        low_opt.zero_grad()
    fp32 = make()
    fp32.load_state_dict(low.state_dict())
    torch_opt = torch.optim.AdamW(fp32.parameters(), lr=1e-3)
    torch_opt.load_state_dict(copy.deepcopy(low_opt.state_dict()))
    fp32[1].requires_grad_(False)
    for _ in range(3):
        fp32(x).pow(2).sum().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    fp32[1].requires_grad_(True)
    saved = copy.deepcopy({"model": fp32.state_dict(), "opt": torch_opt.state_dict()})
    assert "master_param" in saved["opt"]["state"][2]  # (stale: kept by torch)
    for model_first in (True, False):
        model = make()
        opt = FusedAdamW(model.parameters(), lr=1e-3)
        if model_first:
            model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if not model_first:
            model.load_state_dict(saved["model"])
        opt.state_dict()  # (a state read settles the load)
        for name, value in model.state_dict().items():
            assert torch.equal(value, saved["model"][name]), name


_THROUGH_TORCH = {  # peak's optimizer before, torch's, peak's after
    "adamw": (lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=True),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2),
              lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=True)),
    "sgd": (lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
            lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9)),
    "adamw into remainders": (
        lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=True, store_param_remainders=True)),
    "remainders into remainders": (
        lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=True, store_param_remainders=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=True, store_param_remainders=True))}


@pytest.mark.parametrize("family,dtype", [(f, d) for f in _THROUGH_TORCH
                                          for d in (torch.bfloat16, torch.float16)
                                          if d == torch.bfloat16 or "remainders" not in f])
@pytest.mark.parametrize("model_first", [True, False], ids=["model first", "optimizer first"])
def test_a_checkpoint_through_a_low_precision_torch_optimizer_loads_back(family, dtype,
                                                                        model_first):
    """A peak bf16/fp16 checkpoint loaded into torch's optimizer over the same low-precision
    model (torch's load casts every floating state entry to the parameter's dtype, 'master_param'
    and a remainder too), trained on, saved, and loaded back into peak: it loads (it was refused
    as damaged), and the weights torch trained are the masters (a remainder optimizer loaded
    after the model put the stale masters' rounding back into the model), the moments torch's."""
    make_peak, make_torch, make_back = _THROUGH_TORCH[family]  # (remainders: bf16 alone)

    def make():
        torch.manual_seed(0)
        return torch.nn.Linear(8, 8).to(dtype)

    def train(model, opt, steps):
        for s in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s)).to(dtype)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    model = make()
    opt = make_peak(model.parameters())
    train(model, opt, 2)
    via = make()
    via.load_state_dict(model.state_dict())
    via_opt = make_torch(via.parameters())
    via_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(v.dtype == dtype for k, v in via_opt.state[via.weight].items()
               if k.startswith("master_param"))  # (torch cast it)
    train(via, via_opt, 2)
    saved = copy.deepcopy({"model": via.state_dict(), "opt": via_opt.state_dict()})
    back = make()
    back_opt = make_back(back.parameters())
    loads = [lambda: back.load_state_dict(saved["model"]),
             lambda: back_opt.load_state_dict(saved["opt"])]
    for load in loads if model_first else loads[::-1]:
        load()
    for p, q in zip(back.parameters(), via.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(back_opt.master_of(p), q.detach().float())
        moment = "momentum_buffer" if family == "sgd" else "exp_avg"
        assert torch.equal(back_opt.state[p][moment], via_opt.state[q][moment].float())


def test_a_group_option_the_step_would_ignore_is_refused_before_anything_steps():
    """torch's options set on a group by hand (or through add_param_group): FusedAdagrad has no
    maximize (it would descend where torch's ascends), FusedAdam reads adam_w_mode, not torch's
    decoupled_weight_decay; refused before any group steps, so nothing changes."""
    from peak.optimizers import FusedAdagrad

    for make, key, value in ((FusedAdagrad, "maximize", True),
                             (FusedAdam, "decoupled_weight_decay", True)):
        torch.manual_seed(0)
        first, second = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
        opt = make([first], lr=0.1, weight_decay=0.1)
        opt.add_param_group({"params": [second], key: value})
        first.grad, second.grad = torch.ones(4), torch.ones(4)
        before = [first.detach().clone(), second.detach().clone()]
        with pytest.raises(ValueError, match=key):
            opt.step()
        assert torch.equal(first, before[0]) and torch.equal(second, before[1])
        assert not opt.state
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4))
    ref_weight = torch.nn.Parameter(weight.detach().clone())
    opt = FusedAdam([weight], lr=0.1, weight_decay=0.1)
    opt.param_groups[0].update(decoupled_weight_decay=True, adam_w_mode=True)  # (both alike)
    ref = torch.optim.AdamW([ref_weight], lr=0.1, weight_decay=0.1)
    for w in (weight, ref_weight):
        w.grad = torch.linspace(-1, 1, 4)
    opt.step()
    ref.step()
    torch.testing.assert_close(weight, ref_weight, rtol=1e-6, atol=1e-7)


def test_torchs_adam_key_on_a_lamb_group_is_not_refused():
    """FusedLAMB's adam_w_mode is its own (LAMB's decay mode), not torch Adam's switch: a group
    that went through torch's Adam (which adds decoupled_weight_decay) still steps."""
    weight = torch.nn.Parameter(torch.randn(4))
    lamb = FusedLAMB([weight], lr=0.1, weight_decay=0.01)
    torch_adam = torch.optim.Adam([weight], lr=0.1)
    torch_adam.load_state_dict(lamb.state_dict())
    lamb.load_state_dict(torch_adam.state_dict())
    assert lamb.param_groups[0]["decoupled_weight_decay"] is False
    before = weight.detach().clone()
    weight.grad = torch.ones(4)
    lamb.step()
    assert not torch.equal(weight, before)


def test_a_remainder_is_kept_through_a_masterless_load_after_new_memory_of_the_same_values():
    """``p.data = p.data.clone()`` (new memory, the same bits) then an optimizer checkpoint
    without masters (torch's): the remainders kept stand for the same masters, bit for bit."""
    from peak.optimizers.masters import masters_by_param

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).bfloat16()
    opt = FusedAdam(model.parameters(), lr=1e-3, store_param_remainders=True)
    x = torch.randn(4, 8).bfloat16()
    for _ in range(3):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    for state in saved["state"].values():
        state.pop("master_param", None)
        state.pop("master_param_remainder", None)
    masters = {k: v.clone() for k, v in masters_by_param(opt).items()}
    for p in model.parameters():
        p.data = p.data.clone()
    opt.load_state_dict(saved)
    after = masters_by_param(opt)
    for key, master in masters.items():
        assert torch.equal(after[key].reshape(master.shape), master)
