"""Gradient-norm clipping inside the fused step (NOTE: [Clipping inside the step] in
csrc/core/optimizer_ops.h): FusedSGD/FusedAdam(max_grad_norm=...), with the norm computed by
the optimizer, or by peak.amp.GradScaler / amp O2 in the same pass as their inf/NaN check."""
import copy

import pytest
import torch

import peak.amp.grad_scaler as peak_grad_scaler
from peak import amp, ops
from peak.optimizers import FusedAdam, FusedLAMB, FusedSGD
from peak_testing import HostReads, assert_poisoned_steps_skipped, opcheck_op, state_tensors

SHAPES = [(7, 13), (130,), (3, 5, 2), (65536 + 3,)]  # straddles a chunk boundary
LOW = [torch.float16, torch.bfloat16]


def make_params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def grads_for(step, params, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    # Norms vary around max_grad_norm = 40: some steps clip, some do not.
    mag = 0.02 if step % 3 == 0 else 0.3
    return [(torch.randn(p.shape, generator=g) * mag * scale).to(p.dtype) for p in params]


FAMILIES = {
    "sgd": (lambda ps, c: FusedSGD(ps, lr=0.05, momentum=0.9, max_grad_norm=c),
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "adamw": (lambda ps, c: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=True,
                                      max_grad_norm=c),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_clip_grad_norm_then_torch_optimizer(family):
    make_peak, make_torch = FAMILIES[family]
    params = make_params()
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = make_peak(params, 40.0), make_torch(ref)
    clipped = 0
    for step in range(20):
        gs = grads_for(step, params)
        for p, q, g in zip(params, ref, gs):
            p.grad, q.grad = g.clone(), g.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, 40.0)
        clipped += bool(norm > 40.0)
        opt.step()
        ref_opt.step()
    assert 5 <= clipped <= 15  # both regimes were exercised
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_no_clipping_below_the_norm_is_bitwise_the_unclipped_step():
    params = make_params()
    plain = [p.detach().clone().requires_grad_() for p in params]
    opt, opt_plain = FusedAdam(params, lr=1e-2, max_grad_norm=1e6), FusedAdam(plain, lr=1e-2)
    for step in range(5):
        for p, q, g in zip(params, plain, grads_for(step, params)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt_plain.step()
    for p, q in zip(params, plain):
        assert torch.equal(p, q)


def _count(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*a, **k):
        calls.append(1)
        return original(*a, **k)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("family", ["sgd", "adamw", "lamb"])
def test_grad_scaler_hands_the_norm_of_its_check(monkeypatch, dtype, family):
    """GradScaler + clipping fused optimizer: one read pass (the norm) serves as the inf/NaN check
    and the clipping; no other pass over the gradients, no host read; results bit-for-bit those
    of the same optimizer stepping the unscaled gradients by itself (the scale is a power of
    two), and an inf skips the step exactly as the check pass would."""
    make = {"sgd": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, max_grad_norm=40.0),
            "adamw": lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=True, max_grad_norm=40.0),
            "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, max_grad_norm=40.0)}[family]
    params = make_params(dtype)
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = make(params), make(ref)
    scaler = amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    norms = _count(monkeypatch, ops, "multi_tensor_l2norm")
    walks = _count(monkeypatch, peak_grad_scaler, "_unscale_param_grads")
    checks = _count(monkeypatch, ops, "multi_tensor_check_finite_")  # the one way to the check
    reads = HostReads()

    def step(i, poison):
        scale = scaler.get_scale()
        gs = grads_for(i, params)
        if poison:
            gs[1][3] = float("inf")
        for p, q, g in zip(params, ref, gs):
            p.grad = (g.float() * scale).to(dtype)
            q.grad = g.clone()
        scaler.scale(torch.ones(()))
        n_before = len(norms)
        with reads.counting():
            scaler.step(opt)
            scaler.update()
        assert len(norms) - n_before == 1  # one dtype: one pass

    assert_poisoned_steps_skipped(step, 12, {5}, lambda: state_tensors(params, opt),
                                  skipped=lambda: scaler.last_step_skipped,
                                  reference_step=lambda i: ref_opt.step(),
                                  reference_state=lambda: state_tensors(ref, ref_opt))
    assert reads.count == 0 and not walks and not checks


def test_grad_scaler_after_unscale_lets_the_optimizer_measure():
    """unscale_ before step (e.g. to log the norm): the step measures the unscaled gradients."""
    params = make_params()
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = FusedAdam(params, lr=1e-2, max_grad_norm=40.0), FusedAdam(ref, lr=1e-2,
                                                                             max_grad_norm=40.0)
    scaler = amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(4):
        gs = grads_for(step, params)
        for p, q, g in zip(params, ref, gs):
            p.grad, q.grad = g * 256.0, g.clone()
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
    for p, q in zip(params, ref):
        assert torch.equal(p, q)


@pytest.mark.parametrize("exponent,overflows", [(62, False), (64, True)])
def test_a_scaled_norm_past_fp32s_range_counts_as_an_overflow(exponent, overflows):
    """The rule the docs state (docs/core.md, "Clipping inside the step"): the norm is summed in
    fp32, so finite scaled gradients whose squares pass fp32's range (a scale grown far over fp32
    gradients) are an overflow: skipped, the scale backs off, nothing changes; below it the step
    is the unscaled gradients' step, bit for bit."""
    p, ref = torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True)
    opt, ref_opt = FusedAdam([p], lr=0.1, max_grad_norm=1.0), FusedAdam([ref], lr=0.1,
                                                                         max_grad_norm=1.0)
    scaler = amp.GradScaler("cpu", init_scale=2.0**exponent)
    scaler.scale(p.sum()).backward()  # every scaled gradient 2**exponent: finite
    assert torch.isfinite(p.grad).all()
    ref.grad = torch.ones(4)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**(exponent - 1 if overflows else exponent)
    if overflows:
        assert torch.equal(p.detach(), torch.ones(4)) and opt.state[p]["step"] == 0
        assert not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any()
    else:
        ref_opt.step()
        assert torch.equal(p, ref) and not torch.equal(p.detach(), torch.ones(4))


@pytest.mark.parametrize("dtype,loss_scale", [(LOW[0], 128.0), (LOW[1], 128.0), (LOW[1], None)],
                         ids=["fp16", "bf16", "bf16_static_1"])
def test_amp_o2_fused_path_clips_with_the_check_pass_norm(monkeypatch, dtype, loss_scale):
    """amp O2 with a clipping FusedAdam: scale_loss's exit takes the norm (no separate check
    pass), the step clips with it; equal bit-for-bit to the optimizer alone on fp32 masters fed
    the unscaled gradients. bf16's default static scale of 1 hands the step no grad_scale."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref_model = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, max_grad_norm=0.5)
    kw = {} if loss_scale is None else {"loss_scale": loss_scale}
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=dtype,
                                verbosity=0, **kw)
    scale = 1.0 if loss_scale is None else loss_scale
    ref_params = list(ref_model.parameters())
    ref_opt = FusedAdam(ref_params, lr=1e-2, max_grad_norm=0.5)
    checks = _count(monkeypatch, ops, "multi_tensor_check_finite_")
    for step in range(6):
        x = torch.randn(8, 16)
        loss = model(x.to(dtype)).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        grads = [p.grad.float() / scale for p in model.parameters()]
        opt.step()
        for q, g in zip(ref_params, grads):
            q.grad = g
        ref_opt.step()
        opt.zero_grad()
    assert not checks
    masters = [opt.state[p]["master_param"] for p in model.parameters()]
    for m, q in zip(masters, ref_params):
        assert torch.equal(m, q)


def test_errors():
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedAdam([p], max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedSGD([p], lr=0.1, max_grad_norm=-0.5)
    p.grad = torch.ones(4)
    with pytest.raises(TypeError, match="grad_norm must be a one-element floating tensor"):
        FusedAdam([p], max_grad_norm=1.0).step(grad_norm=1.0)
    # A loss scaler's tensors as numbers, or of the wrong size or device: refused, nothing stepped.
    opt, w0 = FusedAdam([p], lr=0.1), p.detach().clone()
    for kwargs in (dict(grad_scale=1024.0), dict(found_inf=0.0), dict(found_inf=torch.zeros(2)),
                   dict(found_inf=torch.zeros(1, device="meta")),
                   dict(grad_scale=torch.ones(1, dtype=torch.int32))):
        name = next(iter(kwargs))
        with pytest.raises(TypeError, match=f"step\\(\\): {name} must be a one-element floating "
                                            f"tensor on the parameters' device"):
            opt.step(**kwargs)
    assert torch.equal(p.detach(), w0) and not opt.state
    lr, st = torch.tensor([0.1]), [torch.zeros(())]
    with pytest.raises(RuntimeError, match="max_grad_norm > 0 needs grad_norm"):
        torch.ops.peak.fused_sgd_([p.detach()], [p.grad], [], [], st, lr=lr, momentum=0.0,
                                  dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                                  max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="grad_norm"):
        torch.ops.peak.fused_sgd_([p.detach()], [p.grad], [], [], st, lr=lr, momentum=0.0,
                                  dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                                  grad_norm=torch.ones(2), max_grad_norm=1.0)


def test_opcheck_and_emulated_grid():
    import peak
    params = make_params()
    grads = grads_for(0, params)
    zeros = lambda: [torch.zeros(p.shape) for p in params]
    steps = lambda: [torch.zeros(()) for _ in params]
    norm = torch.tensor([50.0])
    opcheck_op(torch.ops.peak.fused_adam_.default,
                          ([p.detach().clone() for p in params], grads, [], zeros(), zeros(), [],
                           steps(), torch.tensor([1e-2]), 0.9, 0.999, 1e-8, 0.0, False, True,
                           False, True, None, None, 65536, None, norm, 40.0))
    peak._C.emulated.set_grid_shape(3, 4, 5)
    try:
        outs = []
        for ns in ("peak", "peak_emulated"):
            ps = [p.detach().clone() for p in params]
            getattr(torch.ops, ns).fused_sgd_(ps, grads, [], zeros(), steps(),
                                              lr=torch.tensor([0.1]), momentum=0.9, dampening=0.0,
                                              weight_decay=0.0, nesterov=False, maximize=False,
                                              grad_scale=None, found_inf=None, chunk_size=4096,
                                              grad_norm=norm, max_grad_norm=40.0)
            outs.append(ps)
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        # and the factor was applied: 40/50 of an unclipped SGD step from the same start
        unclipped = [p.detach().clone() for p in params]
        torch.ops.peak.fused_sgd_(unclipped, grads, [], zeros(), steps(), lr=torch.tensor([0.1]),
                                  momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                                  maximize=False)
        for a, u, p in zip(outs[0], unclipped, params):
            torch.testing.assert_close(a - p.detach(), (u - p.detach()) * (40.0 / (50.0 + 1e-6)))
    finally:
        peak._C.emulated.set_grid_shape(0, 0, 0)
