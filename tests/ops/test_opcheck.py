"""torch.library.opcheck for every peak op: schema, fake kernel, autograd registration and
torch.compile (AOT dispatch) all agree with the real kernel."""
import pytest
import torch

import peak  # noqa: F401  (registers the ops)

from peak_testing import opcheck_op, DEVICES


def lists(device, dtype_in=torch.float16, dtype_out=torch.float32):
    sizes = [3, 70, 129, 1]
    xs = [torch.randn(n, device=device).to(dtype_in) for n in sizes]
    outs = [torch.empty(n, device=device, dtype=dtype_out) for n in sizes]
    return xs, outs


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_multi_tensor_scale(device):
    xs, outs = lists(device)
    args = (xs, outs, torch.tensor([0.5], device=device), torch.zeros(1, device=device), 64)
    opcheck_op(torch.ops.peak.multi_tensor_scale_.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_multi_tensor_scale_in_place(device):
    xs, _ = lists(device)
    args = (xs, None, torch.tensor([0.5], device=device), torch.zeros(1, device=device), 64)
    opcheck_op(torch.ops.peak.multi_tensor_scale_.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_multi_tensor_scale_per_tensor_flags(device):
    xs, outs = lists(device)
    xs[2][5] = float("nan")
    args = (xs, outs, torch.tensor([0.5], device=device), torch.zeros(1, device=device), 64,
            torch.zeros(len(xs), device=device))
    opcheck_op(torch.ops.peak.multi_tensor_scale_.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_multi_tensor_axpby(device):
    xs, outs = lists(device)
    ys = [torch.randn_like(o) for o in outs]
    args = (xs, ys, outs, torch.tensor([0.5], device=device), torch.tensor([2.0], device=device),
            torch.zeros(1, device=device), 3, 64)
    opcheck_op(torch.ops.peak.multi_tensor_axpby_.default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_opcheck_multi_tensor_l2norm(device, per_tensor):
    xs, _ = lists(device, torch.bfloat16)
    opcheck_op(torch.ops.peak.multi_tensor_l2norm.default, (xs, per_tensor, 64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_hysteresis", [False, True])
def test_opcheck_update_scale(device, with_hysteresis):
    scale = torch.tensor([1024.0], device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hyst = torch.ones(1, dtype=torch.int32, device=device) * 2 if with_hysteresis else None
    args = (scale, growth, hyst, [torch.ones(1, device=device), torch.zeros(1, device=device)],
            2.0, 0.5, 10,
            2 if with_hysteresis else 1, 0.0, float("inf"))
    opcheck_op(torch.ops.peak.update_scale_.default, args)


def test_compiled_unscale_matches_eager():
    """The ops inside a torch.compile'd function (through the fake kernels) do the same work."""
    def unscale(grads, found_inf, inv_scale):
        torch.ops.peak.multi_tensor_scale_(grads, grads, scale=inv_scale, found_inf=found_inf,
                                           chunk_size=64)
        return torch.ops.peak.multi_tensor_l2norm(grads, per_tensor=False, chunk_size=64)[0]

    grads = [torch.randn(n) * 1024 for n in (5, 100, 300)]
    eager = [g.clone() for g in grads]
    compiled = torch.compile(unscale, backend="aot_eager", fullgraph=True)
    f1, f2 = torch.zeros(1), torch.zeros(1)
    inv = torch.tensor([1 / 1024])
    n1 = unscale(eager, f1, inv)
    n2 = compiled(grads, f2, inv)
    assert torch.equal(n1, n2) and torch.equal(f1, f2)
    for a, b in zip(eager, grads):
        assert torch.equal(a, b)


def test_fake_kernels_take_the_schema_defaults():
    """torch leaves out arguments equal to their schema default when it calls a Python fake
    kernel; each op must trace under FakeTensorMode when called with its defaults."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        grads = [torch.empty(5), torch.empty(7)]
        flag = torch.zeros(1)
        torch.ops.peak.multi_tensor_scale_(grads, grads, scale=torch.ones(1), found_inf=flag)
        torch.ops.peak.multi_tensor_axpby_(grads, grads, grads, a=torch.ones(1), b=torch.ones(1),
                                           found_inf=flag)
        torch.ops.peak.multi_tensor_check_finite_(grads, found_inf=flag)
        total, per = torch.ops.peak.multi_tensor_l2norm(grads)
        assert total.shape == (1,) and per.shape == (0,)


def test_grad_scaler_unscales_meta_gradients():
    """A dry run on the meta device (memory planning) goes through the scaler as with torch's."""
    from peak import amp

    p = torch.nn.Parameter(torch.empty(4, device="meta"))
    p.grad = torch.empty(4, device="meta")
    opt = torch.optim.SGD([p], lr=0.1)
    for scaler in (torch.amp.GradScaler("cpu"), amp.GradScaler("cpu")):
        scaled = scaler.scale(torch.ones((), device="meta"))
        scaler.unscale_(opt)
        assert scaled.device.type == "meta" and p.grad.device.type == "meta"
        assert p.grad.shape == (4,)


def test_opcheck_merge_found_infs():
    flags = [torch.tensor([1.0]), torch.tensor(0.0), torch.tensor([0.0])]
    opcheck_op(torch.ops.peak.merge_found_infs.default, (flags,),
               dict(device=torch.device("cpu"), shape=[1]))
    opcheck_op(torch.ops.peak.merge_found_infs.default, ([],),
               dict(device=torch.device("cpu"), shape=[]))
