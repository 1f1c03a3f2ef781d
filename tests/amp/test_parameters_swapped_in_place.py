"""``module.to()`` swaps parameters in place (``torch.utils.swap_tensors``) for tensor subclasses
(FSDP2's DTensors: tests/distributed/test_sharded_fused.py) and for every parameter under
``torch.__future__.set_swap_module_params_on_conversion(True)``; swap_tensors refuses a tensor
with a Python weak reference. Every path of peak that keeps bookkeeping by parameter (a fused
optimizer's watch over its weights, amp O2's stores and leftover gradients, FP16_Optimizer,
GradScaler's overflow names, the loads) holds no weak reference to a parameter or a gradient
(NOTE: [No weak references to parameters]), and training after the move gives the bits of
training without it."""
import copy
import weakref

import pytest
import torch

from peak import amp
from peak.amp import GradScaler, _caster
from peak.amp._amp_state import _amp_state
from peak.fp16_utils import FP16_Optimizer
from peak.optimizers import FusedAdam
from peak_testing import assert_bitwise_equal, snapshot

X = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _fused(dtype, **options):
    def build():
        model = _model().to(dtype)
        opt = FusedAdam(model.parameters(), lr=1e-2, **options)

        def step():
            opt.zero_grad()
            model(X.to(dtype)).float().square().sum().backward()
            opt.step()
        return model, opt, step
    return build


def _scaler():
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    scaler = GradScaler("cpu").register_model(model)

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(X).float().square().sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return model, opt, step


def _amp(opt_level, fused):
    def build():
        model = _model()
        opt = (FusedAdam if fused else torch.optim.Adam)(model.parameters(), lr=1e-2)
        options = {} if opt_level == "O1" else {"cast_model_type": torch.bfloat16}
        model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **options)

        def step():
            opt.zero_grad()
            with amp.scale_loss(model(X).float().square().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
        return model, opt, step
    return build


def _fp16_optimizer():
    model = _model().half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                         verbose=False)

    def step():
        opt.zero_grad()
        opt.backward(model(X.half()).float().square().sum())
        opt.step()
    return model, opt, step


PATHS = {
    "fused fp32": _fused(torch.float32),
    "fused bf16 fp32 masters": _fused(torch.bfloat16, master_weights=True),
    "fused bf16 remainders": _fused(torch.bfloat16, master_weights=True,
                                    store_param_remainders=True),
    "GradScaler + fused, named params": _scaler,
    "FP16_Optimizer": _fp16_optimizer,
    **{f"amp {level} {kind}": _amp(level, kind == "FusedAdam")
       for level in ("O1", "O2", "O3") for kind in ("Adam", "FusedAdam")},
}


@pytest.fixture
def swap_on_conversion():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def _weakly_referenced(model):
    return [name + what for name, p in model.named_parameters()
            for t, what in ((p, ""), (p.grad, ".grad")) if t is not None and weakref.getweakrefs(t)]


def _run(build, move):
    model, opt, step = build()
    step()
    step()
    assert not _weakly_referenced(model)
    # a checkpoint round trip (the loads' bookkeeping, amp's model hooks) before the move
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    assert not _weakly_referenced(model)
    if move:
        model.to("cpu")  # swapped in place under the fixture
    step()
    step()
    return snapshot(model, getattr(opt, "optimizer", opt))


@pytest.mark.filterwarnings("ignore:FP16_Optimizer is deprecated")
@pytest.mark.parametrize("path", list(PATHS))
def test_a_model_moved_between_steps_trains_as_one_left_in_place(path, swap_on_conversion):
    expected = _run(PATHS[path], move=False)
    _caster.disable()  # (amp's state is process-global: the second run starts afresh)
    _amp_state.reset()
    assert_bitwise_equal(_run(PATHS[path], move=True), expected, path)


@pytest.mark.parametrize("opt_class", [torch.optim.Adam, FusedAdam], ids=["Adam", "FusedAdam"])
def test_a_steps_gradients_go_after_a_conversion_that_gives_them_new_memory(opt_class):
    """amp O2 drops the gradients a step left before the next backward (NOTE: [Gradients a step
    left]), so a loop without zero_grad trains as one with it, also when the model is converted
    between steps by ``p.grad.data = converted`` (``module.to()``'s default path): the same
    gradient object in new memory, still the step's."""
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def run(zero_grad):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(),
                                    torch.nn.Linear(64, 2))
        opt = opt_class(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                                    verbosity=0)
        for i in range(3):
            if zero_grad:
                opt.zero_grad()
            with amp.scale_loss(model(x).float().square().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
            if i == 0:
                model.to(memory_format=torch.channels_last)
        _caster.disable()
        _amp_state.reset()
        return [p.detach().clone() for p in model.parameters()]

    assert_bitwise_equal(run(zero_grad=False), run(zero_grad=True))
