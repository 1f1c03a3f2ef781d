"""Damaged optimizer checkpoints are refused before anything changes: a missing, extra,
mis-shaped or mis-typed entry, an 8-bit moment without its scale, a missing step count, an extra
parameter id -- in every state layout. The error names the entry; the optimizer's state, its
param_groups and the weights stay bit for bit as they were, and the optimizer still steps."""
import copy

import pytest
import torch

from peak.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from peak_testing import assert_bitwise_equal

BF16, U8 = torch.bfloat16, torch.uint8

# name: (make optimizer over params, parameter dtype, the moment key to damage)
LAYOUTS = {
    "adam_fp32_masters": (lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=True), BF16, "exp_avg"),
    "adam_remainders_bf16": (lambda ps: FusedAdam(ps, lr=1e-2, store_param_remainders=True,
                                                  exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
                             BF16, "exp_avg"),
    "adam_8bit": (lambda ps: FusedAdam(ps, lr=1e-2, store_param_remainders=True,
                                       exp_avg_dtype=U8, exp_avg_sq_dtype=U8), BF16, "exp_avg_sq"),
    "adam_amsgrad_fp32": (lambda ps: FusedAdam(ps, lr=1e-2, amsgrad=True), torch.float32,
                          "exp_avg_sq"),
    "sgd_momentum": (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), BF16, "momentum_buffer"),
    "sgd_8bit": (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, store_param_remainders=True,
                                     momentum_dtype=U8), BF16, "momentum_buffer"),
    "lamb": (lambda ps: FusedLAMB(ps, lr=1e-2), BF16, "exp_avg_sq"),
    "adagrad": (lambda ps: FusedAdagrad(ps, lr=0.1), torch.float32, "sum"),
    "novograd": (lambda ps: FusedNovoGrad(ps, lr=1e-2), torch.float32, "exp_avg_sq"),
}


def trained(layout, steps=2):
    make, dtype, _ = LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in ((300,), (5, 7))]
    opt = make(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
    return params, opt


def snapshot(params, opt):
    return ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))


def assert_unchanged(before, params, opt):
    weights, sd = before
    assert all(torch.equal(a, b.detach()) for a, b in zip(weights, params))
    now = opt.state_dict()
    assert now["param_groups"] == sd["param_groups"]
    assert now["state"].keys() == sd["state"].keys()
    for pid, entries in sd["state"].items():
        assert now["state"][pid].keys() == entries.keys()
        for k, v in entries.items():
            w = now["state"][pid][k]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if torch.is_tensor(v) else v == w


def damages(layout, sd):
    """(description, damaged copy, words the error must contain) for one layout's state dict."""
    key = LAYOUTS[layout][2]
    out = []

    def edited(fn):
        d = copy.deepcopy(sd)
        fn(d)
        return d

    if key != "momentum_buffer":  # (SGD: a missing buffer starts at the next step, as torch's)
        out.append(("missing moment", edited(lambda d: d["state"][0].pop(key)),
                    f"missing ['{key}'"))
    # (SGD and Adagrad: torch.optim.SGD and Apex's FusedAdagrad keep no step count, so a missing
    # one starts at 0.)
    if "step" in sd["state"][0] and layout not in ("sgd_momentum", "sgd_8bit", "adagrad"):
        out.append(("missing step", edited(lambda d: d["state"][0].pop("step")), "['step']"))
    out.append(("extra entry", edited(lambda d: d["state"][1].__setitem__("foo", torch.zeros(1))),
                "unknown entries ['foo']"))
    value = sd["state"][0][key]
    if value.dim() > 0:
        out.append(("mis-shaped", edited(lambda d: d["state"][0].__setitem__(key, value[:-1])),
                    f"'{key}' has shape"))
    out.append(("mis-typed", edited(lambda d: d["state"][0].__setitem__(
        key, torch.zeros(value.shape, dtype=torch.int32))), f"'{key}' has dtype torch.int32"))
    if value.dtype == U8:
        out.append(("8-bit without its scale",
                    edited(lambda d: d["state"][0].pop(key + "_scale")), f"'{key}_scale'"))
    out.append(("extra parameter id",
                edited(lambda d: d["state"].__setitem__(7, copy.deepcopy(d["state"][0]))),
                "parameter id 7"))
    out.append(("fewer parameters", edited(lambda d: d["param_groups"][0]["params"].pop()),
                "has 1 parameters"))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_damaged_checkpoint_is_refused_and_nothing_changes(layout):
    params, opt = trained(layout)
    sd = copy.deepcopy(opt.state_dict())
    cases = damages(layout, sd)
    assert len(cases) >= 5
    if layout == "sgd_8bit":  # the buffer gone but not its scale
        d = copy.deepcopy(sd)
        d["state"][0].pop("momentum_buffer")
        cases.append(("scale without codes", d, "'momentum_buffer_scale' (8-bit scales) without"))
    for what, damaged, words in cases:
        before = snapshot(params, opt)
        with pytest.raises(ValueError, match="load_state_dict") as err:
            opt.load_state_dict(damaged)
        assert words in str(err.value), (what, str(err.value))
        assert_unchanged(before, params, opt)
    # The undamaged checkpoint still loads, and the optimizer steps on.
    opt.load_state_dict(sd)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


def test_a_missing_moment_is_not_restarted_at_zero():
    """The failure this check exists for: before it, an AdamW checkpoint without one exp_avg
    loaded, the step recreated the moment as zeros beside the saved exp_avg_sq and step count."""
    params, opt = trained("adam_fp32_masters")
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][1]["exp_avg"]
    fresh = FusedAdam([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2,
                      adam_w_mode=True)
    with pytest.raises(ValueError, match=r"\['params'\]\[1\]\): missing \['exp_avg'\]"):
        fresh.load_state_dict(sd)
    assert not fresh.state  # nothing was loaded


def test_checkpoints_that_are_whole_still_load():
    """What the check must let through: a state before any step (amp's masters only), a torch
    optimizer's checkpoint (no masters; SGD without step counts), Apex's group step count."""
    g = torch.Generator().manual_seed(1)
    w = [torch.nn.Parameter(torch.randn(10, generator=g)) for _ in range(2)]
    ref = torch.optim.SGD(w, lr=0.1, momentum=0.9)
    for p in w:
        p.grad = torch.randn(10, generator=g)
    ref.step()
    FusedSGD(w, lr=0.1, momentum=0.9).load_state_dict(ref.state_dict())
    ref = torch.optim.AdamW(w, lr=0.1)
    ref.step()
    FusedAdam(w, lr=0.1, adam_w_mode=True).load_state_dict(ref.state_dict())
    sd = ref.state_dict()  # Apex's FusedAdam: the step count in the group, none per parameter
    for st in sd["state"].values():
        st.pop("step")
    sd["param_groups"][0]["step"] = 1
    FusedAdam(w, lr=0.1, adam_w_mode=True).load_state_dict(sd)
    empty = FusedAdam(w, lr=0.1).state_dict()
    FusedAdam(w, lr=0.1).load_state_dict(empty)


def test_add_param_group_takes_what_torchs_takes():
    """The DTensor check in add_param_group reads the parameters once: a generator, a single
    tensor and a list still work as in torch, and a set is still torch's error."""
    a, b, c = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))
    opt = FusedAdam([a], lr=0.1)
    opt.add_param_group({"params": (p for p in [b])})
    opt.add_param_group({"params": c})
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1, 1]
    with pytest.raises(TypeError, match="set"):
        opt.add_param_group({"params": {torch.nn.Parameter(torch.randn(2))}})


@pytest.mark.parametrize("make, group, match", [
    (lambda w: FusedSGD(w, lr=0.1), {"lr": -1.0}, r"Invalid learning rate: -1.0"),
    (lambda w: FusedSGD(w, lr=0.1), {"momentum": -0.5}, r"Invalid momentum value"),
    (lambda w: FusedSGD(w, lr=0.1), {"nesterov": 1}, r"nesterov must be True or False"),
    (lambda w: FusedAdam(w, lr=0.1), {"betas": (0.9, 1.0)}, r"beta parameter at index 1"),
    (lambda w: FusedAdam(w, lr=0.1), {"betas": (0.9,)}, r"betas must be a pair"),
    (lambda w: FusedAdam(w, lr=0.1), {"eps": -1e-8}, r"Invalid epsilon value"),
    (lambda w: FusedAdam(w, lr=0.1, exp_avg_dtype=torch.bfloat16,
                         exp_avg_sq_dtype=torch.bfloat16),
     {"moment_rounding": "Stochastic"}, r"moment_rounding must be 'stochastic'"),
    (lambda w: FusedAdam(w, lr=0.1), {"exp_avg_dtype": "fp8"}, r"exp_avg_dtype"),
    (lambda w: FusedAdagrad(w, lr=0.1), {"lr_decay": -1.0}, r"Invalid lr_decay"),
    (lambda w: FusedLAMB(w, lr=0.1), {"max_grad_norm": -1.0}, r"Invalid max_grad_norm"),
    (lambda w: FusedNovoGrad(w, lr=0.1), {"norm_type": 1}, r"norm_type must be 2"),
    (lambda w: FusedNovoGrad(w, lr=0.1), {"norm_type": "inf"}, r"norm_type must be 2"),
])
def test_a_param_groups_own_options_are_checked_as_the_constructors(make, group, match):
    """add_param_group (and a dict in params) checks what the group sets as the constructor checks
    its arguments: a typo in moment_rounding silently rounded to nearest, lr=-1 stepped uphill."""
    w = [torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))]
    opt = make(w)
    before = copy.deepcopy(opt.state_dict())
    extra = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [extra], **group})
    assert_bitwise_equal(opt.state_dict(), before)  # nothing added
    with pytest.raises(ValueError, match=match):
        make([{"params": [extra], **group}])
    opt.add_param_group({"params": [extra], "lr": 0.01})  # a good one still goes in
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("bad, options, exc, match", [
    (lambda: torch.randn(3, dtype=torch.float64), {}, TypeError, "got a torch.float64 parameter"),
    (lambda: torch.randn(8, 10)[:, :5], {}, RuntimeError, r"shape \(8, 5\) is not dense"),
    (lambda: torch.randn(3).half(), {"store_param_remainders": True}, TypeError,
     "store_param_remainders=True"),
    (lambda: torch.randn(3).half(), {"stochastic_rounding": True}, TypeError,
     "stochastic_rounding=True"),
], ids=["fp64", "non-dense", "fp16 remainders", "fp16 stochastic rounding"])
def test_a_step_the_kernels_cannot_take_is_refused_before_any_group_steps(bad, options, exc,
                                                                          match):
    """A parameter the kernels cannot step, in a later group: refused before the first group
    steps (it used to be stepped, and a retried step stepped it twice). An fp64 parameter is
    refused when its group is added; made fp64 later (model.double()), at the step."""
    good = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    value = bad()
    other = torch.nn.Parameter(value.float() if value.dtype == torch.float64 else value)
    group = {"params": [other], **options}
    if "stochastic_rounding" in options:
        opt = FusedAdam([{"params": [good]}], lr=0.1, master_weights=False,
                        stochastic_rounding=True)
        opt.add_param_group(group)
    else:
        opt = FusedAdam([{"params": [good]}, group], lr=0.1)
    other.data = value
    good.grad, other.grad = torch.ones_like(good), torch.ones_like(other)
    before = good.detach().clone()
    with pytest.raises(exc, match=match):
        opt.step()
    assert torch.equal(good.detach(), before) and not opt.state


@pytest.mark.parametrize("change, match", [
    ({"lr": "fast"}, r"param group 0: Invalid learning rate: 'fast' \(must be a number\)"),
    ({"betas": (0.9,)}, r"param group 0: betas must be a pair"),
    ({"eps": -1.0}, r"param group 0: Invalid epsilon value: -1.0"),
    ({"amsgrad": "yes"}, r"param group 0: amsgrad must be True or False"),
])
def test_damaged_hyperparameters_are_refused_before_the_state_is_replaced(change, match):
    w = [torch.nn.Parameter(torch.randn(4))]
    opt = FusedAdam(w, lr=0.1)
    w[0].grad = torch.ones(4)
    opt.step()
    good = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(good)
    bad["param_groups"][0].update(change)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    assert_bitwise_equal(opt.state_dict(), good)
    opt.step()  # and it still steps


def test_a_param_group_may_name_its_moment_storage_as_a_string():
    w, v = (torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16)) for _ in range(2))
    opt = FusedAdam([w], lr=0.1)
    opt.add_param_group({"params": [v], "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"})
    assert opt.param_groups[1]["exp_avg_dtype"] == torch.bfloat16
    v.grad, w.grad = torch.ones_like(v), torch.ones_like(w)
    opt.step()
    assert opt.state[v]["exp_avg"].dtype == torch.bfloat16 == opt.state[v]["exp_avg_sq"].dtype


def test_state_an_option_starts_mid_run_is_not_required():
    """Options switched on after some steps (a momentum warm-up from 0, amsgrad) start their state
    at the next step, as the optimizer's own step does: such a checkpoint loads. So does Apex's
    FusedAdagrad layout (only 'sum'). A step count that is not a count is refused."""
    g = torch.Generator().manual_seed(2)
    w = [torch.nn.Parameter(torch.randn(6, generator=g))]
    for make, switch in ((lambda: FusedSGD(w, lr=0.1, momentum=0.0), ("momentum", 0.9)),
                         (lambda: FusedAdam(w, lr=0.1), ("amsgrad", True))):
        opt = make()
        w[0].grad = torch.randn(6, generator=g)
        opt.step()
        opt.param_groups[0][switch[0]] = switch[1]
        fresh = make()
        fresh.load_state_dict(opt.state_dict())
        fresh.step()  # the state starts here
    apex = {"state": {0: {"sum": torch.rand(6)}},
            "param_groups": [dict(lr=1e-2, eps=1e-10, weight_decay=0.0, params=[0])]}
    FusedAdagrad(w).load_state_dict(apex)
    opt = FusedAdam(w, lr=0.1)
    opt.step()
    for bad in (torch.tensor(True), torch.tensor(float("nan")), -1.0, torch.tensor([1.0, 2.0])):
        sd = copy.deepcopy(opt.state_dict())
        sd["state"][0]["step"] = bad
        with pytest.raises(ValueError, match="'step' must be"):
            opt.load_state_dict(sd)


def test_named_dtensor_parameters_are_checked_at_construction():
    """torch's named parameters ((name, tensor) pairs) are unwrapped before the DTensor check
    (what peak cannot step on shards is refused there: tests/distributed/test_sharded_fused.py)."""
    import types

    p = torch.nn.Parameter(torch.ones(2))
    # what marks a DTensor (FSDP2's parameters) for the check: a mesh and placements
    p.device_mesh, p.placements = types.SimpleNamespace(ndim=2), ()
    for params in ([p], [("w", p)], [{"params": [("w", p)]}]):
        for cls in (FusedAdam, FusedLAMB):
            with pytest.raises(NotImplementedError, match="DTensor parameters sharded over a one-"):
                cls(params, lr=0.1)
    with pytest.raises(TypeError):
        FusedAdam([torch.nn.Parameter(torch.ones(2))]).add_param_group([p])  # not a dict


def test_8bit_moments_cast_by_a_loader_are_refused(tmp_path):
    """torch.distributed.checkpoint loads into the loading optimizer's own storage and casts 8-bit
    codes to its dtype as numbers: a checkpoint saved with 8-bit moments, loaded that way into
    fp32 moments, is refused (the saved group says what was 8-bit); the same checkpoint through
    optimizer.load_state_dict converts (decodes) and loads."""
    import torch.distributed.checkpoint as dcp

    def build(**lean):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4, 256))
        opt = FusedAdam([p], lr=1e-2, **lean)
        p.grad = torch.randn(4, 256)
        opt.step()
        return p, opt

    _, saver = build(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    saved = saver.state_dict()
    assert saved["param_groups"][0]["moments_8bit_layout"] == "flat"
    dcp.save({"optim": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    p, loader = build()
    template = {"optim": loader.state_dict()}
    dcp.load(template, checkpoint_id=str(tmp_path), no_dist=True)
    assert template["optim"]["state"][0]["exp_avg"].dtype == torch.float32  # (cast as numbers)
    before = {k: v.clone() for k, v in loader.state[p].items()}
    with pytest.raises(ValueError, match="'exp_avg' was saved as uint8 .* but arrives as "
                                         "torch.float32: a loader cast it"):
        loader.load_state_dict(template["optim"])
    assert_bitwise_equal(dict(loader.state[p]), before)  # nothing loaded
    loader.load_state_dict(saver.state_dict())  # in memory: decoded
    assert loader.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_remainder_checkpoint_is_refused_for_a_model_not_in_bf16(dtype):
    """A remainder is the 16 bits a bf16 weight drops: loaded for an fp16 (or fp32) parameter it
    was joined with that parameter's bits, silently wrong masters (up to 0.43 off). It is refused
    before anything loads, with the way to convert."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16).to(torch.bfloat16))
    lean = FusedAdam([p], lr=1e-2, store_param_remainders=True)
    p.grad = torch.randn(16).to(torch.bfloat16)
    lean.step()
    q = torch.nn.Parameter(torch.randn(16).to(dtype))
    opt = FusedAdam([q], lr=1e-2)
    before = q.detach().clone()
    with pytest.raises(ValueError, match=f"a remainder master .* for a {dtype} parameter.*"
                                         "export_fp32_state_dict"):
        opt.load_state_dict(lean.state_dict())
    assert len(opt.state) == 0 and torch.equal(q.detach(), before)


@pytest.mark.parametrize("group", [{"nesterov": True, "momentum": 0.0},
                                   {"nesterov": True, "dampening": 0.1}], ids=["no momentum",
                                                                                "dampening"])
def test_a_nesterov_group_steps_as_torchs(group):
    """torch.optim.SGD checks nesterov's momentum and dampening in its constructor only: a group
    added (or set) later with nesterov=True and momentum 0 steps as plain SGD (a momentum warm-up
    from 0), one with dampening by the same formula; FusedSGD's step raised there after stepping
    the earlier groups."""
    def run(make):
        torch.manual_seed(0)
        w = [torch.nn.Parameter(torch.randn(8)) for _ in range(2)]
        opt = make([w[0]])
        opt.add_param_group({"params": [w[1]], **group})
        for step in range(3):
            for p in w:
                p.grad = torch.randn(8, generator=torch.Generator().manual_seed(step))
            opt.step()
        return w

    fused = run(lambda p: FusedSGD(p, lr=0.1, momentum=0.9, nesterov=True))
    reference = run(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True))
    for a, b in zip(fused, reference):
        assert torch.equal(a, b)
