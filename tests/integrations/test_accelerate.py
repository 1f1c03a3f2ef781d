"""peak.integrations.accelerate with the real Accelerate package.

References: the same training written by hand with peak's API (Apex dialect) or with torch's own
autocast and GradScaler (torch dialect), compared bit for bit; save_state/load_state: a resumed
run ends bit for bit where an uninterrupted one ends.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

accelerate = pytest.importorskip("accelerate")  # installed by the Makefile

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402

from peak import amp  # noqa: E402
from peak.amp._amp_state import _amp_state  # noqa: E402
from peak.integrations import accelerate as peak_accelerate  # noqa: E402

STEPS = 6


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Accelerate keeps its state in process-wide singletons; each test builds its own."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def make_model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    model.hidden_dtypes = []
    model[0].register_forward_hook(lambda mod, inp, out: model.hidden_dtypes.append(out.dtype))
    return model


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches(start=0, stop=STEPS):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16 * STEPS, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return [(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)]) for i in range(start, stop)]


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def apex_steps(accelerator, model, optimizer, data):
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        peak_accelerate.backward(accelerator, loss, optimizer)
        optimizer.step()
        losses.append(loss.item())
    return losses


def apex_by_hand(opt_level, dtype, data):
    model = make_model()
    optimizer = make_optimizer(model)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, low_precision_dtype=dtype, verbosity=0)
    for x, y in data:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("order", ["initialize_then_prepare", "prepare_then_initialize", "prepare_helper"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_apex_dialect_around_prepare_matches_peak_by_hand(opt_level, dtype, order):
    accelerator = Accelerator(cpu=True)
    model = make_model()
    optimizer = make_optimizer(model)
    kwargs = dict(opt_level=opt_level, low_precision_dtype=dtype, verbosity=0)
    if order == "initialize_then_prepare":
        model, optimizer = peak_accelerate.initialize(accelerator, model, optimizer, **kwargs)
        model, optimizer = accelerator.prepare(model, optimizer)
    elif order == "prepare_then_initialize":
        model, optimizer = accelerator.prepare(model, optimizer)
        model, optimizer = peak_accelerate.initialize(accelerator, model, optimizer, **kwargs)
    else:
        model, optimizer = peak_accelerate.prepare(accelerator, model, optimizer, **kwargs)
    assert isinstance(optimizer, AcceleratedOptimizer)
    losses = apex_steps(accelerator, model, optimizer, batches())
    assert sum(losses[-2:]) < sum(losses[:2])
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert set(model.hidden_dtypes) == {torch.float32 if opt_level == "O0" else low}
    got, got_amp = weights(model), amp.state_dict()
    got_masters = [p.detach().clone() for p in amp.master_params(optimizer.optimizer)]

    _amp_state.reset()
    ref_model, ref_optimizer = apex_by_hand(opt_level, dtype, batches())
    assert_bitwise(got, weights(ref_model))
    assert got_amp == amp.state_dict()
    for a, b in zip(got_masters, amp.master_params(ref_optimizer)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("opt_level, dtype", [("O1", "fp16"), ("O2", "fp16"), ("O2", "bf16"), ("O3", "bf16")])
def test_apex_dialect_save_state_load_state_bitwise(opt_level, dtype, tmp_path):
    kwargs = dict(opt_level=opt_level, low_precision_dtype=dtype, verbosity=0)
    accelerator = Accelerator(cpu=True)
    model = make_model()
    model, optimizer = peak_accelerate.prepare(accelerator, model, make_optimizer(model), **kwargs)
    apex_steps(accelerator, model, optimizer, batches(0, 3))
    accelerator.save_state(tmp_path / "state")
    saved_amp = amp.state_dict()
    apex_steps(accelerator, model, optimizer, batches(3, STEPS))
    full, full_amp = weights(model), amp.state_dict()
    full_masters = [p.detach().clone() for p in amp.master_params(optimizer.optimizer)]

    # a new process would start like this: new objects, initialize, prepare, load_state
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = make_model(seed=99)
    model, optimizer = peak_accelerate.prepare(accelerator, model, make_optimizer(model), **kwargs)
    accelerator.load_state(tmp_path / "state")
    assert amp.state_dict() == saved_amp
    apex_steps(accelerator, model, optimizer, batches(3, STEPS))
    assert_bitwise(full, weights(model))
    assert amp.state_dict() == full_amp
    for a, b in zip(full_masters, amp.master_params(optimizer.optimizer)):
        assert torch.equal(a, b)


def test_apex_dialect_refuses_accelerates_own_mixed_precision():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = make_model()
    with pytest.raises(ValueError, match="mixed_precision='bf16'.*Accelerator\\(mixed_precision='no'\\)"):
        peak_accelerate.initialize(accelerator, model, make_optimizer(model), opt_level="O2")
    assert model[0].weight.dtype == torch.float32 and "forward" not in model.__dict__
    with pytest.raises(ValueError, match="no torch.nn.Module"):
        peak_accelerate.prepare(Accelerator(cpu=True), make_optimizer(model), opt_level="O2")


# ---------------------------------------------------------------------------------------------- torch dialect
def torch_steps(accelerator, model, optimizer, data, **autocast_edits):
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        if autocast_edits:
            with peak_accelerate.autocast(accelerator, **autocast_edits):
                out = model(x)
        else:
            out = model(x)
        loss = F.cross_entropy(out, y)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def torch_by_hand(dtype, data):
    """torch's own autocast and GradScaler, as Accelerate would run them: autocast around the
    forward, outputs to fp32, loss outside."""
    model = make_model()
    optimizer = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    for x, y in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return model, scaler


@pytest.mark.parametrize("mixed_precision", ["fp16", "bf16"])
def test_torch_dialect_matches_torch_by_hand(mixed_precision):
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    scaler = peak_accelerate.use_grad_scaler(accelerator)
    assert (scaler is not None) == (mixed_precision == "fp16")
    assert accelerator.scaler is scaler
    model = make_model()
    model, optimizer = accelerator.prepare(model, make_optimizer(model))
    losses = torch_steps(accelerator, model, optimizer, batches())
    assert sum(losses[-2:]) < sum(losses[:2])
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]
    assert set(model.hidden_dtypes) == {dtype}
    ref_model, ref_scaler = torch_by_hand(dtype, batches())
    assert_bitwise(weights(model), weights(ref_model))
    if scaler is not None:
        assert isinstance(optimizer.scaler, amp.GradScaler)
        assert scaler.get_scale() == ref_scaler.get_scale()


def test_torch_dialect_list_edits():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = make_model()
    model, optimizer = accelerator.prepare(model, make_optimizer(model))
    torch_steps(accelerator, model, optimizer, batches(0, 1), fp32_ops=[torch.nn.functional.linear])
    assert model.hidden_dtypes == [torch.float32]
    torch_steps(accelerator, model, optimizer, batches(0, 1))
    assert model.hidden_dtypes == [torch.float32, torch.bfloat16]


def test_torch_dialect_save_state_load_state_bitwise(tmp_path):
    def setup(seed):
        accelerator = Accelerator(cpu=True, mixed_precision="fp16",
                                  kwargs_handlers=[GradScalerKwargs(init_scale=2.0**10, growth_interval=2)])
        scaler = peak_accelerate.use_grad_scaler(accelerator)
        model = make_model(seed)
        model, optimizer = accelerator.prepare(model, make_optimizer(model))
        return accelerator, scaler, model, optimizer

    accelerator, scaler, model, optimizer = setup(0)
    assert scaler.get_growth_interval() == 2  # GradScalerKwargs carried over
    torch_steps(accelerator, model, optimizer, batches(0, 3))
    accelerator.save_state(tmp_path / "state")
    saved_scale = scaler.state_dict()
    torch_steps(accelerator, model, optimizer, batches(3, STEPS))
    full, full_scaler = weights(model), scaler.state_dict()
    assert full_scaler["scale"] != 2.0**10  # the scale moved: the resume has something to restore

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, scaler, model, optimizer = setup(42)
    accelerator.load_state(tmp_path / "state")
    assert scaler.state_dict() == saved_scale
    torch_steps(accelerator, model, optimizer, batches(3, STEPS))
    assert_bitwise(full, weights(model))
    assert scaler.state_dict() == full_scaler


def test_torch_dialect_bad_uses():
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="mixed_precision=...\\), which is 'no' here"):
        peak_accelerate.use_grad_scaler(accelerator)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = make_model()
    accelerator.prepare(model, make_optimizer(model))
    with pytest.raises(RuntimeError, match="call it before accelerator.prepare"):
        peak_accelerate.use_grad_scaler(accelerator)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    with pytest.raises(TypeError, match="scaler must be a peak.amp.GradScaler"):
        peak_accelerate.use_grad_scaler(accelerator, torch.amp.GradScaler("cpu"))
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match="bf16 needs no loss scaling"):
        peak_accelerate.use_grad_scaler(accelerator, amp.GradScaler("cpu"))


@pytest.mark.parametrize("opt_level, dtype", [("O1", "fp16"), ("O2", "fp16"), ("O2", "bf16")])
@pytest.mark.parametrize("prepared_first", [False, True],
                         ids=["peak_accelerate.prepare", "amp.initialize(prepared optimizer)"])
def test_apex_dialect_gradient_accumulation_as_by_hand(opt_level, dtype, prepared_first):
    """Accelerator(gradient_accumulation_steps=2) + accelerator.accumulate: the loss is halved,
    zero_grad and step act every second batch; the same by hand with peak's API. Also with the
    AcceleratedOptimizer given to amp.initialize (its step calls the inner one every second
    call: amp's step around it keeps the first micro-batch's master gradients)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_model()
    if prepared_first:
        model, optimizer = amp.initialize(*accelerator.prepare(model, make_optimizer(model)),
                                          opt_level=opt_level, low_precision_dtype=dtype, verbosity=0)
        assert isinstance(optimizer, AcceleratedOptimizer)
    else:
        model, optimizer = peak_accelerate.prepare(accelerator, model, make_optimizer(model),
                                                   opt_level=opt_level, low_precision_dtype=dtype,
                                                   verbosity=0)
    for x, y in batches():
        with accelerator.accumulate(model):   # Accelerate's pattern: zero_grad after step
            peak_accelerate.backward(accelerator, F.cross_entropy(model(x), y), optimizer)
            optimizer.step()
            optimizer.zero_grad()
    got, got_amp = weights(model), amp.state_dict()

    _amp_state.reset()
    ref = make_model()
    ref_optimizer = make_optimizer(ref)
    ref, ref_optimizer = amp.initialize(ref, ref_optimizer, opt_level=opt_level, low_precision_dtype=dtype,
                                        verbosity=0)
    for i, (x, y) in enumerate(batches()):
        if i % 2 == 0:
            ref_optimizer.zero_grad()
        with amp.scale_loss(F.cross_entropy(ref(x), y) / 2, ref_optimizer) as scaled_loss:
            scaled_loss.backward()
        if i % 2 == 1:
            ref_optimizer.step()
    assert_bitwise(got, weights(ref))
    assert got_amp == amp.state_dict()
