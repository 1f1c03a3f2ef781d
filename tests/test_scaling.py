"""peak.scaling, the one loss-scaling core, tested on its own (its front doors -- GradScaler,
amp's LossScaler, FP16_Optimizer -- have their own suites): grouping, overflow flags, unscale
against float64, the scale update against a plain reference of torch's rule, and the state
round trip a pickle makes."""
import math
import pickle

import pytest
import torch

from peak.scaling import (LossScale, OverflowFlags, group_by_device_dtype, optimizer_gradients,
                          merge_flags, unscale_grads_)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def test_group_by_device_dtype_keeps_order_and_rows():
    a, b, c, d = torch.ones(2), torch.ones(3, dtype=F16), torch.ones(4), torch.ones(5, dtype=F16)
    groups = group_by_device_dtype([a, b, c, d])
    assert [(g[1], g[2]) for g in groups] == [(F32, [0, 2]), (F16, [1, 3])]
    assert groups[0][3][0][1] is c and groups[1][3][0][0] is b
    # Parallel lists: a row's key is every list's (device, dtype), the first list's names it.
    outs = [torch.ones(2), torch.ones(3), torch.ones(4, dtype=BF16), torch.ones(5)]
    groups = group_by_device_dtype([a, b, c, d], outs)
    assert [(g[1], g[2]) for g in groups] == [(F32, [0]), (F16, [1, 3]), (F32, [2])]
    assert groups[1][3][1][1] is outs[3]


def test_overflow_flags_per_device_and_clear():
    flags = OverflowFlags()
    f = flags.for_device(torch.device("cpu"))
    assert f.shape == (1,) and f.dtype == F32 and f.item() == 0
    assert flags.for_device(torch.device("cpu")) is f  # created once
    assert not flags.any_()
    f.fill_(1.0)
    assert flags.any_()
    flags.zero_()
    assert not flags.any_() and f.item() == 0
    own = torch.zeros(())
    assert OverflowFlags((), first=own).for_device(torch.device("cpu")) is own


def test_merge_flags_is_any_not_sum():
    """Merged flags are 0 or 1 (torch's fused optimizers skip only on a flag of exactly 1)."""
    assert merge_flags([], torch.device("cpu"), (1,)).tolist() == [0.0]
    a, b, c = torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor(0.0)
    merged = merge_flags([a, b, c], torch.device("cpu"))
    assert merged.shape == () and merged.item() == 1.0 and a.item() == 1.0  # a new tensor
    assert merge_flags([c, c.reshape(1)], torch.device("cpu"), (1,)).tolist() == [0.0]


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("inv_scale", [1 / 1024, torch.tensor([1 / 3])])
def test_unscale_grads_against_float64(dtype, inv_scale):
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=g) * 100).to(dtype) for n in (1, 257, 70_000)]
    ref = [x.double() * (float(inv_scale) if isinstance(inv_scale, float) else
                         inv_scale.double().item()) for x in grads]
    flags = OverflowFlags()
    outs = [torch.empty_like(x, dtype=F32) for x in grads]
    unscale_grads_(grads, inv_scale, flags, outputs=outs)
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o.double(), r, rtol=2**-24, atol=0)  # one fp32 rounding
    assert not flags.any_()
    unscale_grads_(grads, inv_scale, flags)  # in place, in the grads' dtype
    tol = {F32: 2**-24, F16: 2**-11, BF16: 2**-8}[dtype]
    for x, r in zip(grads, ref):
        torch.testing.assert_close(x.double(), r, rtol=tol, atol=2**-24 if dtype == F16 else 0)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_unscale_flags_inf_nan_and_attributes_it(bad):
    grads = [torch.ones(300), torch.ones(70_000, dtype=F16), torch.ones(5)]
    grads[1][65_537] = bad  # the second chunk of the fp16 tensor
    flags, seen = OverflowFlags(), {}
    unscale_grads_(grads, 0.5, flags, on_group=lambda idx, f: seen.update(zip(idx, f.tolist())))
    assert flags.any_()
    assert seen == {0: 0.0, 1: 1.0, 2: 0.0}
    assert grads[0][0].item() == 0.5


def test_check_only_and_float64():
    grads = [torch.ones(4, dtype=torch.float64) * 3, torch.ones(3)]
    flags = OverflowFlags()
    unscale_grads_(grads[1:], 1.0, flags, check_only=True)
    assert grads[1].tolist() == [1.0] * 3 and not flags.any_()
    with pytest.raises(RuntimeError, match="Double"):  # the kernels take no float64...
        unscale_grads_(grads, 0.5, flags)
    unscale_grads_(grads, 0.5, flags, float64=True)  # ...torch's does, when asked (GradScaler)
    assert grads[0].tolist() == [1.5] * 4 and grads[1].tolist() == [0.5] * 3
    grads[0][1] = math.inf
    unscale_grads_(grads, 0.5, flags, float64=True)
    assert flags.any_()


def reference_update(scale, growth, hyst, found, *, growth_factor, backoff_factor, interval,
                     hysteresis, min_scale, max_scale):
    """torch's _amp_update_scale_ with Apex's update_scale_hysteresis and its bounds, in plain
    Python: an overflow counts the tracker down (not below 0) and backs off once it is spent; any
    clean update refills it; growth after `interval` clean updates in a row."""
    if found:
        if hyst - 1 <= 0:
            scale = max(scale * backoff_factor, min_scale)
        return scale, 0, max(hyst - 1, 0)
    growth += 1
    if growth == interval:
        scale, growth = min(scale * growth_factor, max_scale), 0
    return scale, growth, hysteresis


def test_update_follows_the_reference_rule_over_a_sequence():
    opts = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2,
                min_scale=2.0**4, max_scale=2.0**12)
    core = LossScale(2.0**8, device="cpu", **opts)
    state = (2.0**8, 0, 2)
    seq = [0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1] + [0] * 30
    seen = []
    for found in seq:
        flag = core.found_inf.for_device(torch.device("cpu"))
        flag.fill_(float(found))
        core.update()
        state = reference_update(*state, found, growth_factor=2.0, backoff_factor=0.5,
                                 interval=3, hysteresis=2, min_scale=2.0**4, max_scale=2.0**12)
        got = (core.scale.item(), int(core.growth_tracker.item()),
               int(core.hysteresis_tracker.item()))
        assert got == state, (found, got, state)
        seen.append(got[0])
        core.found_inf.zero_()
    assert min(seen) == 2.0**4 and seen[-1] == 2.0**12  # down to the floor, up to the ceiling


@pytest.mark.parametrize("window", [2**31, 2**32 + 1, 10**12])
def test_a_window_past_int32_never_grows(window):
    """Apex takes any scale_window (a huge one: "never grow"); the update's trackers are int32,
    so the core passes at most 2**31 - 1: cast, 2**32 + 1 was 1 (growth every update), and 2**31
    was refused at the first step."""
    core = LossScale(2.0**8, device="cpu", growth_interval=window)
    for _ in range(5):
        core.update()
    assert core.scale.item() == 2.0**8 and int(core.growth_tracker.item()) == 5


def test_inv_scale_is_the_float64_reciprocal():
    core = LossScale(3.0, device="cpu")
    assert core.inv_scale().item() == torch.tensor(1 / 3.0, dtype=torch.float64).float().item()


def test_dematerialized_state_round_trips():
    core = LossScale(2.0**10, device="cpu", growth_interval=5, hysteresis=3)
    core.found_inf.for_device(torch.device("cpu")).fill_(1.0)
    core.update()  # one overflow: the hysteresis tracker drops, the scale holds
    copy = pickle.loads(pickle.dumps(core.dematerialized()))
    assert copy.scale is None and not copy.found_inf
    copy.materialize(torch.device("cpu"))
    assert torch.equal(copy.scale, core.scale)
    assert torch.equal(copy.hysteresis_tracker, core.hysteresis_tracker)
    assert torch.equal(copy.growth_tracker, core.growth_tracker)


def test_optimizer_gradients_local_values_and_owners():
    p, q = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    r = torch.nn.Parameter(torch.ones(3, dtype=F16))
    p.grad = torch.full((3,), 2.0)
    r.grad = torch.sparse_coo_tensor([[0, 0]], torch.tensor([1.0, 2.0], dtype=F16), (3,),
                                     check_invariants=True)
    opt = torch.optim.SGD([{"params": [p, q]}, {"params": [r]}], lr=0.1)
    grads, owners = optimizer_gradients(opt, with_owners=True)
    assert [o[1:] for o in owners] == [(0, 0), (1, 0)]
    assert grads[0] is p.grad
    assert grads[1].tolist() == [3.0]  # fp16 sparse: coalesced before its values are read
    assert r.grad.is_coalesced()
