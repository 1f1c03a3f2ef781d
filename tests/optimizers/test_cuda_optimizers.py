"""Every fused optimizer variant on CUDA against the same optimizer on the CPU, CUDA-graph
capture and replay of capturable steps, and the learning-rate tensor rule.

The comparisons run on every device of ``DEVICES``: on ``cpu`` the "other" run is the CPU again
(the configurations, the harness and the comparison run here, without a GPU); on ``cuda`` they
compare the CUDA kernels with the CPU kernels. The design promises the same bits on both for
every step whose math does not depend on an L2 norm (docs/core.md: one functor per op, no FP
contraction, the same stateless random bits); steps that clip by a norm, LAMB's trust ratios and
NovoGrad's layer norms sum in another order on CUDA, so they are compared within fp32 rounding.
"""

import pytest
import torch

from peak.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD)
from peak.optimizers._base import FusedOptimizer

from peak_testing import DEVICES, state_tensors
from test_fused_optimizers import grads_for, make_params

BF16, F16, F32, U8 = torch.bfloat16, torch.float16, torch.float32, torch.uint8
LEAN = dict(store_param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
Q8 = dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8)

# name: (class, kwargs, parameter dtype, bit-for-bit)
CASES = {
    "adamw_f32": (FusedAdam, dict(lr=1e-2, weight_decay=0.1, adam_w_mode=True), F32, True),
    "adam_l2_f16_masters": (FusedAdam, dict(lr=1e-2, weight_decay=0.1), F16, True),
    "adamw_bf16_masters": (FusedAdam, dict(lr=1e-2, weight_decay=0.1, adam_w_mode=True), BF16,
                           True),
    "amsgrad_bf16": (FusedAdam, dict(lr=1e-2, amsgrad=True, maximize=True), BF16, True),
    "adam_remainders": (FusedAdam, dict(lr=1e-2, adam_w_mode=True,
                                        store_param_remainders=True), BF16, True),
    "adam_lean_bf16_moments": (FusedAdam, dict(lr=1e-2, adam_w_mode=True, **LEAN), BF16, True),
    "adam_bf16_moments_nearest": (FusedAdam, dict(lr=1e-2, exp_avg_dtype=BF16,
                                                  exp_avg_sq_dtype=BF16,
                                                  moment_rounding="nearest"), BF16, True),
    "adam_8bit_remainders": (FusedAdam, dict(lr=1e-2, adam_w_mode=True,
                                             store_param_remainders=True, **Q8), BF16, True),
    "adam_8bit_f16_masters": (FusedAdam, dict(lr=1e-2, **Q8), F16, True),
    "adam_8bit_nearest_f32": (FusedAdam, dict(lr=1e-2, moment_rounding="nearest", **Q8), F32,
                              True),
    "adam_stochastic_rounding": (FusedAdam, dict(lr=1e-2, master_weights=False,
                                                 stochastic_rounding=True), BF16, True),
    "adam_clip_bf16": (FusedAdam, dict(lr=1e-2, adam_w_mode=True, max_grad_norm=1.0), BF16,
                       False),
    "sgd_nesterov_f32": (FusedSGD, dict(lr=0.05, momentum=0.9, nesterov=True,
                                        weight_decay=1e-2), F32, True),
    "sgd_momentum_f16": (FusedSGD, dict(lr=0.05, momentum=0.9, dampening=0.1), F16, True),
    "sgd_8bit_remainders": (FusedSGD, dict(lr=0.05, momentum=0.9, store_param_remainders=True,
                                           momentum_dtype=U8), BF16, True),
    "sgd_stochastic_rounding": (FusedSGD, dict(lr=0.05, momentum=0.9, master_weights=False,
                                               stochastic_rounding=True), BF16, True),
    "sgd_clip_f16": (FusedSGD, dict(lr=0.05, momentum=0.9, max_grad_norm=0.5), F16, False),
    "adagrad_f32": (FusedAdagrad, dict(lr=0.05, weight_decay=0.01, lr_decay=0.01), F32, True),
    "adagrad_bf16": (FusedAdagrad, dict(lr=0.05, adagrad_w_mode=True, weight_decay=0.01), BF16,
                     True),
    "lamb_f32": (FusedLAMB, dict(lr=1e-2, weight_decay=0.01), F32, False),
    "lamb_bf16_nvlamb": (FusedLAMB, dict(lr=1e-2, use_nvlamb=True, max_grad_norm=0.0), BF16,
                         False),
    "lamb_8bit": (FusedLAMB, dict(lr=1e-2, **Q8), BF16, False),
    "novograd_f32": (FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01), F32, False),
    "novograd_f16_inf_norm": (FusedNovoGrad, dict(lr=1e-2, norm_type=0, init_zero=True), F16,
                              False),
}
GRAD_SCALE = 8.0  # a power of two, as loss scalers use


def stepped(case, device, steps=4, skip_step=2):
    """``steps`` steps of seeded gradients (scaled by GRAD_SCALE and handed the scale, as a
    GradScaler does), step ``skip_step`` skipped by found_inf. Returns the weights and every
    optimizer state tensor, on the CPU."""
    cls, kwargs, dtype, _ = CASES[case]
    params = make_params(dtype, device)
    opt = cls(params, **kwargs)
    for step in range(steps):
        for p, g in zip(params, grads_for(step, params)):
            p.grad = g * GRAD_SCALE
        found = torch.full((1,), float(step == skip_step), device=device)
        opt.step(grad_scale=torch.full((1,), GRAD_SCALE, device=device), found_inf=found)
    return [t.cpu() for t in state_tensors(params, opt, held_params=False)]


def assert_close_state(a, b):
    """Within fp32 rounding of a norm's summation order: fp32 values to 1e-5, low-precision
    weights and moments to one ulp, 8-bit codes to one code, step counts exactly."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype in (torch.uint8, torch.int16) or a.dim() == 0:
        tol = 1 if a.dtype == torch.uint8 else 0
        assert (a.int() - b.int()).abs().max().item() <= tol
        return
    rtol = {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2}[a.dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=1e-6)


def assert_close_quantized_norm_state(got, ref, lr, steps=4):
    """A step with 8-bit moments whose math reads a norm (LAMB: the clipping norm and the trust
    ratios) on two backends: the norms' summation orders differ by fp32 rounding, which moves a
    few moments across a code boundary, and a flipped code changes that element's update by a
    code step (3-6%), and through the trust ratio the whole tensor's a little. So: few codes
    differ (a signed code near zero can flip its sign bit: the integers are not compared), the
    scales agree to fp32 rounding, and the weights within a small part of what the steps moved
    them (measured on the emulated grid over six seeds and three block sizes: at most 1.1% of
    steps * lr * max|w| for the fp32 masters, 9.2% for the bf16 weights, one bf16 ulp) -- a
    tolerance 4-5x the largest seen."""
    assert len(got) == len(ref)
    after_codes = False
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.dtype == torch.uint8:
            flips = int((a != b).sum())
            assert flips <= max(2, 2e-3 * a.numel()), (flips, a.numel())
        elif after_codes:  # the codes' fp32 scales (state_tensors lists each after its codes)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
        elif a.dim() == 0:
            assert torch.equal(a, b)  # step counts
        else:
            moved = steps * lr * b.float().abs().max().item()
            tol = (0.05 if a.dtype == F32 else 0.4) * moved
            diff = (a.float() - b.float()).abs().max().item()
            assert diff <= tol, (a.dtype, tuple(a.shape), diff, tol)
        after_codes = a.dtype == torch.uint8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_device_matches_cpu(case, device):
    ref = stepped(case, "cpu")
    got = stepped(case, device)
    assert len(got) == len(ref)
    cls, kwargs, _, exact = CASES[case]
    if kwargs.get("exp_avg_dtype") == U8 and not exact:
        assert_close_quantized_norm_state(got, ref, kwargs["lr"])
        return
    for a, b in zip(got, ref):
        if exact:
            assert a.dtype == b.dtype and torch.equal(a, b), case
        else:
            assert_close_state(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_stream_matches_cpu_on_200k_elements(device):
    """The random bits of stochastic rounding (a hash of index, value, seed and step) give the
    same bf16 weights on every backend, over a tensor of several chunks."""
    def run(dev):
        g = torch.Generator().manual_seed(11)
        w = torch.nn.Parameter(torch.randn(200_003, generator=g).to(BF16).to(dev))
        opt = FusedSGD([w], lr=1e-3, master_weights=False, stochastic_rounding=True)
        opt.param_groups[0]["stochastic_rounding_seed"] = 1234
        for step in range(3):
            w.grad = torch.randn(200_003, generator=g).to(BF16).to(dev)
            opt.step()
        return w.detach().cpu()
    a, b = run("cpu"), run(device)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert (a != torch.randn(200_003, generator=torch.Generator().manual_seed(11)).to(BF16)).any()


# --------------------------------------------------------------------------- learning rate
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls, kwargs", [(FusedAdam, dict(adam_w_mode=True)),
                                         (FusedSGD, dict(momentum=0.9)),
                                         (FusedLAMB, dict())], ids=["adam", "sgd", "lamb"])
def test_tensor_lr_changed_in_place_is_read_by_the_step(device, cls, kwargs):
    """A float32 lr tensor on the parameters' device is read by the kernels from its memory
    (NOTE: [Learning rate under CUDA-graph capture]): changing it in place between steps gives
    the steps of a float lr changed in the group."""
    lrs = [1e-2, 5e-3, 2e-2, 1e-3]
    runs = []
    for as_tensor in (False, True):
        params = make_params(BF16, device)
        lr = torch.tensor(lrs[0], device=device) if as_tensor else lrs[0]
        opt = cls(params, lr=lr, capturable=True, **kwargs)
        for step, value in enumerate(lrs):
            if as_tensor:
                lr.fill_(value)
                assert opt.param_groups[0]["lr"] is lr
            else:
                opt.param_groups[0]["lr"] = value
            for p, g in zip(params, grads_for(step, params)):
                p.grad = g
            opt.step()
        runs.append(state_tensors(params, opt, held_params=False))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_cpu_tensor_lr_for_cuda_parameters_is_refused_under_capture(monkeypatch):
    """Under capture a CPU lr tensor could not be read at replay: refused with the fix. (Only
    the check is exercised: capture is faked, so this runs without a GPU.)"""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="Keep lr on the parameters' device"):
        FusedOptimizer._lr_tensor({"lr": torch.tensor(0.1)}, torch.device("cuda"))
    # on the parameters' device (here faked as the CPU), the tensor itself is read: a view
    lr = torch.tensor(0.1)
    assert FusedOptimizer._lr_tensor({"lr": lr}, torch.device("cpu")).data_ptr() == lr.data_ptr()


# --------------------------------------------------------------------- CUDA-graph capture
GRAPH_CASES = {
    "adamw_bf16_masters": (FusedAdam, dict(adam_w_mode=True, weight_decay=0.1), BF16),
    "adam_lean_8bit": (FusedAdam, dict(adam_w_mode=True, store_param_remainders=True, **Q8),
                       BF16),
    "adam_clip": (FusedAdam, dict(max_grad_norm=1.0), F16),  # the global norm: finish_norms
    "sgd_stochastic_rounding": (FusedSGD, dict(momentum=0.9, master_weights=False,
                                               stochastic_rounding=True), BF16),
    "lamb": (FusedLAMB, dict(weight_decay=0.01), F32),  # per-tensor norms: finish_norms
    "adagrad": (FusedAdagrad, dict(), F32),
}
GRAPH_LRS = [1e-2, 5e-3, 2e-2, 1e-3, 3e-2]


def _set_grads(params, step):
    for p, g in zip(params, grads_for(step, params)):
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)  # in place: a captured step reads the same memory


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_captured_step_replays_with_lr_changed_between_replays(case):
    """capturable=True: a step captured once and replayed, with new gradients and a new lr
    written in place before each replay, equals the same steps taken eagerly (bit for bit: the
    same kernels in the same order). Norm segment offsets live in the graph's kernel arguments,
    so replays after other host allocations read the right ones."""
    cls, kwargs, dtype = GRAPH_CASES[case]

    def build():
        params = make_params(dtype, "cuda")
        lr = torch.tensor(GRAPH_LRS[0], device="cuda")
        return params, cls(params, lr=lr, capturable=True, **kwargs), lr

    params_e, opt_e, lr_e = build()
    _set_grads(params_e, 0)
    opt_e.step()
    for i, value in enumerate(GRAPH_LRS):
        lr_e.fill_(value)
        _set_grads(params_e, i + 1)
        opt_e.step()

    params_g, opt_g, lr_g = build()
    _set_grads(params_g, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt_g.step()  # the first step creates the state: not capturable
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_g.step()
    for i, value in enumerate(GRAPH_LRS):
        lr_g.fill_(value)
        _set_grads(params_g, i + 1)
        # host allocations between replays (pinned memory too): nothing of the graph may read them
        junk = [torch.empty(4096, pin_memory=True).fill_(-1.0) for _ in range(4)]
        graph.replay()
        del junk
    torch.cuda.synchronize()
    eager = state_tensors(params_e, opt_e, held_params=False)
    replayed = state_tensors(params_g, opt_g, held_params=False)
    for a, b in zip(eager, replayed):
        assert torch.equal(a, b), case


@pytest.mark.cuda
def test_float_lr_is_frozen_at_capture():
    """A float lr is made into a tensor inside the captured step: replays use the value it had
    at capture, whatever the group says later (as torch's optimizers under capture)."""
    runs = []
    for captured in (False, True):
        params = make_params(F32, "cuda")
        opt = FusedAdam(params, lr=1e-2, capturable=True)
        _set_grads(params, 0)
        opt.step()
        if captured:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                opt.step()
            opt.param_groups[0]["lr"] = 0.5  # not seen by the replay
            graph.replay()
        else:
            opt.step()
        torch.cuda.synchronize()
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
