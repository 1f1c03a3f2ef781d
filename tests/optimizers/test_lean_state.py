"""Lean optimizer state (issue 16): remainder masters for bf16 models, bf16 moments, their
checkpoints, the memory report, and amp/GradScaler with them. See "Lean optimizer state" in
docs/core.md for what is promised: each test below checks one of those promises."""
import copy
import math
import warnings

import numpy as np
import pytest
import torch

import peak
from peak import amp
from peak.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedSGD,
                             export_fp32_state_dict, join_remainder, memory_report, split_master)
from peak_testing import (opcheck_op, assert_grad_scaler_skips_bit_for_bit,
                          assert_state_dict_resumes_bit_for_bit, train_steps)

BF16 = torch.bfloat16
SIZES = [((i * 53) % 200) + 1 for i in range(40)] + [70_000]  # one tensor over a chunk


# -- an independent model of the bits (numpy, uint32) ---------------------------------------------
def rne_high(bits):
    """bf16 round to nearest even of fp32 patterns (finite ones), as the high 16 bits."""
    bits = bits.astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def te_split(bits):
    """TransformerEngine's rule: high half rounded up iff bit 15 of the low half is set."""
    bits = bits.astype(np.uint64)
    low = bits & 0xFFFF
    return ((bits >> 16) + (low >> 15)) & 0xFFFF, low


def te_join(high, low):
    high = (high.astype(np.int64) - (low.astype(np.int64) >> 15)) & 0xFFFF
    return ((high << 16) | low.astype(np.int64)).astype(np.uint32)


def test_counting_argument_rne_cannot_have_exact_16_bit_remainders():
    """Over every fp32 pattern with exponent field 1..2 (2**25 patterns, positive and negative):
    RNE sends 65,537 patterns to each even bf16 value and 65,535 to each odd one, so no 16-bit
    remainder can rebuild every master behind an even weight; the rule used (ties up in
    magnitude) sends exactly 65,536 to each, is a bijection, and differs from RNE exactly on the
    ties of even weights (low half 0x8000)."""
    lo, hi = 0x00800000, 0x01800000  # exponent fields 1..2 (normal numbers)
    pos = np.arange(lo, hi, dtype=np.uint64)
    bits = np.concatenate([pos, pos | 0x80000000]).astype(np.uint32)
    rne = rne_high(bits)
    counts = np.bincount(rne.astype(np.int64) & 0x7FFF)
    inner = np.arange((lo >> 16) + 1, (hi >> 16) - 1)  # weights with both neighbours in range
    assert set(counts[inner[inner % 2 == 0]] // 2) == {65_537}
    assert set(counts[inner[inner % 2 == 1]] // 2) == {65_535}
    high, low = te_split(bits)
    te_counts = np.bincount(high.astype(np.int64) & 0x7FFF)
    assert set(te_counts[inner] // 2) == {65_536}
    assert np.array_equal(te_join(high, low), bits)  # exact for every pattern
    differs = high != rne
    tie_even = ((bits & 0xFFFF) == 0x8000) & (((bits >> 16) & 1) == 0)
    assert np.array_equal(differs, tie_even)
    assert differs.sum() == len(bits) // 2**17  # one pattern in 2**17 (2**16 of even weights)


def test_python_split_join_match_the_bit_model_on_special_values():
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-40, -1e-40, float("inf"),
                         float("-inf"), 1.00390625, 1.0 + 2 ** -8 + 2 ** -20])
    bits = torch.cat([vals, torch.randn(10_000) * 1e3]).contiguous()
    w, r = split_master(bits)
    assert w.dtype == BF16 and r.dtype == torch.int16
    assert torch.equal(join_remainder(w, r).view(torch.int32), bits.view(torch.int32))
    nbits = bits.view(torch.int32).numpy().view(np.uint32)
    high, low = te_split(nbits)
    assert np.array_equal(w.view(torch.int16).numpy().view(np.uint16), high.astype(np.uint16))
    assert np.array_equal(r.numpy().view(np.uint16), low.astype(np.uint16))


# -- the kernels ---------------------------------------------------------------------------------
def _base(dtype=BF16, sizes=SIZES, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def _grads(step, sizes=SIZES, dtype=BF16, scale=4.0):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(n, generator=g) * scale).to(dtype) for n in sizes]


def _call(ns, family, params, grads, masters, state, found, *, chunk=64, store=False, seed=None,
          lr=1e-2):
    op = getattr(torch.ops, ns)
    lr = torch.tensor([lr])
    kw = dict(store_unscaled_grads=store, moment_rounding_seed=seed)
    if family.startswith("adam"):
        ams = family == "adam_amsgrad"
        op.fused_adam_(params, grads, masters, state["m"], state["v"],
                       state["vmax"] if ams else [], state["steps"], lr=lr,
                       beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, amsgrad=ams,
                       adam_w_mode=True, maximize=False, bias_correction=True,
                       grad_scale=torch.tensor([4.0]), found_inf=found, chunk_size=chunk, **kw)
    elif family == "sgd":
        op.fused_sgd_(params, grads, masters, state["m"], state["steps"], lr=lr, momentum=0.9,
                      dampening=0.1, weight_decay=0.01, nesterov=False, maximize=False,
                      grad_scale=torch.tensor([4.0]), found_inf=found, chunk_size=chunk, **kw)
    else:
        op.fused_lamb_(params, grads, masters, state["m"], state["v"], state["steps"], lr=lr,
                       beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01, adam_w_mode=True,
                       grad_averaging=True, bias_correction=True, max_grad_norm=1.0,
                       use_nvlamb=False, grad_norm=None, grad_scale=torch.tensor([4.0]),
                       found_inf=found, chunk_size=chunk, **kw)


def _state(sizes, moment_dtype):
    return {"m": [torch.zeros(n, dtype=moment_dtype) for n in sizes],
            "v": [torch.zeros(n, dtype=moment_dtype) for n in sizes],
            "vmax": [torch.zeros(n, dtype=moment_dtype) for n in sizes],
            "steps": [torch.tensor(float(i % 3)) for i in range(len(sizes))]}


@pytest.mark.parametrize("family", ["adam", "adam_amsgrad", "sgd"])
@pytest.mark.parametrize("store", [False, True], ids=["", "store_grads"])
def test_remainder_masters_are_the_fp32_masters_bit_for_bit(family, store):
    """Side by side, an fp32-master step and a remainder step from the same master and the same
    gradients: after every step (a skipped one included) the remainder run's (weight, remainder)
    rebuilds exactly the fp32 run's master (the update math is the same functor), its weight is
    that master rounded with ties up in magnitude, and the fp32 run's weight is its RNE rounding;
    the two weights differ only on ties."""
    base = _base()
    fp32_params = [b.clone() for b in base]
    masters = [b.float() for b in base]
    lean_params = [b.clone() for b in base]
    remainders = [torch.zeros(n, dtype=torch.int16) for n in SIZES]
    s_full, s_lean = _state(SIZES, torch.float32), _state(SIZES, torch.float32)
    for step in range(6):
        found = torch.tensor([1.0 if step == 3 else 0.0])
        g1, g2 = _grads(step), _grads(step)
        _call("peak", family, fp32_params, g1, masters, s_full, found, store=store)
        _call("peak", family, lean_params, g2, remainders, s_lean, found, store=store)
        for p, r, m, q in zip(lean_params, remainders, masters, fp32_params):
            assert torch.equal(join_remainder(p, r).view(torch.int32), m.view(torch.int32))
            mb = m.view(torch.int32).numpy().view(np.uint32)
            high, _ = te_split(mb)
            assert np.array_equal(p.view(torch.int16).numpy().view(np.uint16),
                                  high.astype(np.uint16))
            assert torch.equal(q, m.to(BF16))  # (RNE)
        for a, b in zip(g1, g2):
            assert torch.equal(a, b)
        for key in ("m", "v", "vmax", "steps"):
            for a, b in zip(s_full[key], s_lean[key]):
                assert torch.equal(a, b)
    assert not torch.equal(join_remainder(lean_params[1], remainders[1]), base[1].float())


# (LAMB keeps fp32 masters: test_bad_lean_arguments checks its error for remainders.)
@pytest.mark.parametrize("family,lean", [
    (f, lean) for f in ("adam", "sgd", "lamb")
    for lean in ("remainder", "bf16_moments", "remainder_bf16_sr", "bf16_sr")
    if not (f == "lamb" and lean.startswith("remainder"))] + [("adam_amsgrad", "remainder")])
@pytest.mark.parametrize("grid", [(3, 4, 5), (0, 0, 0)], ids=["tiny_grid", "cuda_grid"])
def test_emulated_cuda_grid_equals_cpu_bitwise(family, lean, grid):
    """Every lean variant through the emulated CUDA grid gives the CPU launcher's bits (LAMB: its
    norms sum in another order, so weights within a bf16 ulp, and moments within one ulp of their
    storage where the clipping norm's last bit moved a rounding)."""
    remainder = lean.startswith("remainder")
    moment_dtype = BF16 if ("bf16" in lean) else torch.float32
    seed = 1234 if lean.endswith("_sr") else None
    peak_C = peak._C
    base = _base()
    runs = {}
    peak_C.emulated.set_grid_shape(*grid)
    try:
        for ns in ("peak", "peak_emulated"):
            params = [b.clone() for b in base]
            masters = ([torch.zeros(n, dtype=torch.int16) for n in SIZES] if remainder
                       else [b.float() for b in base])
            state = _state(SIZES, moment_dtype)
            for step in range(4):
                found = torch.tensor([1.0 if step == 2 else 0.0])
                _call(ns, family, params, _grads(step), masters, state, found, seed=seed)
            runs[ns] = (params, masters, state)
    finally:
        peak_C.emulated.set_grid_shape(0, 0, 0)
    (p1, m1, s1), (p2, m2, s2) = runs["peak"], runs["peak_emulated"]
    if family == "lamb":
        for a, b in zip(p1, p2):  # (two bf16 ulps: a value just above a power of two)
            torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-30)
        # The moments see the gradients clipped by the global norm, itself a sum taken in
        # another order on the grid: a clip factor one fp32 ulp apart can flip the rounding of a
        # stored moment: within two ulps of its storage dtype (one, where a value sits just above
        # a power of two), in at most one element in a thousand.
        flips = total = 0
        for a, b in zip(s1["m"] + s1["v"], s2["m"] + s2["v"]):
            ulp = torch.finfo(a.dtype).eps
            torch.testing.assert_close(a.float(), b.float(), rtol=2 * ulp, atol=1e-30)
            flips += int((a != b).sum())
            total += a.numel()
        assert flips <= total // 1000, (flips, total)
        return
    for a, b in zip(p1 + m1 + s1["m"] + s1["v"] + s1["vmax"] + s1["steps"],
                    p2 + m2 + s2["m"] + s2["v"] + s2["vmax"] + s2["steps"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["adam", "sgd"])
def test_non_finite_values_store_alike_on_every_launcher(family):
    """NOTE: [Exact stores]: the CPU launcher stores already-rounded bf16 values (a remainder
    master's weight, stochastically rounded moments) by truncation. A step that runs on NaN and
    inf gradients (no found_inf raised) must still store what the round-to-nearest store and the
    emulated CUDA grid store: NaN as 0x7fc0, inf as inf."""
    peak_C = peak._C
    base = _base()
    runs = {}
    peak_C.emulated.set_grid_shape(3, 4, 5)
    try:
        for ns in ("peak", "peak_emulated"):
            params = [b.clone() for b in base]
            masters = [torch.zeros(n, dtype=torch.int16) for n in SIZES]
            state = _state(SIZES, BF16)
            for step in range(3):
                grads = _grads(step)
                if step == 1:
                    grads[2].view(torch.int16)[5] = -63  # 0xffc1: a NaN with a payload
                    grads[1][0] = float("inf")
                    grads[-1][66_000] = float("-inf")
                _call(ns, family, params, grads, masters, state, torch.zeros(1), seed=7)
            runs[ns] = (params, masters, state)
    finally:
        peak_C.emulated.set_grid_shape(0, 0, 0)
    (p1, m1, s1), (p2, m2, s2) = runs["peak"], runs["peak_emulated"]
    for a, b in zip(p1 + m1 + s1["m"] + s1["v"], p2 + m2 + s2["m"] + s2["v"]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for t in (p1[2], s1["m"][2]):
        assert t.view(torch.int16)[5].item() == 0x7FC0  # the canonical NaN, not a payload
    assert not torch.isfinite(p1[1][0]) and not torch.isfinite(p1[-1][66_000])
    assert int(torch.isfinite(p1[2].float()).sum()) == SIZES[2] - 1  # the rest stays finite


@pytest.mark.parametrize("family", ["adam", "sgd", "lamb"])
@pytest.mark.parametrize("ns", ["peak", "peak_emulated"])
def test_skipped_step_leaves_lean_state_bit_for_bit(family, ns):
    base = _base()
    params = [b.clone() for b in base]
    masters = ([torch.zeros(n, dtype=torch.int16) for n in SIZES] if family != "lamb"
               else [b.float() for b in base])
    state = _state(SIZES, BF16)
    _call(ns, family, params, _grads(0), masters, state, torch.tensor([0.0]), seed=7)
    before = copy.deepcopy((params, masters, state))
    grads = _grads(1)
    grads_before = [g.clone() for g in grads]
    _call(ns, family, params, grads, masters, state, torch.tensor([1.0]), seed=7, store=True)
    for a, b in zip(before[0] + before[1] + before[2]["m"] + before[2]["v"] + before[2]["steps"],
                    params + masters + state["m"] + state["v"] + state["steps"]):
        assert torch.equal(a, b)
    for a, b in zip(grads, grads_before):
        assert torch.equal(a, b)


def _adam_bf16_moments_reference(w, grads, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    """Adam in float32 torch ops whose moments are stored as bf16 after every step (rounded to
    nearest even by .to()); the weight step uses the unrounded moments, as the kernel does."""
    w = w.clone()
    m = torch.zeros_like(w, dtype=BF16)
    v = torch.zeros_like(w, dtype=BF16)
    for t, g in enumerate(grads, 1):
        m32 = torch.lerp(m.float(), g, 1 - b1)
        v32 = b2 * v.float() + (1 - b2) * g * g
        denom = (v32.sqrt() / math.sqrt(1 - b2 ** t)) + eps
        w = w - (lr / (1 - b1 ** t)) * (m32 / denom)
        m, v = m32.to(BF16), v32.to(BF16)
    return w, m, v


def test_bf16_moments_round_to_nearest_follow_a_reference():
    """moment_rounding='nearest': the step is Adam with its moments stored as bf16 (rounded to
    nearest even). Against a torch model of exactly that: moments equal except where fp32
    rounding differences flip a bf16 rounding (rare), and the weights far closer to it than to
    fp32-moment Adam's."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(1000, generator=g)
    grads = [torch.randn(1000, generator=g) for _ in range(30)]
    results = {}
    for name, kw in {"bf16": dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                                  moment_rounding="nearest"), "fp32": {}}.items():
        p = w0.clone()
        opt = FusedAdam([p], lr=1e-2, **kw)
        for gr in grads:
            p.grad = gr.clone()
            opt.step()
        results[name] = (p, opt.state[p])
    p, st = results["bf16"]
    ref_w, ref_m, ref_v = _adam_bf16_moments_reference(w0, grads)
    assert st["exp_avg"].dtype == BF16 and st["exp_avg_sq"].dtype == BF16
    assert (st["exp_avg"] == ref_m).float().mean() > 0.99
    assert (st["exp_avg_sq"] == ref_v).float().mean() > 0.99
    err_ref = (p - ref_w).abs().max()
    err_fp32 = (p - results["fp32"][0]).abs().max()
    assert err_ref < err_fp32 / 4, (err_ref, err_fp32)


def test_bf16_exp_avg_sq_round_to_nearest_stalls_and_stochastic_rounding_tracks():
    """The failure mode that makes stochastic rounding the default: gradients shrink from 1 to
    0.1; an fp32 exp_avg_sq follows (beta2 = 0.999: down by 0.1% a step), a bf16 one rounded to
    nearest never moves (0.1% is under half a bf16 ulp), so its steps stay ~10x too small; the
    stochastically rounded one stays within a few percent of fp32 on average."""
    n = 4096
    results = {}
    for name, kw in {"fp32": {}, "nearest": dict(exp_avg_sq_dtype=BF16, moment_rounding="nearest"),
                     "stochastic": dict(exp_avg_sq_dtype=BF16)}.items():
        p = torch.zeros(n)
        opt = FusedAdam([p], lr=1e-3, **kw)
        for t in range(3000):
            p.grad = torch.full((n,), 1.0 if t < 500 else 0.1)
            opt.step()
        results[name] = opt.state[p]["exp_avg_sq"].double()
    fp32 = results["fp32"].mean().item()
    assert abs(results["stochastic"].mean().item() / fp32 - 1) < 0.03
    assert results["nearest"].mean().item() / fp32 > 3  # stuck near its peak


def test_bf16_moments_converge_like_fp32_on_a_quadratic():
    """A noisy quadratic, 400 steps: the loss with bf16 moments (stochastic) within 2% of fp32's."""
    torch.manual_seed(0)
    target = torch.randn(2048)
    losses = {}
    for name, kw in {"fp32": {}, "bf16": dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)}.items():
        g = torch.Generator().manual_seed(1)
        p = torch.zeros(2048)
        opt = FusedAdam([p], lr=1e-2, **kw)
        for _ in range(400):
            p.grad = (p - target) + 0.1 * torch.randn(2048, generator=g)
            opt.step()
        losses[name] = ((p - target) ** 2).mean().item()
    assert losses["bf16"] < losses["fp32"] * 1.02 + 1e-4


def test_sgd_bf16_momentum_against_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(500, generator=g)
    grads = [torch.randn(500, generator=g) for _ in range(20)]
    p = w0.clone()
    opt = FusedSGD([p], lr=0.05, momentum=0.9, momentum_dtype=BF16, moment_rounding="nearest")
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
    w, buf = w0.double(), None
    for gr in grads:
        buf = gr.double() if buf is None else 0.9 * buf + gr.double()
        w = w - 0.05 * buf  # (fp32 kernel uses the unrounded buffer for this step)
        buf = buf.to(BF16).double()
    assert opt.state[p]["momentum_buffer"].dtype == BF16
    torch.testing.assert_close(p.double(), w, rtol=1e-3, atol=1e-3)


# -- the optimizers ------------------------------------------------------------------------------
def _model(dtype=BF16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 8)).to(dtype)


LEAN_ADAM = dict(store_param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)


@pytest.mark.parametrize("make", [
    lambda p: FusedAdam(p, lr=1e-2, adam_w_mode=True, weight_decay=0.1, **LEAN_ADAM),
    lambda p: FusedSGD(p, lr=0.05, momentum=0.9, store_param_remainders=True,
                       momentum_dtype=BF16),
    lambda p: FusedLAMB(p, lr=1e-2, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)],
    ids=["adamw", "sgd", "lamb"])
def test_lean_checkpoint_resumes_bit_for_bit(make):
    assert_state_dict_resumes_bit_for_bit(_model, make)


def test_fp32_checkpoint_loads_into_lean_and_back():
    """fp32 masters/moments -> remainders (exact masters; weights their ties-up rounding) and
    bf16 moments (rounded to nearest even); lean -> fp32: masters rebuilt exactly, moments
    widened exactly. export_fp32_state_dict gives the exact masters from remainders."""
    model = _model()
    full = FusedAdam(model.parameters(), lr=1e-2)
    train_steps(model, full, 4)
    sd = copy.deepcopy(full.state_dict())
    masters = [full.state[p]["master_param"].clone() for p in model.parameters()]
    lean = FusedAdam(model.parameters(), lr=1e-2, **LEAN_ADAM)
    lean.load_state_dict(sd)
    for p, m, st in zip(model.parameters(), masters, sd["state"].values()):
        s = lean.state[p]
        assert "master_param" not in s and s["master_param_remainder"].dtype == torch.int16
        assert torch.equal(join_remainder(p, s["master_param_remainder"]).view(torch.int32),
                           m.view(torch.int32))
        assert torch.equal(s["exp_avg"], st["exp_avg"].to(BF16))
    exported = export_fp32_state_dict(model, lean)
    for (name, p), m in zip(model.named_parameters(), masters):
        assert torch.equal(exported[name].view(torch.int32), m.view(torch.int32))
    # and back
    lean_sd = copy.deepcopy(lean.state_dict())
    back = FusedAdam(model.parameters(), lr=1e-2)
    back.load_state_dict(lean_sd)
    for p, m, st in zip(model.parameters(), masters, lean_sd["state"].values()):
        assert torch.equal(back.state[p]["master_param"].view(torch.int32), m.view(torch.int32))
        assert back.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(back.state[p]["exp_avg"], st["exp_avg"].float())


def test_torch_adamw_checkpoint_loads_into_lean():
    ref = _model(torch.float32)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train_steps(ref, topt, 3)
    model = copy.deepcopy(ref).to(BF16)
    lean = FusedAdam(model.parameters(), lr=1e-2, adam_w_mode=True, **LEAN_ADAM)
    lean.load_state_dict(topt.state_dict())
    for p, q in zip(model.parameters(), ref.parameters()):
        st = lean.state[p]
        assert torch.equal(st["exp_avg_sq"], topt.state[q]["exp_avg_sq"].to(BF16))
        assert torch.equal(st["master_param_remainder"], torch.zeros_like(p, dtype=torch.int16))
    train_steps(model, lean, 2, start=3)  # and steps on


def test_fp16_model_with_remainders_names_the_alternatives():
    model = _model(torch.float16)
    opt = FusedAdam(model.parameters(), lr=1e-2, store_param_remainders=True)
    with pytest.raises(TypeError, match="float16 parameter.*bfloat16 model.*"
                                        "store_param_remainders=False.*master_weights=False"):
        train_steps(model, opt, 1)
    p = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="int16 master_params.*For float16 params keep float32"):
        torch.ops.peak.fused_adam_([p], [p.clone()], [torch.zeros(4, dtype=torch.int16)],
                                   [torch.zeros(4)], [torch.zeros(4)], [], [torch.zeros(())],
                                   lr=torch.tensor([1.0]), beta1=0.9, beta2=0.99, eps=1e-8,
                                   weight_decay=0.0, amsgrad=False, adam_w_mode=True,
                                   maximize=False, bias_correction=True)


def test_bad_lean_arguments():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match="exp_avg_dtype must be one of torch.float32, "
                                         "torch.bfloat16, torch.uint8"):
        FusedAdam(p, exp_avg_dtype=torch.float16)
    # dtype strings, as everywhere peak takes a dtype
    opt = FusedAdam(p, exp_avg_dtype="bf16", exp_avg_sq_dtype="float32")
    assert opt.param_groups[0]["exp_avg_dtype"] is torch.bfloat16
    assert opt.param_groups[0]["exp_avg_sq_dtype"] is torch.float32
    # remainders asked for fp32 parameters: nothing to store, said once at the first step
    # ... of a group that steps: not of an empty group (no-decay lists) nor a frozen one
    q = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3, dtype=BF16))
    b.grad = torch.ones(3, dtype=BF16)
    lean32 = FusedAdam([{"params": [b]}, {"params": []}, {"params": [q]}],
                       store_param_remainders=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lean32.step()
    q.grad = torch.ones(3)
    with pytest.warns(UserWarning, match="parameters are all float32") as w:
        lean32.step()
    assert w[0].filename == __file__  # the script's step(), not torch's optimizer hooks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lean32.step()
    with pytest.raises(ValueError, match="moment_rounding must be 'stochastic'"):
        FusedAdam(p, moment_rounding="up")
    with pytest.raises(ValueError, match="needs master weights"):
        FusedAdam(p, store_param_remainders=True, master_weights=False)
    with pytest.raises(ValueError, match="amsgrad=True keeps fp32 moments"):
        FusedAdam(p, amsgrad=True, exp_avg_sq_dtype=BF16)
    with pytest.raises(ValueError, match="FusedLAMB keeps fp32 masters"):
        FusedLAMB(p, store_param_remainders=True)
    w = torch.zeros(4, dtype=BF16)
    with pytest.raises(RuntimeError, match="exp_avgs must be float32, bfloat16 or uint8"):
        torch.ops.peak.fused_adam_([w], [w.clone()], [], [torch.zeros(4, dtype=torch.float16)],
                                   [torch.zeros(4)], [], [torch.zeros(())], lr=torch.tensor([1.0]),
                                   beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, amsgrad=False,
                                   adam_w_mode=True, maximize=False, bias_correction=True)
    with pytest.raises(RuntimeError, match=r"master_params\[0\] \(a remainder\) has shape"):
        torch.ops.peak.fused_adam_([w], [w.clone()], [torch.zeros(3, dtype=torch.int16)],
                                   [torch.zeros(4)], [torch.zeros(4)], [], [torch.zeros(())],
                                   lr=torch.tensor([1.0]), beta1=0.9, beta2=0.99, eps=1e-8,
                                   weight_decay=0.0, amsgrad=False, adam_w_mode=True,
                                   maximize=False, bias_correction=True)


class _ScaledOutput(torch.nn.Module):
    """A model with a 1-element parameter (whose per-element state is 1 element too)."""

    def __init__(self, body):
        super().__init__()
        self.body, self.one = body, torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.body(x) * self.one


def test_memory_report_bytes_per_param():
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2, **LEAN_ADAM)
    train_steps(model, opt, 1)
    rep = memory_report(model, opt)
    assert rep.per_param["weights"] == 2 and rep.per_param["grads"] == 2
    assert rep.per_param["masters"] == 2 and rep.per_param["moments"] == 4
    assert rep.total_per_param <= 10.0 + 0.01  # (+ step counts: 4 bytes per tensor)
    assert "masters" in str(rep)
    full_model = _model()
    full = FusedAdam(full_model.parameters(), lr=1e-2)
    train_steps(full_model, full, 1)
    assert 16 <= memory_report(full_model, full).total_per_param <= 16.01
    ref = _model(torch.float32)
    topt = torch.optim.AdamW(ref.parameters())
    train_steps(ref, topt, 1)
    assert 16 <= memory_report(ref, topt).total_per_param <= 16.01
    for make in (torch.optim.Adagrad, torch.optim.RMSprop, FusedAdagrad):  # (sum, square_avg)
        other = _ScaledOutput(_model(torch.float32))
        opt = make(other.parameters(), lr=1e-2)
        train_steps(other, opt, 1)
        rep = memory_report(other, opt)
        assert rep.per_param["moments"] == 4 and rep.per_param["other"] <= 0.01, make


def test_opcheck_lean_variants():
    params = _base(sizes=[7, 130, 65])
    grads = _grads(0, sizes=[7, 130, 65])
    rem = [torch.zeros(p.shape, dtype=torch.int16) for p in params]
    mom = lambda dt: [torch.zeros(p.shape, dtype=dt) for p in params]  # noqa: E731
    steps = lambda: [torch.zeros(()) for _ in params]  # noqa: E731
    lr, gs, fi = torch.tensor([1e-2]), torch.tensor([2.0]), torch.zeros(1)
    for seed in (None, 5):
        kw = {"moment_rounding_seed": seed, "store_unscaled_grads": True}
        opcheck_op(torch.ops.peak.fused_adam_.default,
                              ([p.clone() for p in params], [g.clone() for g in grads], rem,
                               mom(BF16), mom(BF16), [], steps(), lr, 0.9, 0.999, 1e-8, 0.0,
                               False, True, False, True, gs, fi), kwargs=kw)
        opcheck_op(torch.ops.peak.fused_sgd_.default,
                              ([p.clone() for p in params], [g.clone() for g in grads], rem,
                               mom(BF16), steps(), lr, 0.9, 0.0, 0.0, False, False, gs, fi),
                              kwargs=kw)
        opcheck_op(torch.ops.peak.fused_lamb_.default,
                              ([p.clone() for p in params], [g.clone() for g in grads],
                               [p.float() for p in params], mom(BF16), mom(torch.float32),
                               steps(), lr, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False,
                               None, gs, fi), kwargs=kw)


# -- amp and GradScaler, unchanged training scripts -----------------------------------------------
def test_amp_o2_takes_lean_state_with_no_other_change():
    """O2 (bf16) with a lean FusedAdam: the masters are amp's exact fp32 originals, kept as
    remainders; the step runs; amp.master_params clipping still works; the run equals, in its
    masters, the same script with fp32 masters to within the tie rounding of the weights."""
    torch.manual_seed(0)
    data = [(torch.randn(8, 32), torch.randn(8, 8)) for _ in range(6)]
    results = {}
    for name, kw in {"lean": LEAN_ADAM, "full": {}}.items():
        model = _model(torch.float32)
        originals = [p.detach().clone() for p in model.parameters()]
        opt = FusedAdam(model.parameters(), lr=1e-2, adam_w_mode=True, **kw)
        model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=BF16,
                                    verbosity=0)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            if i == 0:
                masters = export_fp32_state_dict(model, opt)
                assert all(torch.equal(m, o) for m, o in zip(masters.values(), originals)), name
            if i == 3:
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
            opt.step()
        results[name] = (model, opt)
    model, opt = results["lean"]
    rep = memory_report(model, opt)
    assert rep.per_param["masters"] == 2 and rep.per_param["moments"] == 4
    lean_m = export_fp32_state_dict(*results["lean"])
    full_m = export_fp32_state_dict(*results["full"])
    for k in lean_m:
        torch.testing.assert_close(lean_m[k], full_m[k], rtol=2e-2, atol=2e-3)


def test_grad_scaler_with_lean_optimizer_skips_bit_for_bit():
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2, **LEAN_ADAM)
    assert_grad_scaler_skips_bit_for_bit(model, opt, 8, (0, 0), float("inf"))
    assert opt.state[next(model.parameters())]["master_param_remainder"].dtype == torch.int16


def test_amsgrad_with_remainder_masters_steps_as_with_fp32_masters():
    """FusedAdam(amsgrad=True, store_param_remainders=True) on a bf16 model: every step's master
    (weight joined with its remainder) and moments are the fp32-master run's, bit for bit (the
    kernels once skipped this combination without a word)."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(300, generator=g).to(BF16)
    runs = []
    for remainders in (False, True):
        p = torch.nn.Parameter(w0.clone())
        opt = FusedAdam([p], lr=1e-2, amsgrad=True, store_param_remainders=remainders)
        for step in range(4):
            p.grad = (torch.randn(300, generator=torch.Generator().manual_seed(step)) * (4 - step)
                      ).to(BF16)
            opt.step()
        runs.append((opt.master_of(p).clone(), opt.state[p]["max_exp_avg_sq"].clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[1][0], w0.float())


def test_options_added_or_set_on_a_group_are_checked_before_anything_changes():
    """add_param_group checks what the constructor checks (amsgrad with lean moments, one
    moment 8-bit, an option the optimizer does not take) and refuses a parameter given twice;
    options set on a group mid-run that its constructor would refuse (amsgrad on lean moments,
    one moment 8-bit) are refused at the step, before any state changes."""
    p = torch.nn.Parameter(torch.randn(300).to(BF16))
    opt = FusedAdam([p], lr=1e-2, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    p.grad = torch.randn(300).to(BF16)
    opt.step()
    q = torch.nn.Parameter(torch.randn(3).to(BF16))
    with pytest.raises(ValueError, match="amsgrad=True keeps fp32 moments"):
        opt.add_param_group({"params": [q], "amsgrad": True})
    with pytest.raises(ValueError, match="holds a parameter twice"):
        opt.add_param_group({"params": [q, q]})
    with pytest.raises(ValueError, match=r"exp_avg_dtype=torch.uint8 .* needs exp_avg_sq_dtype"):
        opt.add_param_group({"params": [q], "exp_avg_dtype": torch.uint8})
    with pytest.raises(ValueError, match="FusedLAMB does not take store_param_remainders"):
        FusedLAMB([p]).add_param_group({"params": [q], "store_param_remainders": True})
    assert len(opt.param_groups) == 1
    before = {k: v.clone() for k, v in opt.state[p].items()}
    weight = p.detach().clone()
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad=True keeps fp32 moments"):
        opt.step()
    assert torch.equal(p.detach(), weight) and set(opt.state[p]) == set(before)
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())
    opt.param_groups[0].update(amsgrad=False, exp_avg_dtype="8bit")
    with pytest.raises(ValueError, match="both moments are 8-bit or neither"):
        opt.step()
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())
    assert torch.equal(p.detach(), weight)
    opt.param_groups[0].update(exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32", amsgrad=True)
    opt.step()  # (the documented strings, amsgrad on: the moments become fp32)
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and "max_exp_avg_sq" in opt.state[p]


@pytest.mark.parametrize("change", ["moments_fp32", "moments_8bit_string", "remainders_on",
                                    "remainders_off"])
def test_storage_options_set_on_a_group_mid_run_convert_its_state(change):
    """A group's storage options set after its state was made take effect at the next step, the
    state converted as a checkpoint load into those options converts it (the reference: save,
    build an optimizer with the new options, load)."""
    lean = {"moments_fp32": dict(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
            "moments_8bit_string": {},
            "remainders_on": {},
            "remainders_off": dict(store_param_remainders=True)}[change]
    new = {"moments_fp32": dict(exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32),
           "moments_8bit_string": dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"),
           "remainders_on": dict(store_param_remainders=True),
           "remainders_off": dict(store_param_remainders=False)}[change]
    w0 = torch.randn(600, generator=torch.Generator().manual_seed(1)).to(BF16)

    def grad(step):
        return torch.randn(600, generator=torch.Generator().manual_seed(10 + step)).to(BF16)

    p = torch.nn.Parameter(w0.clone())
    opt = FusedAdam([p], lr=1e-2, **lean)
    p.grad = grad(0)
    opt.step()
    saved = copy.deepcopy({"w": p.detach().clone(), "opt": opt.state_dict()})
    opt.param_groups[0].update(new)
    p.grad = grad(1)
    opt.step()
    ref_p = torch.nn.Parameter(saved["w"].clone())
    ref = FusedAdam([ref_p], lr=1e-2, **{**lean, **new})
    ref.load_state_dict(saved["opt"])
    ref_p.grad = grad(1)
    ref.step()
    assert torch.equal(p.detach(), ref_p.detach())
    for key, value in ref.state[ref_p].items():
        assert opt.state[p][key].dtype == value.dtype, key
        assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("refusal", ["sparse_gradient", "scaled_fp32_sums", "refused_fp32_sum"])
def test_a_storage_option_set_before_a_refused_step_converts_nothing(refusal):
    """A step refused for another reason (a sparse gradient, fp32 sums with a loss scale, a
    parameter whose only gradient is an fp32 sum and whose group the kernels cannot step) leaves a group's changed storage unconverted: set back, the state is as it was,
    with no round trip through bf16."""
    p = torch.nn.Parameter(torch.randn(300).to(BF16))
    fp16 = torch.nn.Parameter(torch.randn(8).half())
    opt = FusedAdam([{"params": [p]}, {"params": [fp16]}], lr=1e-2)
    p.grad = torch.randn(300).to(BF16)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    opt.param_groups[0].update(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16",
                               store_param_remainders=True)
    scale = None
    if refusal == "sparse_gradient":
        p.grad = torch.randn(300).to(BF16).to_sparse()
    elif refusal == "refused_fp32_sum":
        opt.param_groups[1]["stochastic_rounding"] = True  # (refused for an fp16 parameter)
        p.grad, fp16.grad = torch.randn(300).to(BF16), torch.randn(8).half()
        opt.accumulate_grads()
    else:
        p.grad = torch.randn(300).to(BF16)
        opt.accumulate_grads()
        scale = torch.tensor([2.0])
    with pytest.raises((RuntimeError, ValueError, TypeError),
                       match="sparse|accumulated in fp32|rounds bfloat16 weights"):
        opt.step(grad_scale=scale)
    assert set(opt.state[p]) == set(before)
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())
    opt.param_groups[0].update(exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                               store_param_remainders=False)
    opt.param_groups[1]["stochastic_rounding"] = False
    opt.zero_grad()
    p.grad = torch.randn(300).to(BF16)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and "master_param" in opt.state[p]


def test_storage_options_follow_through_a_copy_and_only_current_groups_are_watched():
    """An option set on a deepcopy's (or an unpickled optimizer's) group before its first step
    converts its state too; the watch holds the optimizer's current groups only (a replaced
    group and its parameters are not kept alive)."""
    p = torch.nn.Parameter(torch.randn(300).to(BF16))
    opt = FusedAdam([p], lr=1e-2, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    p.grad = torch.randn(300).to(BF16)
    opt.step()
    twin = copy.deepcopy(opt)
    q = twin.param_groups[0]["params"][0]
    twin.param_groups[0].update(exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)
    q.grad = torch.randn(300).to(BF16)
    twin.step()
    assert twin.state[q]["exp_avg"].dtype == torch.float32
    for _ in range(3):
        opt.load_state_dict(opt.state_dict())
        opt.step()
    assert [g for g, _ in opt._storage_seen] == opt.param_groups


def test_remainders_switched_on_mid_run_keep_a_weight_loaded_since_the_last_step():
    p = torch.nn.Parameter(torch.randn(300).to(BF16))
    opt = FusedAdam([p], lr=0.0)
    p.grad = torch.randn(300).to(BF16)
    opt.step()
    loaded = torch.randn(300).to(BF16)
    with torch.no_grad():
        p.copy_(loaded)
    opt.param_groups[0]["store_param_remainders"] = True
    opt.step()
    assert torch.equal(p.detach(), loaded)
    assert torch.equal(opt.master_of(p), loaded.float())


@pytest.mark.parametrize("case", ["weights_loaded_outside_amp", "param_left_its_group",
                                  "model_made_fp32", "remainders"])
def test_masters_kept_through_a_torch_checkpoint_load(case):
    """A torch.optim checkpoint (no masters) into a fused optimizer that has state: the masters
    it keeps go with the weights at once (a weight written since wins where the master does not
    round to it), a remainder is kept as it is (joined, not copied), and what the state holds
    beyond the groups or no longer fits its parameter loads as torch loads it."""
    from peak.optimizers import _master_loads as M

    torch.manual_seed(3)
    remainders = case in ("remainders", "model_made_fp32")
    p = torch.nn.Parameter(torch.randn(64).to(BF16))
    extra = torch.nn.Parameter(torch.randn(8).to(BF16))
    opt = FusedAdam([p, extra], lr=1e-2, store_param_remainders=remainders)
    p.grad, extra.grad = torch.randn(64).to(BF16), torch.randn(8).to(BF16)
    opt.step()
    ref = torch.nn.Parameter(torch.randn(64))
    ref_extra = torch.nn.Parameter(torch.randn(8))
    ref_opt = torch.optim.Adam([ref, ref_extra], lr=1e-2)
    ref.grad, ref_extra.grad = torch.randn(64), torch.randn(8)
    ref_opt.step()
    ckpt = copy.deepcopy(ref_opt.state_dict())
    if case == "weights_loaded_outside_amp":
        with torch.no_grad():
            p.copy_(ref.detach().to(BF16))
    elif case == "param_left_its_group":
        opt.param_groups[0]["params"] = [p, torch.nn.Parameter(torch.randn(8).to(BF16))]
    elif case == "model_made_fp32":
        p.data, extra.data = p.data.float(), extra.data.float()
    kept = M.masters_before_load(opt)
    if case == "remainders":
        assert all(t.dtype == torch.int16 for t in kept.values()) and kept
    before = opt.master_of(p).clone() if case != "model_made_fp32" else None
    if case == "weights_loaded_outside_amp":  # (the live master: master_of follows the write)
        before = opt.state[p]["master_param"].clone()
    opt.load_state_dict(ckpt)
    if case == "weights_loaded_outside_amp":
        loaded = ref.detach().to(BF16)
        assert (before.to(BF16) != loaded).any()
        assert torch.equal(opt.master_of(p), torch.where(before.to(BF16) == loaded, before,
                                                         loaded.float()))
    elif case in ("param_left_its_group", "remainders"):
        assert torch.equal(opt.master_of(p), before)
    p.grad, extra.grad = torch.randn(64).to(p.dtype), None
    opt.step()
    assert torch.isfinite(p).all()


def test_a_model_loaded_after_a_torch_optimizer_checkpoint_wins_over_kept_masters():
    """Outside amp, a running fused optimizer loads a torch.optim checkpoint, then the model
    loads its weights: the next step starts from the loaded weights, not the masters kept from
    before the load."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 16).to(BF16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = torch.nn.Linear(16, 16).to(BF16)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    for o, m in ((ref_opt, ref), (opt, model)):
        for _ in range(2):
            for p in m.parameters():
                p.grad = torch.randn_like(p)
            o.step()
    weights = copy.deepcopy(ref.state_dict())
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    model.load_state_dict(weights)
    for group in opt.param_groups:
        group.update(lr=0.0, weight_decay=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(model.weight.detach(), weights["weight"])


@pytest.mark.parametrize("then", ["add_param_group", "pop_a_group"])
def test_a_storage_option_set_before_the_groups_change_still_converts(then):
    """An option set on a group, then a group added or removed before the next step: the set
    group's state still converts (exactly: remainders -> fp32 masters keeps the master)."""
    w = torch.nn.Parameter(torch.randn(300).to(BF16))
    other = torch.nn.Parameter(torch.randn(4).to(BF16))
    groups = [{"params": [w]}] + ([{"params": [other]}] if then == "pop_a_group" else [])
    opt = FusedAdam(groups[::-1], lr=1e-2, store_param_remainders=True)
    for step in range(3):
        w.grad, other.grad = torch.randn(300).to(BF16), torch.randn(4).to(BF16)
        opt.step()
    exact = opt.master_of(w).clone()
    group = next(g for g in opt.param_groups if any(p is w for p in g["params"]))
    group["store_param_remainders"] = False
    if then == "add_param_group":
        opt.add_param_group({"params": [other]})
    else:
        opt.param_groups.pop(0)
    for g in opt.param_groups:
        g["lr"] = 0.0
    w.grad, other.grad = torch.zeros(300).to(BF16), None
    opt.step()
    assert "master_param_remainder" not in opt.state[w]
    assert torch.equal(opt.state[w]["master_param"], exact)


def test_a_refused_storage_change_consumes_nothing():
    """A storage option the step refuses leaves the fp32 gradient sums, the gradients and the
    masters as they were; remainders switched on between give_master_grads() and step() are
    refused (the fp32 master gradient would be lost)."""
    from peak.optimizers import FusedSGD

    p = torch.nn.Parameter(torch.randn(300).to(BF16))
    opt = FusedAdam([p], lr=1e-2)
    for _ in range(2):
        p.grad = torch.randn(300).to(BF16)
        opt.accumulate_grads()
    opt.param_groups[0]["exp_avg_dtype"] = torch.uint8
    with pytest.raises(ValueError, match="both moments are 8-bit or neither"):
        opt.step()
    assert p.grad is None and len(opt._fp32_grad_sums) == 1 and not opt.state
    q = torch.nn.Parameter(torch.randn(300).to(BF16))
    sgd = FusedSGD([q], lr=1e-2)
    q.grad = torch.randn(300).to(BF16)
    sgd.step()
    q.grad = torch.randn(300).to(BF16) * 1024
    sgd.give_master_grads(torch.tensor([1024.0]))
    sgd.param_groups[0]["store_param_remainders"] = True
    with pytest.raises(RuntimeError, match="between give_master_grads"):
        sgd.step()
    sgd.param_groups[0]["store_param_remainders"] = False
    sgd.step()


def test_remainders_switched_off_with_fp32_sums_pending_keep_both():
    """store_param_remainders switched off while accumulate_grads' fp32 sums wait: the step
    converts the remainder into the exact fp32 master first, then steps the exact sum (the
    reference: a checkpoint loaded into fp32 masters, then the same accumulation)."""
    def grad(step):
        return torch.randn(600, generator=torch.Generator().manual_seed(10 + step)).to(BF16)

    p = torch.nn.Parameter(torch.randn(600, generator=torch.Generator().manual_seed(1)).to(BF16))
    opt = FusedAdam([p], lr=1e-2, store_param_remainders=True)
    p.grad = grad(0)
    opt.step()
    saved = copy.deepcopy({"w": p.detach().clone(), "opt": opt.state_dict()})
    q = torch.nn.Parameter(saved["w"].clone())
    ref = FusedAdam([q], lr=1e-2)
    ref.load_state_dict(saved["opt"])
    for o, t in ((opt, p), (ref, q)):
        for step in (1, 2):
            t.grad = grad(step)
            o.accumulate_grads()
    opt.param_groups[0]["store_param_remainders"] = False
    opt.step()
    ref.step()
    assert torch.equal(p.detach(), q.detach())
    assert torch.equal(opt.state[p]["master_param"], ref.state[q]["master_param"])
