"""bf16 stochastic rounding of the fused optimizers without master weights (NOTE: [Stochastic
rounding to bf16] in csrc/core/stochastic_rounding.h)."""
import subprocess
import sys
import textwrap

import pytest
import torch

from peak.optimizers import FusedAdam, FusedSGD
from peak_testing import opcheck_op

BF16 = torch.bfloat16


def bf16_neighbours(x: torch.Tensor):
    """The bf16 values just below and just above each fp32 value (equal when x is one)."""
    down = x.to(BF16)
    down = torch.where(down.float() > x, torch.nextafter(down, torch.tensor(-float("inf"),
                                                                            dtype=BF16)), down)
    up = torch.where(down.float() < x, torch.nextafter(down, torch.tensor(float("inf"), dtype=BF16)), down)
    return down.float(), up.float()


def one_step(opt_cls, w0, g, seed=0, **kw):
    p = torch.nn.Parameter(w0.clone())
    p.grad = g.clone()
    torch.manual_seed(seed)
    opt = opt_cls([p], master_weights=False, stochastic_rounding=True, **kw)
    opt.step()
    return p.detach(), opt


@pytest.mark.parametrize("family", ["adamw", "sgd"])
def test_each_weight_is_a_neighbour_of_the_fp32_update_and_unbiased(family):
    """One step from bf16 weights: every stored weight is one of the two bf16 values around the
    fp32 result (computed by torch.optim on fp32 copies), and over 200K elements the mean
    rounding error is ~0 while round-to-nearest is biased (updates below half an ulp vanish)."""
    torch.manual_seed(0)
    n = 200_000
    w0 = (1 + torch.rand(n)).to(BF16)  # in [1, 2): one ulp = 2**-7
    g = torch.randn(n).to(BF16)
    if family == "adamw":
        make, kw = FusedAdam, dict(lr=1e-3, adam_w_mode=True, weight_decay=0.01)
        ref_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)
    else:
        make, kw = FusedSGD, dict(lr=1e-3, momentum=0.9)
        ref_opt = lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)
    out, _ = one_step(make, w0, g, **kw)
    ref = torch.nn.Parameter(w0.float())
    ref.grad = g.float()
    ref_opt([ref]).step()
    exact = ref.detach()
    down, up = bf16_neighbours(exact)
    got = out.float()
    # fp32 math may differ from torch's by an fp32 ulp; that can only matter where the exact
    # value is (within 1e-6 relative) a bf16 value itself.
    near_grid = (exact - down).abs() < 1e-6 * exact.abs()
    assert torch.all((got == down) | (got == up) | near_grid)
    assert (got == up).any() and (got == down).any()
    ulp = 2.0 ** -7
    step = (exact - w0.float()).abs()
    assert step.median() < ulp / 2  # the regime where round-to-nearest loses the update
    sigma = ulp / 2 / n ** 0.5  # the standard error of a mean of n errors within one ulp
    assert abs((got - exact).double().mean().item()) < 5 * sigma
    # The round-to-nearest control (the same step without stochastic rounding) is biased where
    # the weights move one way: those updates are mostly lost. Stochastic rounding is not.
    p = torch.nn.Parameter(w0.clone())
    p.grad = g.clone()
    make([p], master_weights=False, **kw).step()
    nearest = p.detach().float()
    assert torch.equal(nearest, exact.to(BF16).float())
    up_moves = exact > w0.float()
    m = int(up_moves.sum())
    assert m > n // 4
    err_sr = (got - exact)[up_moves].double().mean().item()
    err_rn = (nearest - exact)[up_moves].double().mean().item()
    assert abs(err_sr) < 5 * ulp / 2 / m ** 0.5
    assert err_rn < -50 * ulp / 2 / m ** 0.5


def test_small_updates_accumulate_over_many_steps():
    """lr far below half an ulp: round-to-nearest leaves bf16 weights frozen; with stochastic
    rounding the mean weight follows the exact trajectory. Every element starts equal and gets
    the same gradient, so only their index tells their random bits apart: were they to round
    alike, the mean would be a single random walk, far outside the tolerance."""
    torch.manual_seed(0)
    n, steps, lr = 50_000, 40, 1e-4
    w0 = torch.ones(n, dtype=BF16)
    grad = torch.ones(n)  # a constant gradient: w(t) = 1 - lr * t exactly in the reference
    sr = torch.nn.Parameter(w0.clone())
    rn = torch.nn.Parameter(w0.clone())
    opt_sr = FusedSGD([sr], lr=lr, master_weights=False, stochastic_rounding=True)
    opt_rn = FusedSGD([rn], lr=lr, master_weights=False)
    for _ in range(steps):
        for p, o in ((sr, opt_sr), (rn, opt_rn)):
            p.grad = grad.to(BF16)
            o.step()
    expected = 1 - lr * steps
    assert torch.equal(rn.detach(), w0)  # frozen: 1e-4 < 2**-9 (half an ulp just below 1)
    mean = sr.detach().double().mean().item()
    # Independent roundings: the mean's standard deviation is about 2**-8 / 2 / sqrt(n) per step.
    assert abs(mean - expected) < 0.01 * lr * steps


def test_deterministic_seeded_and_resumable(tmp_path):
    torch.manual_seed(0)
    w0 = torch.randn(10_000).to(BF16)
    g = torch.randn(10_000).to(BF16)
    a, opt_a = one_step(FusedAdam, w0, g, seed=1, lr=1e-3)
    b, _ = one_step(FusedAdam, w0, g, seed=1, lr=1e-3)
    c, _ = one_step(FusedAdam, w0, g, seed=2, lr=1e-3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # another seed: other random bits
    assert opt_a.param_groups[0]["stochastic_rounding_seed"] == 1
    # The state dict carries the seed and the step counts: a new process continues bit-for-bit.
    script = textwrap.dedent(f"""
        import sys, torch
        from peak.optimizers import FusedAdam
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5000).to(torch.bfloat16))
        torch.manual_seed(7)
        opt = FusedAdam([p], lr=1e-2, master_weights=False, stochastic_rounding=True)
        def steps(k):
            for i in range(k):
                g = torch.Generator().manual_seed(100 + int(opt.state[p]["step"]) if p in opt.state else 100)
                p.grad = torch.randn(5000, generator=g).to(torch.bfloat16)
                opt.step()
        if sys.argv[1] == "straight":
            steps(6)
        elif sys.argv[1] == "first":
            steps(3)
            torch.save({{"p": p.detach(), "opt": opt.state_dict()}}, r"{tmp_path}/ck.pt")
            sys.exit(0)
        else:
            ck = torch.load(r"{tmp_path}/ck.pt")
            torch.manual_seed(12345)  # a different seed now: the saved one must win
            opt = FusedAdam([p], lr=1e-2, master_weights=False, stochastic_rounding=True)
            with torch.no_grad():
                p.copy_(ck["p"])
            opt.load_state_dict(ck["opt"])
            steps(3)
        torch.save(p.detach(), r"{tmp_path}/" + sys.argv[1] + ".pt")
    """)
    for arg in ("straight", "first", "resumed"):
        subprocess.run([sys.executable, "-c", script, arg], check=True)
    assert torch.equal(torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt"))


def test_skipped_step_leaves_everything_unchanged():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000).to(BF16))
    opt = FusedAdam([p], lr=1e-2, master_weights=False, stochastic_rounding=True)
    p.grad = torch.randn(1000).to(BF16)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    p.grad = torch.randn(1000).to(BF16)
    opt.step(grad_scale=torch.ones(1), found_inf=torch.ones(1))
    assert torch.equal(p.detach(), before[0])
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[1][k]), k


def test_non_finite_weights_stay_non_finite_and_fp32_params_are_exact():
    # Non-finite results are stored as round-to-nearest stores them: the random bits must not
    # turn an inf into a NaN or a finite value, nor a NaN into anything else.
    big = torch.finfo(BF16).max
    w = torch.tensor([big, -big, 1.0, 1.0, 1.0], dtype=BF16)
    g = torch.tensor([-big, big, float("nan"), float("inf"), 0.5], dtype=BF16)
    outs = []
    for sr in (True, False):
        p = torch.nn.Parameter(w.clone())
        p.grad = g.clone()
        FusedSGD([p], lr=10.0, master_weights=False, stochastic_rounding=sr).step()
        outs.append(p.detach())
    for out in outs:
        assert out[0] == float("inf") and out[1] == float("-inf")
        assert out[2].isnan() and out[3] == float("-inf") and out[4] == -4.0
    # fp32 parameters in a stochastic-rounding group step as without it (nothing to round).
    torch.manual_seed(0)
    q32 = torch.nn.Parameter(torch.randn(100))
    r32 = torch.nn.Parameter(q32.detach().clone())
    for q, sr in ((q32, True), (r32, False)):
        q.grad = torch.ones(100)
        FusedAdam([q], lr=1e-2, master_weights=False, stochastic_rounding=sr).step()
    assert torch.equal(q32, r32)


@pytest.mark.parametrize("grid", [(3, 4, 5), (0, 0, 0)], ids=["tiny_grid", "cuda_grid"])
@pytest.mark.parametrize("family", ["adam", "sgd"])
def test_emulated_cuda_grid_rounds_alike(grid, family):
    """The same random bits on the CUDA launcher's path (run on the CPU): they depend on the
    element's data, seed and step only, not on how the work is split."""
    import peak
    peak._C.emulated.set_grid_shape(*grid)
    try:
        torch.manual_seed(0)
        sizes = [1, 700, 4099, 30]
        ps = [torch.randn(n).to(BF16) for n in sizes]
        gs = [torch.randn(n).to(BF16) for n in sizes]
        outs = []
        for ns in ("peak", "peak_emulated"):
            op = getattr(torch.ops, ns)
            params = [p.clone() for p in ps]
            state = [torch.zeros(n) for n in sizes]
            state2 = [torch.zeros(n) for n in sizes]
            steps = [torch.full((), float(i)) for i in range(len(sizes))]  # differing counts
            lr = torch.tensor([1e-2])
            if family == "adam":
                op.fused_adam_(params, gs, [], state, state2, [], steps, lr=lr, beta1=0.9,
                               beta2=0.99, eps=1e-8, weight_decay=0.0, amsgrad=False,
                               adam_w_mode=True, maximize=False, bias_correction=True,
                               grad_scale=None, found_inf=None, chunk_size=512,
                               stochastic_rounding_seed=123)
            else:
                op.fused_sgd_(params, gs, [], state, steps, lr=lr, momentum=0.9, dampening=0.0,
                              weight_decay=0.0, nesterov=False, maximize=False, grad_scale=None,
                              found_inf=None, chunk_size=512, stochastic_rounding_seed=123)
            outs.append(params)
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    finally:
        peak._C.emulated.set_grid_shape(0, 0, 0)


def test_errors():
    p = torch.nn.Parameter(torch.randn(4).to(BF16))
    with pytest.raises(ValueError, match="pass master_weights=False"):
        FusedAdam([p], stochastic_rounding=True)
    with pytest.raises(ValueError, match="pass master_weights=False"):
        FusedSGD([p], lr=0.1, master_weights=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="stochastic_rounding must be True or False"):
        FusedAdam([p], master_weights=False, stochastic_rounding="yes")
    h = torch.nn.Parameter(torch.randn(4).to(torch.float16))
    b = torch.nn.Parameter(torch.randn(4).to(BF16))
    opt = FusedAdam([{"params": [b]}, {"params": [h]}], master_weights=False,
                    stochastic_rounding=True)
    b.grad, h.grad = torch.ones(4, dtype=BF16), torch.ones(4, dtype=torch.float16)
    before = b.detach().clone()
    with pytest.raises(TypeError, match="float16 parameter"):
        opt.step()
    assert torch.equal(b.detach(), before) and not opt.state  # nothing stepped
    # The op itself: bf16 without masters only, seed in range.
    lr, st = torch.tensor([0.1]), [torch.zeros(())]
    with pytest.raises(RuntimeError, match="without master weights"):
        torch.ops.peak.fused_sgd_([b.detach()], [b.grad], [b.detach().float()], [], st, lr=lr,
                                  momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                                  maximize=False, stochastic_rounding_seed=1)
    with pytest.raises(RuntimeError, match="for bfloat16 params"):
        torch.ops.peak.fused_sgd_([torch.ones(2)], [torch.ones(2)], [], [], st, lr=lr, momentum=0.0,
                                  dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                                  stochastic_rounding_seed=1)
    with pytest.raises(RuntimeError, match=r"must be in \[0, 2\*\*32\)"):
        torch.ops.peak.fused_sgd_([b.detach()], [b.grad], [], [], st, lr=lr, momentum=0.0,
                                  dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                                  stochastic_rounding_seed=-1)


def test_opcheck():
    torch.manual_seed(0)
    params = [torch.randn(n).to(BF16) for n in (5, 300)]
    grads = [torch.randn_like(p) for p in params]
    zeros = lambda: [torch.zeros(p.shape) for p in params]
    steps = [torch.zeros(()) for _ in params]
    opcheck_op(torch.ops.peak.fused_adam_.default,
                          (params, grads, [], zeros(), zeros(), [], steps, torch.tensor([1e-2]),
                           0.9, 0.999, 1e-8, 0.0, False, True, False, True, None, None, 65536, 5))
    opcheck_op(torch.ops.peak.fused_sgd_.default,
                          (params, grads, [], zeros(), steps, torch.tensor([1e-2]), 0.9, 0.0,
                           0.0, False, False, None, None, 65536, 5))


def test_the_rounding_key_is_torchs_seed_in_one_process_and_0_on_several_ranks(monkeypatch):
    """A launcher's WORLD_SIZE above 1 (torchrun sets it before the process group exists): every
    rank must round alike (DDP replicas), however torch seeded it; a group's own key stays."""
    w = torch.nn.Parameter(torch.ones(4, dtype=BF16))
    torch.manual_seed(7)
    assert FusedAdam([w]).param_groups[0]["stochastic_rounding_seed"] == 7
    monkeypatch.setenv("WORLD_SIZE", "\u00b2")  # (a digit int() does not read: not several)
    assert FusedAdam([w]).param_groups[0]["stochastic_rounding_seed"] == 7
    monkeypatch.setenv("WORLD_SIZE", "2")
    for seed in (7, 8):
        torch.manual_seed(seed)
        opt = FusedAdam([w])
        assert opt.param_groups[0]["stochastic_rounding_seed"] == 0
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=BF16))],
                         "stochastic_rounding_seed": 5})
    assert opt.param_groups[1]["stochastic_rounding_seed"] == 5
