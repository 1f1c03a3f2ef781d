"""Property-based tests (hypothesis) of every multi-tensor op and fused optimizer against
references: random shapes (empty and 1-element included), dtypes (f32/f16/bf16, mixed in/out),
list lengths beyond one launch (> 110 tensors), small chunk sizes, transposed (dense) and sliced
(non-dense) inputs, and inf/NaN planted at random places.

The elementwise ops are compared bit for bit (the kernels compute in fp32 and round once, with no
FMA contraction beyond the documented fmaf of axpby, which the reference follows); norms and
optimizers with tolerances against
float64 / torch.optim.  Derandomized, so a run is reproducible: 50 examples per property by
default; ``PEAK_FUZZ_EXAMPLES=2000 python -m pytest tests/reliability/test_fuzz_ops.py`` for a long run."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peak import ops
from peak.optimizers import FusedAdam, FusedLAMB, FusedSGD

EXAMPLES = int(os.environ.get("PEAK_FUZZ_EXAMPLES", "50"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

shape_st = st.one_of(
    st.just((0,)), st.just((1,)), st.just(()),
    st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
    st.integers(1000, 5000).map(lambda n: (n,)),
)


@st.composite
def tensor_lists(draw, min_len=1):
    """(list of shapes, how they are laid out) — lengths up to 3 or beyond one launch (111-140)."""
    n = draw(st.one_of(st.integers(min_len, 4), st.integers(111, 140)))
    if n > 100:  # long lists: small tensors, to stay fast
        shapes = draw(st.lists(st.sampled_from([(0,), (1,), (3,), (2, 5), (17,)]), min_size=n, max_size=n))
    else:
        shapes = draw(st.lists(shape_st, min_size=n, max_size=n))
    return shapes


def make(shapes, dtype, seed, layout="contig"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        if layout == "transposed" and len(s) == 2:
            t = (torch.randn(s[1], s[0], generator=g) * 4).to(dtype).t()  # dense, not contiguous
        else:
            t = (torch.randn(s, generator=g) * 4).to(dtype)
        out.append(t)
    return out


def plant(tensors, data):
    """Maybe put inf/NaN into one element of one non-empty tensor; returns per-tensor flags."""
    flags = [0.0] * len(tensors)
    candidates = [i for i, t in enumerate(tensors) if t.numel() > 0]
    if candidates and data.draw(st.booleans(), label="poison"):
        i = data.draw(st.sampled_from(candidates), label="which tensor")
        j = data.draw(st.integers(0, tensors[i].numel() - 1), label="which element")
        value = data.draw(st.sampled_from([math.inf, -math.inf, math.nan]), label="value")
        t = tensors[i]
        if t.dim() == 0:
            t.fill_(value)
        else:  # through the (possibly transposed) view
            t[tuple(int(k) for k in torch.unravel_index(torch.tensor(j), t.shape))] = value
        flags[i] = 1.0
    return flags


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        torch.nan_to_num(a.float(), nan=1234.5), torch.nan_to_num(b.float(), nan=1234.5)) and torch.equal(
        a.float().isnan(), b.float().isnan())


chunk_st = st.sampled_from([1, 2, 3, 7, 64, 1000, 65536])
scalar_st = st.floats(-8, 8, allow_nan=False, width=32)


# ---------------------------------------------------------------------------------------- scale
@FUZZ
@given(shapes=tensor_lists(), in_dtype=st.sampled_from(DTYPES), out_dtype=st.sampled_from(DTYPES),
       scale=scalar_st, chunk=chunk_st, layout=st.sampled_from(["contig", "transposed"]),
       in_place=st.booleans(), data=st.data())
def test_multi_tensor_scale(shapes, in_dtype, out_dtype, scale, chunk, layout, in_place, data):
    xs = make(shapes, in_dtype, 1, layout)
    flags = plant(xs, data)
    expected = [(x.float() * torch.tensor(scale, dtype=torch.float32)).to(in_dtype if in_place else out_dtype)
                for x in xs]
    outs = xs if in_place else [torch.empty_like(x, dtype=out_dtype) for x in xs]  # same layout
    found, per = ops.new_found_inf(), torch.zeros(len(xs))
    ops.multi_tensor_scale_(xs, outs, scale, found, chunk_size=chunk, per_tensor_found_inf=per)
    assert float(found) == max(flags, default=0.0)
    assert per.tolist() == flags
    for i, (o, e) in enumerate(zip(outs, expected)):
        if not flags[i]:
            assert same(o, e), f"tensor {i}"


@FUZZ
@given(shapes=tensor_lists(), dtype=st.sampled_from(DTYPES))
def test_multi_tensor_scale_handles_non_dense_inputs(shapes, dtype):
    # Issue 15: slices go through a dense copy inside the op; the rest of the base is untouched.
    shapes = [s if len(s) == 2 and s[1] > 1 else (3, 4) for s in shapes]
    bases = [torch.randn(s[0], s[1] + 2).to(dtype) for s in shapes]
    xs = [b[:, 1:-1] for b in bases]  # sliced: not dense
    before = [b.clone() for b in bases]
    found = ops.new_found_inf()
    ops.multi_tensor_scale_(xs, xs, 2.0, found)
    assert found.item() == 0.0
    for b, old in zip(bases, before):
        assert torch.equal(b[:, 1:-1], (old[:, 1:-1].float() * 2).to(dtype))
        assert torch.equal(b[:, 0], old[:, 0]) and torch.equal(b[:, -1], old[:, -1])


# ---------------------------------------------------------------------------------------- axpby
@FUZZ
@given(shapes=tensor_lists(), x_dtype=st.sampled_from(DTYPES), y_dtype=st.sampled_from(DTYPES),
       out_dtype=st.sampled_from(DTYPES), a=scalar_st, b=scalar_st, chunk=chunk_st,
       check=st.sampled_from(["both", "x", "y", "none"]), data=st.data())
def test_multi_tensor_axpby(shapes, x_dtype, y_dtype, out_dtype, a, b, chunk, check, data):
    xs, ys = make(shapes, x_dtype, 2), make(shapes, y_dtype, 3)
    fx, fy = plant(xs, data), plant(ys, data)
    at, bt = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    # The kernel computes fmaf(b, y, a*x) (elementwise_ops.h: one rounding of a*x, then a fused
    # multiply-add): in float64 b*y is exact, so only the final sum can round twice (a rare tie).
    expected = [((at * x.float()).double() + bt.double() * y.double()).float().to(out_dtype)
                for x, y in zip(xs, ys)]
    outs = [torch.empty_like(x, dtype=out_dtype) for x in xs]
    found = ops.new_found_inf()
    ops.multi_tensor_axpby_(xs, ys, outs, a, b, found, check=check, chunk_size=chunk)
    want = {"both": max(fx + fy, default=0.0), "x": max(fx, default=0.0), "y": max(fy, default=0.0),
            "none": 0.0}[check]
    assert float(found) == want
    for i, (o, e) in enumerate(zip(outs, expected)):
        if not (fx[i] or fy[i]) and not same(o, e):  # at most one unit in the last place
            ulp = torch.finfo(out_dtype).eps * e.float().abs().clamp_min(torch.finfo(out_dtype).tiny)
            assert ((o.float() - e.float()).abs() <= ulp).all(), f"tensor {i}"


# ---------------------------------------------------------------------------------------- l2norm
@FUZZ
@given(shapes=tensor_lists(), dtype=st.sampled_from(DTYPES), chunk=chunk_st,
       layout=st.sampled_from(["contig", "transposed"]), per_tensor=st.booleans())
def test_multi_tensor_l2norm(shapes, dtype, chunk, layout, per_tensor):
    xs = make(shapes, dtype, 4, layout)
    total, per = ops.multi_tensor_l2norm(xs, per_tensor=per_tensor, chunk_size=chunk)
    ref_per = torch.stack([x.double().norm() for x in xs])
    ref = ref_per.norm()
    torch.testing.assert_close(total.double(), ref.reshape(1), rtol=1e-5, atol=1e-6)
    if per_tensor:
        torch.testing.assert_close(per.double(), ref_per, rtol=1e-5, atol=1e-6)
    else:
        assert per.numel() == 0


# ---------------------------------------------------------------------------------------- check_finite
@FUZZ
@given(shapes=tensor_lists(), dtype=st.sampled_from(DTYPES), chunk=chunk_st,
       layout=st.sampled_from(["contig", "transposed"]), data=st.data())
def test_multi_tensor_check_finite(shapes, dtype, chunk, layout, data):
    xs = make(shapes, dtype, 5, layout)
    flags = plant(xs, data)
    before = [x.clone() for x in xs]
    found, per = ops.new_found_inf(), torch.zeros(len(xs))
    ops.multi_tensor_check_finite_(xs, found, chunk_size=chunk, per_tensor_found_inf=per)
    assert float(found) == max(flags, default=0.0) and per.tolist() == flags
    assert all(same(a, b) for a, b in zip(xs, before))  # read-only


# ---------------------------------------------------------------------------------------- update_scale
def reference_update(scale, growth, hyst, found, gf, bf, interval, hysteresis, lo, hi):
    """docs of peak.ops.update_scale_, in float32 like the kernel."""
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))
    if found:
        hyst = max(hyst - 1, 0)  # used up: stays at 0, every further overflow backs off
        if hyst <= 0:
            scale = max(f32(scale * bf), lo)
        growth = 0
    else:
        growth += 1
        hyst = hysteresis
        if growth == interval:
            new = min(f32(scale * gf), hi)
            if math.isfinite(new):
                scale = new
            growth = 0
    return f32(scale), growth, hyst


@FUZZ
@given(found=st.lists(st.booleans(), min_size=1, max_size=40), init=st.sampled_from([1.0, 2.0 ** 16, 3e38]),
       gf=st.sampled_from([2.0, 1.5, 4.0]), bf=st.sampled_from([0.5, 0.25, 0.9]), interval=st.integers(1, 5),
       hysteresis=st.integers(1, 3), lo=st.sampled_from([0.0, 1.0, 1024.0]),
       hi=st.sampled_from([math.inf, 2.0 ** 20]))
def test_update_scale(found, init, gf, bf, interval, hysteresis, lo, hi):
    scale, growth = torch.tensor([init]), torch.zeros(1, dtype=torch.int32)
    hyst = torch.tensor([hysteresis], dtype=torch.int32)
    ref = (float(scale), 0, hysteresis)
    torch_scale, torch_growth = torch.tensor([init]), torch.zeros(1, dtype=torch.int32)
    for f in found:
        flag = torch.tensor([float(f)])
        ops.update_scale_(scale, growth, flag, gf, bf, interval, hysteresis=hysteresis, hysteresis_tracker=hyst,
                          min_scale=lo, max_scale=hi)
        ref = reference_update(*ref, f, gf, bf, interval, hysteresis, lo, hi)
        assert (float(scale), int(growth), int(hyst)) == ref
        if hysteresis == 1 and lo == 0.0 and hi == math.inf:  # documented: exactly torch's
            torch._amp_update_scale_(torch_scale, torch_growth, flag, gf, bf, interval)
            assert torch.equal(scale, torch_scale) and torch.equal(growth, torch_growth)


# ---------------------------------------------------------------------------------------- optimizers
opt_shapes = st.lists(st.one_of(st.just((0,)), st.just((1,)), st.lists(st.integers(1, 7), min_size=1,
                                                                        max_size=2).map(tuple)),
                      min_size=1, max_size=5)


def _params(shapes, dtype):
    g = torch.Generator().manual_seed(11)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _run_pair(ours, params, theirs, ref_params, steps=3):
    for s in range(steps):
        for p, r, gr in zip(params, ref_params, _grads(params, s)):
            p.grad, r.grad = gr, gr.float()
        ours.step()
        theirs.step()


def _check_against(ours, params, ref_params, dtype, rtol, atol):
    for p, r in zip(params, ref_params):
        got = ours.state[p]["master_param"] if dtype != torch.float32 else p.detach()
        torch.testing.assert_close(got.double(), r.detach().double(), rtol=rtol, atol=atol)
        if dtype != torch.float32:
            assert torch.equal(p.detach(), got.to(dtype))  # the model copy is the rounded master


@FUZZ
@given(shapes=opt_shapes, dtype=st.sampled_from(DTYPES), momentum=st.sampled_from([0.0, 0.9]),
       nesterov=st.booleans(), wd=st.sampled_from([0.0, 0.01]))
def test_fused_sgd_vs_torch(shapes, dtype, momentum, nesterov, wd):
    nesterov = nesterov and momentum > 0
    params = _params(shapes, dtype)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ours = FusedSGD(params, lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    theirs = torch.optim.SGD(ref, lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    _run_pair(ours, params, theirs, ref)
    _check_against(ours, params, ref, dtype, 1e-5, 1e-6)


@FUZZ
@given(shapes=opt_shapes, dtype=st.sampled_from(DTYPES), amsgrad=st.booleans(), adam_w=st.booleans(),
       wd=st.sampled_from([0.0, 0.01]))
def test_fused_adam_vs_torch(shapes, dtype, amsgrad, adam_w, wd):
    params = _params(shapes, dtype)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ours = FusedAdam(params, lr=1e-2, amsgrad=amsgrad, adam_w_mode=adam_w, weight_decay=wd)
    cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    theirs = cls(ref, lr=1e-2, amsgrad=amsgrad, weight_decay=wd)
    _run_pair(ours, params, theirs, ref)
    _check_against(ours, params, ref, dtype, 1e-5, 1e-6)


def _lamb_reference(start, grads, lr, betas, eps, wd, max_grad_norm, steps):
    """Apex FusedLAMB in float64 (adam_w_mode, grad averaging, bias correction)."""
    w = [p.double().clone() for p in start]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    b1, b2 = betas
    for step in range(1, steps + 1):
        gs = [g.double() for g in grads(step - 1)]
        norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
        clip = norm / max_grad_norm if max_grad_norm > 0 and norm > max_grad_norm else 1.0
        for i, g in enumerate(gs):
            g = g / clip
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            update = (m[i] / (1 - b1 ** step)) / ((v[i] / (1 - b2 ** step)).sqrt() + eps) + wd * w[i]
            wn, un = float(w[i].norm()), float(update.norm())
            ratio = lr * (wn / un) if (wd != 0 and wn != 0 and un != 0) else lr
            w[i] = w[i] - ratio * update
    return w


@FUZZ
@given(shapes=opt_shapes, dtype=st.sampled_from(DTYPES), max_grad_norm=st.sampled_from([0.0, 1.0]))
def test_fused_lamb_vs_float64(shapes, dtype, max_grad_norm):
    params = _params(shapes, dtype)
    start = [p.detach().float().clone() for p in params]
    ours = FusedLAMB(params, lr=1e-2, weight_decay=0.01, max_grad_norm=max_grad_norm)
    for s in range(3):
        for p, g in zip(params, _grads(params, s)):
            p.grad = g
        ours.step()
    expected = _lamb_reference(start, lambda s: _grads(params, s), 1e-2, (0.9, 0.999), 1e-6, 0.01,
                               max_grad_norm, 3)
    for p, e in zip(params, expected):
        got = ours.state[p]["master_param"] if dtype != torch.float32 else p.detach()
        torch.testing.assert_close(got.double(), e, rtol=1e-4, atol=1e-5)


@FUZZ
@given(shapes=opt_shapes, dtype=st.sampled_from(DTYPES), which=st.sampled_from(["sgd", "adam", "lamb"]),
       data=st.data())
def test_fused_optimizers_skip_bit_for_bit_on_found_inf(shapes, dtype, which, data):
    params = _params(shapes, dtype)
    make = {"sgd": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), "adam": lambda ps: FusedAdam(ps, lr=1e-2),
            "lamb": lambda ps: FusedLAMB(ps, lr=1e-2)}[which]
    opt = make(params)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()
    grads = _grads(params, 1)
    flags = plant(grads, data)
    for p, g in zip(params, grads):
        p.grad = g
    snap = [p.detach().clone() for p in params] + [
        v.clone() for p in params for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    found = torch.tensor([max(flags, default=0.0)])
    opt.step(grad_scale=torch.tensor([1.0]), found_inf=found)
    after = [p.detach() for p in params] + [
        v for p in params for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    unchanged = all(same(a, b) for a, b in zip(snap, after))
    if any(flags):
        assert unchanged, "a skipped step changed a weight, master, moment or step counter"
    else:
        assert not unchanged  # a clean step does change something (the control)
    assert all(torch.isfinite(t.float()).all() for t in after)
