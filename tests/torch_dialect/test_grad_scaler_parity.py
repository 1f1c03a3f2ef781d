"""peak.amp.GradScaler against torch.amp.GradScaler in the same run: same scale trajectory, same
skipped steps, bit-identical parameters (torch's documented recipes re-implemented on CPU)."""
import copy
import pickle

import pytest
import torch

from peak import amp
from peak_testing import HostReads
from torch_dialect_helpers import batches, make_model, params_equal, twin

F = torch.nn.functional


def torch_skipped(scaler, opt):
    return bool(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))


def run_lockstep(n_steps, scaler_kwargs, opt_factory, *, inf_at=(), nan_at=(), autocast=True,
                 check_reads=None):
    model_p = make_model()
    model_t, opt_t = twin(model_p, opt_factory)
    opt_p = opt_factory(model_p.parameters())
    sp = amp.GradScaler("cpu", **scaler_kwargs)
    st = torch.amp.GradScaler("cpu", **scaler_kwargs)
    trajectory = []
    for i, (x, y) in enumerate(batches(n_steps, inf_at=inf_at, nan_at=nan_at)):
        for model, opt, scaler, ac in ((model_p, opt_p, sp, amp.autocast),
                                       (model_t, opt_t, st, torch.autocast)):
            opt.zero_grad()
            with ac("cpu", enabled=autocast):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if scaler is sp and check_reads is not None:
                with check_reads.counting():
                    scaler.step(opt)
            else:
                scaler.step(opt)
        skipped_t = torch_skipped(st, opt_t)
        assert sp.last_step_skipped == skipped_t, f"step {i}"
        sp.update()
        st.update()
        assert sp.get_scale() == st.get_scale(), f"step {i}"
        assert sp._get_growth_tracker() == st._get_growth_tracker(), f"step {i}"
        assert params_equal(model_p, model_t), f"parameters differ after step {i}"
        trajectory.append((sp.get_scale(), skipped_t))
    return sp, trajectory


INF_STEPS = (3, 4, 17, 30, 31, 32, 45)
NAN_STEPS = (10, 46)


@pytest.mark.parametrize("cfg", [
    dict(),  # torch's defaults: init 2**16, growth 2, backoff 0.5, interval 2000
    dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.25, growth_interval=3),
    dict(init_scale=3.0, growth_factor=1.5, backoff_factor=0.7, growth_interval=2),
], ids=["torch_defaults", "interval3", "odd_factors"])
def test_sgd_parity_over_60_steps(cfg):
    sp, traj = run_lockstep(60, cfg, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                            inf_at=INF_STEPS, nan_at=NAN_STEPS)
    skipped = [i for i, (_, s) in enumerate(traj) if s]
    assert skipped == sorted(INF_STEPS + NAN_STEPS)
    assert sp.skipped_steps == len(skipped)
    if cfg.get("growth_interval") == 3:  # the scale both grew and backed off
        scales = [s for s, _ in traj]
        assert max(scales) > cfg["init_scale"] and min(scales) < cfg["init_scale"]


def test_adam_foreach_parity_without_autocast():
    run_lockstep(50, dict(growth_interval=4), lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
                 inf_at=(5, 6, 20), autocast=False)


def test_fused_adamw_parity_and_no_host_reads():
    """torch's fused AdamW (CPU) through the _step_supports_amp_scaling hand-off: bit-identical to
    torch's GradScaler driving the same optimizer, and peak's step() reads nothing on the host."""
    reads = HostReads()
    sp, traj = run_lockstep(40, dict(growth_interval=5),
                            lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
                            inf_at=(2, 12, 13), check_reads=reads)
    assert reads.count == 0
    assert [i for i, (_, s) in enumerate(traj) if s] == [2, 12, 13]
    assert sp.skipped_steps == 3


def test_fused_sgd_parity():
    try:
        torch.optim.SGD(make_model().parameters(), lr=0.1, fused=True).step()
    except RuntimeError as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"fused SGD unavailable on CPU: {e}")
    run_lockstep(20, dict(growth_interval=3), lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
                 inf_at=(4,))


# ---- torch's documented recipes (test_cuda.py's grad-scaling tests, run on CPU) ---------------

def _scaling_case(n_batches=4):
    torch.manual_seed(0)
    mods = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)) for _ in range(4)]
    for m in mods[1:]:
        m.load_state_dict(mods[0].state_dict())
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n_batches)]
    return mods, data


@pytest.mark.parametrize("scaler_cls", [amp.GradScaler, torch.amp.GradScaler], ids=["peak", "torch"])
def test_multiple_models_optimizers_losses(scaler_cls):
    """Two models, two optimizers, two losses; an inf in the second model's grads at iteration 2
    -> final scale init * growth**3 * backoff**1, and parameters equal a control run without
    scaling in which only the second optimizer skips iteration 2."""
    mods, data = _scaling_case()
    ctrl0, ctrl1, m0, m1 = mods[0], copy.deepcopy(mods[0]), mods[1], copy.deepcopy(mods[1])
    torch.manual_seed(1)
    for m in (ctrl1, m1):
        for p in m.parameters():
            p.data.add_(0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (ctrl0, ctrl1, m0, m1)]
    scaler = scaler_cls("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)
    skip_iter = 2
    for i, (x, y) in enumerate(data):
        for o in opts:
            o.zero_grad()
        # control: no scaling; the second model skips the bad iteration
        (F.mse_loss(ctrl0(x), y) + F.mse_loss(ctrl1(x), y)).backward()
        opts[0].step()
        if i != skip_iter:
            opts[1].step()
        loss0 = F.mse_loss(m0(x), y)
        loss1 = F.mse_loss(m1(x), y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if i == skip_iter:
            m1[1].weight.grad.data.fill_(float("inf"))
        scaler.unscale_(opts[2])
        scaler.step(opts[2])
        scaler.step(opts[3])
        scaler.update()
    assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5**1
    for c, m in ((ctrl0, m0), (ctrl1, m1)):
        for a, b in zip(c.parameters(), m.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _pair(opt_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5), **kw):
    model_p = make_model()
    model_t, opt_t = twin(model_p, opt_factory)
    kw.setdefault("growth_interval", 2)
    return ((model_p, opt_factory(model_p.parameters()), amp.GradScaler("cpu", **kw)),
            (model_t, opt_t, torch.amp.GradScaler("cpu", **kw)))


def test_gradient_accumulation_parity():
    pair = _pair()
    iters_to_accumulate = 3
    data = batches(18, inf_at=(7,))
    for model, opt, scaler in pair:
        for i, (x, y) in enumerate(data):
            loss = F.mse_loss(model(x), y) / iters_to_accumulate
            scaler.scale(loss).backward()
            if (i + 1) % iters_to_accumulate == 0:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    assert pair[0][2].get_scale() == pair[1][2].get_scale()
    assert pair[0][2].skipped_steps == 1
    assert params_equal(pair[0][0], pair[1][0])


@pytest.mark.parametrize("separate_unscale", [True, False], ids=["unscale_then_clip", "clip_scaled"])
def test_clipping_parity(separate_unscale):
    pair = _pair()
    max_norm = 0.2
    for model, opt, scaler in pair:
        for i, (x, y) in enumerate(batches(12, inf_at=(5,))):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if separate_unscale:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            else:  # torch's test_grad_scaling_clipping: clip the scaled grads by max_norm * scale
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            scaler.step(opt)
            scaler.update()
    assert pair[0][2].get_scale() == pair[1][2].get_scale()
    assert params_equal(pair[0][0], pair[1][0])


def test_gradient_penalty_parity():
    pair = _pair()
    for model, opt, scaler in pair:
        for i, (x, y) in enumerate(batches(10, inf_at=(4,))):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            params = list(model.parameters())
            scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in scaled_grads]
            penalty = sum(g.pow(2).sum() for g in grads).sqrt()
            scaler.scale(loss + penalty).backward()
            scaler.step(opt)
            scaler.update()
    assert pair[0][2].get_scale() == pair[1][2].get_scale()
    assert params_equal(pair[0][0], pair[1][0])


@pytest.mark.parametrize("direction", ["peak_to_torch", "torch_to_peak"])
def test_state_dict_round_trip_with_torch(direction):
    """Train a few steps, move the state across (peak <-> torch), continue in lockstep."""
    (mp, op, sp), (mt, ot, st) = _pair(growth_interval=3)
    data = batches(14, inf_at=(2, 9))
    for model, opt, scaler in ((mp, op, sp), (mt, ot, st)):
        for x, y in data[:5]:
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
    src, dst_cls = (sp, torch.amp.GradScaler) if direction == "peak_to_torch" else (st, amp.GradScaler)
    sd = src.state_dict()
    assert set(torch.amp.GradScaler("cpu").state_dict()) <= set(sd)
    dst = dst_cls("cpu", init_scale=1.0, growth_interval=1000)
    dst.load_state_dict(sd)
    assert dst.get_scale() == src.get_scale() and dst.get_growth_interval() == 3
    assert dst._get_growth_tracker() == src._get_growth_tracker()
    # continue: dst drives a copy of src's model alongside src
    src_model, src_opt = (mp, op) if src is sp else (mt, ot)
    dst_model, dst_opt = copy.deepcopy((src_model, src_opt))
    for x, y in data[5:]:
        for model, opt, scaler in ((src_model, src_opt, src), (dst_model, dst_opt, dst)):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        assert dst.get_scale() == src.get_scale()
    assert params_equal(src_model, dst_model)


def test_pickle_round_trip():
    m = make_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = amp.GradScaler("cpu", growth_interval=2, hysteresis=2, min_scale=1.0)
    s_fresh = pickle.loads(pickle.dumps(s))  # before the first scale(): lazy state
    assert s_fresh.get_scale() == 2.0**16 and s_fresh._scale is None
    for x, y in batches(5, inf_at=(1, 2)):
        o.zero_grad()
        s.scale(F.mse_loss(m(x), y)).backward()
        s.step(o)
        s.update()
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.state_dict() == s.state_dict()
    assert s2._scale is None  # re-created lazily, on the device of the first scaled tensor
    assert s2.skipped_steps == 2
    assert s2.get_growth_factor() == 2.0 and s2._hysteresis == 2 and s2._min_scale == 1.0
    # mid-iteration pickling is refused, as torch does
    s.scale(F.mse_loss(m(torch.randn(4, 8)), torch.randn(4, 8))).backward()
    s.unscale_(o)
    with pytest.raises(AssertionError, match="may only be pickled at the beginning"):
        pickle.dumps(s)


@pytest.mark.parametrize("compiled", ["unscale_and_clip", "whole_step"])
def test_scaler_methods_inside_torch_compile_train_as_torchs(compiled):
    """unscale_ (and step, update) called from code torch.compile traces: peak's run eagerly
    (NOTE: [GradScaler under torch.compile]) and train as torch's scaler does, bit for bit, an
    overflowed step included; traced in part, unscale_ lost its state and step() unscaled again
    (an update 1/scale too small, silently)."""
    import torch.nn.functional as F
    results = []
    for mod in (torch.amp, amp):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = mod.GradScaler("cpu", init_scale=1024.0, growth_interval=2)

        def unscale_and_clip():
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        def whole_step(x, y, mult):
            with mod.autocast("cpu"):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss * mult).backward()
            unscale_and_clip()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss

        compiled_fn = torch.compile(unscale_and_clip if compiled == "unscale_and_clip"
                                    else whole_step)
        g = torch.Generator().manual_seed(1)
        trace = []
        for i in range(4):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
            mult = torch.tensor(float("inf") if i == 2 else 1.0)
            if compiled == "whole_step":
                compiled_fn(x, y, mult)
            else:
                with mod.autocast("cpu"):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss * mult).backward()
                compiled_fn()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            trace.append(scaler.get_scale())
        results.append((trace, [p.detach().clone() for p in model.parameters()]))
    (torch_scales, torch_weights), (scales, weights) = results
    assert scales == torch_scales and scales[2] < scales[1]
    for ours, theirs in zip(weights, torch_weights):
        assert torch.equal(ours, theirs)


def test_apex_step_grad_scaler_contract_inside_torch_compile():
    """FusedMixedPrecisionLamb.step(grad_scaler=scaler) called from compiled code: the scaler's
    check it calls runs eagerly too, so update() finds it (it lost its entry and raised "No inf
    checks were recorded"); the run equals the eager one bit for bit, an overflow included."""
    import torch.nn.functional as F
    from peak.optimizers import FusedMixedPrecisionLamb
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-2)
        scaler = amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)

        def step():
            opt.step(grad_scaler=scaler)

        fn = torch.compile(step) if compiled else step
        g, scales = torch.Generator().manual_seed(1), []
        for i in range(4):
            with amp.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(torch.randn(6, 8, generator=g)),
                                       torch.randint(0, 4, (6,), generator=g))
            scaler.scale(loss * (float("inf") if i == 2 else 1.0)).backward()
            fn()
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        results.append((scales, [p.detach().clone() for p in model.parameters()]))
    (eager_scales, eager), (scales, weights) = results
    assert scales == eager_scales and scales[2] < scales[1]
    assert all(torch.equal(w, e) for w, e in zip(weights, eager))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_gradients_with_duplicate_rows_step_as_torchs(dtype):
    """A sparse embedding gradient with many duplicate rows: peak's scaler leaves bf16 (and fp32)
    ones uncoalesced, as torch's does (it summed bf16 duplicates in bf16 first: 256 where the
    rows add up to 1000), so SGD steps to torch's bits."""
    weights = []
    for mod in (torch.amp, amp):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(4, 2, sparse=True).to(dtype)
        opt = torch.optim.SGD(emb.parameters(), lr=0.01)
        scaler = mod.GradScaler("cpu", init_scale=4.0)
        scaler.scale(emb(torch.tensor([1] * 1000 + [2])).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
        weights.append(emb.weight.detach().clone())
    assert torch.equal(weights[1], weights[0])
