"""The Apex dialect skips on the device: with a fused optimizer (peak's, or torch's fused=True)
nothing between scale_loss's exit and the end of step() reads a tensor on the host, at every
opt_level, static or dynamic scaling, fp16 or bf16, at verbosity 0; the skip leaves weights,
masters and optimizer state bit for bit; the overflow message arrives from a non-blocking copy.
Non-fused torch optimizers keep the host decision (one read at the exit), as torch's GradScaler.

Host reads are counted by peak_testing.HostReads, a TorchDispatchMode (aten::_local_scalar_dense,
aten::is_nonzero, device-to-host copies) that also sees reads made from C++ (the bindings' walks)."""
import pytest
import torch
import torch.nn.functional as F

from peak import amp
from peak.optimizers import FusedAdam, FusedSGD
from peak_testing import HostReads, assert_bitwise_equal, make_mlp, regression_batch


def make_model(seed=0):
    return make_mlp(seed, act=torch.nn.ReLU)


def batch(step, n=8):
    return regression_batch(100 + step, n, 6, 3)


OPTIMIZERS = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
    "FusedAdam clipping": lambda ps: FusedAdam(ps, lr=1e-2, max_grad_norm=1.0),
    "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def setup(opt_name, level, low, loss_scale, seed=0):
    amp._amp_state.reset()
    model = make_model(seed)
    opt = OPTIMIZERS[opt_name](model.parameters())
    kwargs = {} if loss_scale is None else {"loss_scale": loss_scale}
    return amp.initialize(model, opt, opt_level=level, low_precision_dtype=low, verbosity=0,
                          **kwargs)


def one_step(model, opt, step, poison=False, counter=None):
    opt.zero_grad()
    x, y = batch(step)
    loss = F.mse_loss(model(x).float(), y)
    cm = amp.scale_loss(loss, opt)
    scaled = cm.__enter__()
    scaled.backward()
    if poison:
        next(model.parameters()).grad.view(-1)[1] = float("inf")
    if counter is None:
        cm.__exit__(None, None, None)
        opt.step()
        return
    with counter.counting():
        cm.__exit__(None, None, None)
        opt.step()


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("loss_scale", [None, "dynamic", 128.0], ids=["default", "dynamic",
                                                                    "static"])
def test_no_host_read_from_scale_loss_exit_to_step_end(opt_name, level, low, loss_scale):
    if level == "O3" and loss_scale is None and low == torch.float16:
        loss_scale = "dynamic"  # (O3's default is a static 1: covered by "static" too)
    model, opt = setup(opt_name, level, low, loss_scale)
    counter = HostReads()
    for step in range(3):
        one_step(model, opt, step, poison=step == 1, counter=counter)
    assert counter.reads == [], counter.reads


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_non_fused_torch_optimizer_keeps_the_host_decision(level):
    """A step that cannot take found_inf: one host read at scale_loss exit decides (the count
    pins the rule: one, not more)."""
    amp._amp_state.reset()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype=torch.float16,
                                verbosity=0)
    x, y = batch(0)
    cm = amp.scale_loss(F.mse_loss(model(x).float(), y), opt)
    cm.__enter__().backward()
    counter = HostReads()
    with counter.counting():  # (torch's non-fused step reads its own step counts)
        cm.__exit__(None, None, None)
    assert counter.reads == ["aten::_local_scalar_dense"]


def _state_bits(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    # (the weights stepped, read without amp.master_params, which gives them gradients)
    stepped = (opt.master_params() if hasattr(opt, "master_params")
               else (p for g in opt.param_groups for p in g["params"]))
    out += [m.detach().clone() for m in stepped]
    for st in opt.state.values():
        out += [v.detach().clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_device_skip_leaves_every_state_bit_for_bit_and_backs_off(opt_name, level):
    """A poisoned step skipped on the device: weights, masters and optimizer state (step counts
    included) are bit for bit those of a run that never took the step; the scale halves."""
    model, opt = setup(opt_name, level, torch.float16, "dynamic")
    for step in range(2):
        one_step(model, opt, step)
    before = _state_bits(model, opt)
    scale = amp._amp_state.loss_scalers[0].loss_scale()
    one_step(model, opt, 2, poison=True)
    assert_bitwise_equal(_state_bits(model, opt), before)
    assert amp._amp_state.loss_scalers[0].loss_scale() == scale / 2
    one_step(model, opt, 3)  # and training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_overflow_message_comes_from_the_report_without_a_stall(capsys):
    """verbosity=1: the message of a skipped step, printed by step() once its report arrived (on
    the CPU at once), with the loss id and the scale after the back-off."""
    amp._amp_state.reset()
    model = make_model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.float16,
                                verbosity=1, num_losses=2)
    capsys.readouterr()
    scale = amp._amp_state.loss_scalers[1].loss_scale()
    opt.zero_grad()
    x, y = batch(0)
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt, loss_id=0) as s:
        s.backward()
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt, loss_id=1) as s:
        s.backward()
        next(model.parameters()).grad.view(-1)[0] = float("nan")
    opt.step()
    out = capsys.readouterr().out
    assert out.count("Gradient overflow.  Skipping step") == 1
    assert f"loss scaler 1 reducing loss scale to {scale / 2}" in out
    one_step(model, opt, 1)
    assert "Gradient overflow" not in capsys.readouterr().out


@pytest.mark.parametrize("make_optimizer", [lambda ps: FusedAdam(ps, lr=1e-2),
                                            lambda ps: torch.optim.Adam(ps, lr=1e-2)],
                         ids=["device skip", "host skip"])
def test_overflow_message_names_the_first_overflow_with_the_scale_at_the_step(capsys,
                                                                            make_optimizer):
    """Two overflowing passes of one step (loss 1, then loss 0 twice): one line, as Apex prints it
    at step(): the first overflowing loss, its scaler's scale as the step finds it (the device
    skip printed the scale of that loss's first back-off)."""
    amp._amp_state.reset()
    model = make_model()
    model, opt = amp.initialize(model, make_optimizer(model.parameters()), opt_level="O2",
                                low_precision_dtype=torch.float16, verbosity=1, num_losses=2)
    capsys.readouterr()
    scale = amp._amp_state.loss_scalers[0].loss_scale()
    x, y = batch(0)
    for loss_id in (0, 0, 1):
        with amp.scale_loss(F.mse_loss(model(x).float(), y) * float("inf"), opt,
                            loss_id=loss_id) as s:
            s.backward()
    opt.step()
    out = capsys.readouterr().out
    assert out.count("Gradient overflow.  Skipping step") == 1
    assert f"loss scaler 0 reducing loss scale to {scale / 4}" in out


@pytest.mark.parametrize("poisoned", [0, 1])
def test_two_losses_accumulate_like_one_run_and_an_overflow_charges_its_own_scaler(poisoned):
    """Gradients of an earlier loss are set aside while the next backward runs: an inf in one
    loss's gradients backs off that loss's scaler only, and the step is skipped."""
    amp._amp_state.reset()
    model = make_model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.float16,
                                verbosity=0, num_losses=2)
    scalers = amp._amp_state.loss_scalers
    one_step(model, opt, 0)  # (a first step creates the state)
    s0, s1 = scalers[0].loss_scale(), scalers[1].loss_scale()
    before = _state_bits(model, opt)
    opt.zero_grad()
    x, y = batch(1)
    for loss_id in (0, 1):
        with amp.scale_loss(F.mse_loss(model(x).float(), y), opt, loss_id=loss_id) as s:
            s.backward()
            if loss_id == poisoned:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()
    assert_bitwise_equal(_state_bits(model, opt), before)
    assert [scalers[0].loss_scale(), scalers[1].loss_scale()] == (
        [s0 / 2, s1] if poisoned == 0 else [s0, s1 / 2])


@pytest.mark.parametrize("opt_name", ["FusedAdam", "torch AdamW fused"])
def test_device_and_host_decisions_train_the_same(opt_name):
    """The same run with the skip decided on the device and on the host (the step wrapped so it
    no longer takes found_inf): the same weights, bit for bit, through an overflow."""
    def run(device_skip):
        model, opt = setup(opt_name, "O2", torch.float16, "dynamic")
        if not device_skip:
            opt._amp_stash.device_skip = False
        for step in range(5):
            one_step(model, opt, step, poison=step == 2)
        return [p.detach().clone() for p in model.parameters()]
    assert_bitwise_equal(run(True), run(False))


def test_accumulated_gradients_that_overflow_only_as_a_sum_skip_and_back_off():
    """Two passes whose fp16 gradients are finite alone but overflow once added: the sum is
    checked, the step skipped, the scale backed off (the earlier gradients were set aside)."""
    amp._amp_state.reset()
    model = torch.nn.Linear(4, 1, bias=False)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.float16,
                                loss_scale="dynamic", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 1.0
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # two backward passes whose gradients are 40000 each (fp16 max: 65504)
        out = (model.weight.float() * 0).sum()
        with amp.scale_loss(out, opt) as s:
            s.backward()
            model.weight.grad = torch.full_like(model.weight, 40000.0)
    opt.step()
    assert torch.equal(model.weight.detach(), before[0])
    assert scaler.loss_scale() == 0.5


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_torch_fused_sgd_first_step_overflow_decided_on_the_host(level):
    """torch's fused SGD makes its momentum buffers (empty_like) in its first step: a skipped
    first step must not leave them uninitialised -- that step is decided on the host."""
    amp._amp_state.reset()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype=torch.float16,
                                verbosity=0)
    stash = opt._amp_stash
    if level == "O1":  # (O2: the masters get their gradients at scale_loss exit)
        x, y = batch(0)
        F.mse_loss(model(x).float(), y).backward()  # gradients, and no momentum buffer yet
        assert stash.device_skip and not stash.skips_on_device()
    for step in range(4):
        one_step(model, opt, step, poison=step == 0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert stash.skips_on_device()  # the buffers exist: later steps skip on the device
    assert all(torch.isfinite(st["momentum_buffer"]).all() for st in opt.state.values())


def test_already_patched_reads_the_device_flag_when_asked():
    model, opt = setup("FusedAdam", "O2", torch.float16, "dynamic")
    x, y = batch(0)
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as s:
        s.backward()
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    assert opt._amp_stash.already_patched  # (a host read, made because it is asked)
    opt.step()
    assert not opt._amp_stash.already_patched


def test_a_step_that_raises_keeps_its_scale_and_flag():
    """A failed step (here the optimizer raises once) leaves the pending gradients' scale and
    the overflow flag in place: the retried step is the step that would have run."""
    def run(fail):
        model, opt = setup("FusedAdam", "O2", torch.float16, "dynamic")
        x, y = batch(0)
        with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as s:
            s.backward()
        if fail:
            stash = opt._amp_stash
            real = stash.orig_step

            def raise_once(*args, **kwargs):
                stash.orig_step = real
                raise RuntimeError("transient")
            stash.orig_step = raise_once
            with pytest.raises(RuntimeError, match="transient"):
                opt.step()
        opt.step()
        return [p.detach().clone() for p in model.parameters()]
    assert_bitwise_equal(run(True), run(False))


def test_a_host_skip_clears_the_device_flag_too():
    """One optimizer in a device-path scale_loss (an overflow: its flag kept for step) and in a
    host-path one (with a plain optimizer beside it): the skipped step drops the device flag, so
    the next clean step runs."""
    amp._amp_state.reset()
    model_a, model_b = make_model(0), make_model(1)
    fused = FusedAdam(model_a.parameters(), lr=1e-2)
    plain = torch.optim.SGD(model_b.parameters(), lr=1e-2)
    [model_a, model_b], [fused, plain] = amp.initialize(
        [model_a, model_b], [fused, plain], opt_level="O1", low_precision_dtype=torch.float16,
        verbosity=0, num_losses=2)
    x, y = batch(0)
    with amp.scale_loss(F.mse_loss(model_a(x).float(), y), fused, loss_id=0) as s:
        s.backward()
        next(model_a.parameters()).grad.view(-1)[0] = float("inf")
    with amp.scale_loss(F.mse_loss((model_a(x) + model_b(x)).float(), y), [fused, plain],
                        loss_id=1) as s:
        s.backward()
        next(model_b.parameters()).grad.view(-1)[0] = float("inf")
    fused.step()
    plain.step()
    before = [p.detach().clone() for p in model_a.parameters()]
    fused.zero_grad()
    with amp.scale_loss(F.mse_loss(model_a(x).float(), y), fused, loss_id=0) as s:
        s.backward()
    fused.step()  # clean: it must step
    assert any(not torch.equal(a, b) for a, b in zip(before, model_a.parameters()))


def test_torch_fused_sgd_with_a_frozen_parameter_goes_back_to_the_device():
    """A frozen parameter never gets a momentum buffer: only parameters with a gradient count."""
    amp._amp_state.reset()
    model = make_model()
    model[2].bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O1", low_precision_dtype=torch.float16,
                                verbosity=0)
    one_step(model, opt, 0)
    x, y = batch(1)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as s:
        s.backward()
    assert opt._amp_stash.skips_on_device()
    opt.step()
