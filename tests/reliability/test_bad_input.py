"""Every row of docs/bad_input.md is a test: the misuse is performed and must raise exactly the
documented exception type (or warning) with the documented text in its message."""

from __future__ import annotations

import re
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from peak import amp, ops
from peak.optimizers import FusedAdam

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad_input.md"
ROW = re.compile(r"^\| `([a-z0-9-]+)` \| .+ \| `(\w+)`: (.+?) \|$")


def rows():
    found = [m.groups() for line in DOC.read_text().splitlines() if (m := ROW.match(line))]
    assert len(found) == sum(1 for line in DOC.read_text().splitlines() if line.startswith("| `"))
    return found


def _model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _loss(model):
    return model(torch.randn(3, 4)).float().pow(2).mean()


def _scaler_iteration():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu")
    scaler.scale(_loss(model)).backward()
    return model, opt, scaler


class _OneRankGroup:
    """A world of one gloo process on 127.0.0.1 (DDP and ZeRO need a process group)."""

    def __enter__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    def __exit__(self, *exc):
        dist.destroy_process_group()


def scale_loss_before_initialize():
    model = _model()
    with amp.scale_loss(_loss(model), torch.optim.SGD(model.parameters(), lr=0.1)):
        pass


def optimizer_not_passed_to_initialize():
    model = _model()
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt_a = amp.initialize(model, opt_a, opt_level="O1", verbosity=0)
    with amp.scale_loss(_loss(model), opt_b) as s:
        s.backward()


def tuple_of_optimizers_to_initialize():
    model = _model()
    amp.initialize(model, (torch.optim.SGD(model.parameters(), lr=0.1),
                           torch.optim.Adam(model.parameters())), verbosity=0)


def tuple_of_models_to_initialize():
    a, b = _model(), _model()
    amp.initialize((a, b), torch.optim.SGD(a.parameters(), lr=0.1), verbosity=0)


def half_model_to_initialize():
    model = _model().half()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)


def ddp_before_initialize():
    with _OneRankGroup():
        model = _model()
        amp.initialize(nn.parallel.DistributedDataParallel(model), torch.optim.SGD(model.parameters(), lr=0.1),
                       opt_level="O2", verbosity=0)


def dataparallel_before_initialize():
    model = _model()
    amp.initialize(nn.DataParallel(model), torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O3",
                   verbosity=0)


def zero_with_master_weights():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    with _OneRankGroup():
        model = _model()
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        amp.initialize(model, opt, opt_level="O2", verbosity=0)


def model_initialized_twice():
    model = _model()
    amp.initialize(model, opt_level="O2", verbosity=0)
    amp.initialize(model, opt_level="O2", verbosity=0)


def optimizer_over_other_params():
    model, other = _model(), _model()
    amp.initialize(model, torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1),
                   verbosity=0)


def o1_with_bf16_model_cast():
    amp.initialize(_model(), opt_level="O1", cast_model_type=torch.bfloat16, verbosity=0)


def stale_optimizer_after_reinitialize():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    new = _model()
    amp.initialize(new, torch.optim.SGD(new.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    with amp.scale_loss(_loss(model), opt) as s:
        s.backward()


def non_scalar_loss():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    with amp.scale_loss(model(torch.randn(3, 4)).float().sum(1), opt) as s:
        s.backward()


def loss_id_out_of_range():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    with amp.scale_loss(_loss(model), opt, loss_id=1) as s:
        s.backward()


def lbfgs_with_master_weights():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.LBFGS(model.parameters()), opt_level="O2", verbosity=0)
    opt.step(lambda: _loss(model))


def lbfgs_with_a_dynamic_scale():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.LBFGS(model.parameters()), opt_level="O1",
                                low_precision_dtype=torch.float16, verbosity=0)
    opt.step(lambda: _loss(model))


def optimizer_without_optimizer_init():
    class Broken(torch.optim.Optimizer):
        def __init__(self, params):  # noqa: D107 (skips Optimizer.__init__, wraps nothing)
            self.param_groups = [{"params": list(params)}]

    model = _model()
    amp.initialize(model, Broken(model.parameters()), opt_level="O2", verbosity=0)


def master_params_between_micro_batches():
    from peak.optimizers import FusedAdam

    model = _model()
    model, opt = amp.initialize(model, FusedAdam(model.parameters()), opt_level="O2", verbosity=0)
    with amp.scale_loss(_loss(model), opt) as s:
        s.backward()
    list(amp.master_params(opt))
    with amp.scale_loss(_loss(model), opt) as s:
        s.backward()


def step_after_delayed_exit():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                opt_level="O1", verbosity=0)
    with amp.scale_loss(_loss(model), opt, delay_unscale=True) as s:
        s.backward()
    opt.step()


def enabled_not_a_boolean():
    model = _model()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), enabled="no", verbosity=0)


def damaged_grad_scaler_state():
    scaler = amp.GradScaler("cpu")
    scaler.load_state_dict({**scaler.state_dict(), "min_scale": 1e9})


def state_dict_before_initialize():
    amp.state_dict()


def scaler_double_unscale():
    _, opt, scaler = _scaler_iteration()
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def scaler_unscale_after_step():
    _, opt, scaler = _scaler_iteration()
    scaler.step(opt)
    scaler.unscale_(opt)


def scaler_step_twice():
    _, opt, scaler = _scaler_iteration()
    scaler.step(opt)
    scaler.step(opt)


def scaler_closure():
    model, opt, scaler = _scaler_iteration()
    scaler.step(opt, closure=lambda: _loss(model))


def scaler_given_model():
    model, _, scaler = _scaler_iteration()
    scaler.step(model)


def scaler_update_without_step():
    _scaler_iteration()[2].update()


def scaler_setter_out_of_range():
    scaler = amp.GradScaler("cpu")
    for setter, value in (("set_growth_factor", 0.5), ("set_backoff_factor", 2.0)):
        with pytest.raises(AssertionError, match="factor must be"):
            getattr(scaler, setter)(value)
    with pytest.raises(ValueError, match=r"growth_interval must be in \[1, 2\*\*31 - 1\]"):
        amp.GradScaler("cpu", growth_interval=2**32 + 1)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (2.0, 0.5)
    scaler.set_growth_interval(0)


def scaler_bad_policy():
    amp.GradScaler("cpu", on_min_scale="ignore")


def scaler_cuda_on_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the scaler is not disabled")
    amp.GradScaler()


def fused_grad_dtype_mismatch():
    p = nn.Parameter(torch.randn(4).half())
    opt = FusedAdam([p])
    p.grad_dtype = None  # torch would refuse the assignment below itself
    p.grad = torch.randn(4)
    opt.step()


def op_partial_overlap():
    # (A slice such as t[:, :5] is no misuse since issue 15: the op stages it through a copy.)
    t = torch.randn(10)
    ops.multi_tensor_scale_([t[1:]], [t[:-1]], 2.0, ops.new_found_inf())


def op_mixed_dtypes():
    ops.multi_tensor_scale_([torch.ones(3), torch.ones(3).half()], [torch.ones(3)] * 2, 2.0, ops.new_found_inf())


def _stepped_adam(**kw):
    from peak.optimizers import FusedAdam  # noqa: PLC0415
    w = torch.nn.Parameter(torch.randn(300).bfloat16())
    opt = FusedAdam([w], lr=1e-2, **kw)
    w.grad = torch.randn(300).bfloat16()
    opt.step()
    return opt, opt.state_dict()


def checkpoint_missing_moment():
    opt, sd = _stepped_adam()
    del sd["state"][0]["exp_avg"]
    opt.load_state_dict(sd)


def checkpoint_8bit_without_scale():
    opt, sd = _stepped_adam(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    del sd["state"][0]["exp_avg_sq_scale"]
    opt.load_state_dict(sd)


def checkpoint_8bit_cast_by_a_loader():
    import tempfile

    import torch.distributed.checkpoint as dcp

    _, saved = _stepped_adam(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    opt, template = _stepped_adam()  # fp32 moments: the loading side's own storage
    with tempfile.TemporaryDirectory() as d:
        dcp.save({"optim": saved}, checkpoint_id=d, no_dist=True)
        dcp.load({"optim": template}, checkpoint_id=d, no_dist=True)
    opt.load_state_dict(template)


def fused_complex_or_fp64_param():
    p = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.randn_like(p)
    opt.step()


def amp_complex_grad():
    model = _model()
    model.register_parameter("c", nn.Parameter(torch.randn(2, dtype=torch.complex64)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.bfloat16,
                                verbosity=0)
    with amp.scale_loss((_loss(model) * model.c.abs().sum()), opt) as scaled:
        scaled.backward()

def amp_load_over_static_scale():
    amp.initialize(_model(), opt_level="O1", loss_scale=128.0, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}})


def amp_load_other_num_losses():
    amp.initialize(_model(), opt_level="O1", num_losses=2, verbosity=1)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}})


def amp_o2_over_fully_shard():
    from torch.distributed.fsdp import fully_shard

    with _OneRankGroup():
        model = _model()
        fully_shard(model)
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                       verbosity=0)


def fully_shard_after_amp_o2():
    from torch.distributed.fsdp import fully_shard

    with _OneRankGroup():
        model = _model()
        model, opt = amp.initialize(model, FusedAdam(model.parameters()), opt_level="O2",
                                    low_precision_dtype=torch.bfloat16, verbosity=0)
        fully_shard(model)
        with amp.scale_loss(_loss(model), opt) as scaled:
            scaled.backward()


MISUSES = {name.replace("_", "-"): fn for name, fn in list(globals().items())
           if callable(fn) and not name.startswith("_") and fn.__module__ == __name__
           and name not in ("rows",)}


def test_every_misuse_has_a_row_and_every_row_a_misuse():
    assert sorted(MISUSES) == sorted(r[0] for r in rows())


@pytest.mark.parametrize("row_id, exc_name, text", rows(), ids=[r[0] for r in rows()])
def test_row(row_id, exc_name, text):
    misuse = MISUSES[row_id]
    kind = getattr(__builtins__, exc_name, None) if not isinstance(__builtins__, dict) else __builtins__.get(exc_name)
    assert isinstance(kind, type) and issubclass(kind, BaseException), exc_name
    norm = lambda s: " ".join(s.split())
    if issubclass(kind, Warning):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            misuse()
        assert any(type(w.message) is kind and norm(text) in norm(str(w.message)) for w in rec), \
            [str(w.message) for w in rec]
        return
    with pytest.raises(BaseException) as info:
        misuse()
    assert type(info.value) is kind or (kind is AssertionError and isinstance(info.value, kind)), \
        f"{row_id}: got {type(info.value).__name__}: {info.value}"
    assert norm(text) in norm(str(info.value)), f"{row_id}: {info.value}"
