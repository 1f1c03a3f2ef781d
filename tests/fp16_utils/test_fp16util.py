"""peak.fp16_utils' manual helpers, as Apex's fp16util (tests/L0/run_fp16util) and its
master-weight recipe (prep_param_lists / model_grads_to_master_grads /
master_params_to_model_params), flat and not."""
import copy

import pytest
import torch
from torch import nn

from peak.fp16_utils import (BN_convert_float, FP16Model, clip_grad_norm, convert_network,
                             master_params_to_model_params, model_grads_to_master_grads,
                             network_to_half, prep_param_lists, to_python_float, tofp16)


class DummyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x)).relu()


class DummyNet(nn.Module):
    """Apex's test net: convolutions, affine and non-affine batch norm, nested blocks."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8, affine=False)
        self.block = DummyBlock()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.block(self.bn1(self.conv1(x)))
        return self.fc(x.mean(dim=(2, 3)))


def _affine_bn(m):
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine


def test_fp16model_keeps_affine_batch_norm_fp32_and_returns_fp16():
    model = FP16Model(DummyNet())
    for module in model.modules():
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if not t.is_floating_point():
                assert t.dtype == torch.int64  # num_batches_tracked stays an integer
            elif _affine_bn(module):
                assert t.dtype == torch.float32
            else:
                assert t.dtype == torch.float16, module
    out = model(torch.randn(2, 3, 6, 6))  # fp32 input: cast by the wrapper
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert model.network.block.bn.weight.grad.dtype == torch.float32


def test_network_to_half_and_bn_convert_float():
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False))
    half = network_to_half(net)
    assert isinstance(half[0], tofp16) and half[1] is net
    assert net[0].weight.dtype == torch.float16
    assert net[1].weight.dtype == torch.float32 and net[1].running_mean.dtype == torch.float32
    assert net[2].running_mean.dtype == torch.float16  # not affine: converted, as Apex
    assert half(torch.randn(3, 4)).dtype == torch.float16
    assert BN_convert_float(nn.BatchNorm1d(2).half()).weight.dtype == torch.float32


def test_convert_network_converts_gradients_and_checks_dtype():
    lin = nn.Linear(3, 3)
    lin.weight.grad = torch.ones(3, 3)
    convert_network(lin, torch.bfloat16)
    assert lin.weight.dtype == lin.weight.grad.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        convert_network(lin, torch.int32)


def _data(n=20):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("flat_master", [False, True], ids=["per_param", "flat"])
def test_master_weight_recipe_follows_fp32_sgd_on_the_same_gradients(flat_master):
    """Apex's manual recipe: fp16 model, fp32 masters stepped by an fp32 optimizer, weights
    copied down. The masters follow torch.optim.SGD on fp32 weights fed the same (fp16,
    scaled then unscaled) gradients; the model weights are the masters rounded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].bias.requires_grad_(False)  # frozen: left out of the lists, as Apex
    model.half()
    ref = [p.detach().float().requires_grad_() for p in model.parameters() if p.requires_grad]
    model_params, master_params = prep_param_lists(model, flat_master=flat_master)
    assert len(model_params) == 3
    assert all(m.dtype == torch.float32 and m.requires_grad for m in master_params)
    assert len(master_params) == (1 if flat_master else 3)
    opt = torch.optim.SGD(master_params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    scale = 128.0
    for x, y in _data():
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x.half()).float(), y)
        (loss * scale).backward()
        model_grads_to_master_grads(model_params, master_params, flat_master=flat_master)
        for m in master_params:
            m.grad.mul_(1.0 / scale)
        clip_grad_norm(master_params, 10.0)
        # the reference sees exactly the same gradients
        grads = [p.grad.float() / scale for p in model_params]
        for r, g in zip(ref, grads):
            r.grad = g
        torch.nn.utils.clip_grad_norm_(ref, 10.0)
        opt.step()
        ref_opt.step()
        master_params_to_model_params(model_params, master_params, flat_master=flat_master)
    masters = ([m.detach() for m in master_params] if not flat_master else
               [t for t in torch._utils._unflatten_dense_tensors(master_params[0].detach(),
                                                                 model_params)])
    for p, m, r in zip(model_params, masters, ref):
        torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), m.half())


def test_flat_and_per_param_masters_agree_bit_for_bit():
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3)).half()
    results = []
    for flat in (False, True):
        model = copy.deepcopy(base)
        model_params, master_params = prep_param_lists(model, flat_master=flat)
        opt = torch.optim.SGD(master_params, lr=0.05)
        for x, y in _data(5):
            model.zero_grad()
            nn.functional.mse_loss(model(x.half()).float(), y).backward()
            model_grads_to_master_grads(model_params, master_params, flat_master=flat)
            opt.step()
            master_params_to_model_params(model_params, master_params, flat_master=flat)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bad_inputs_say_what_to_do():
    mixed = nn.Sequential(nn.Linear(2, 2).half(), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="several dtypes .* flat_master=False"):
        prep_param_lists(mixed, flat_master=True)
    model = nn.Linear(2, 2).half()
    model_params, master_params = prep_param_lists(model, flat_master=True)
    with pytest.raises(RuntimeError, match=r"model_params\[0, 1\] have no gradient"):
        model_grads_to_master_grads(model_params, master_params, flat_master=True)
    model_params, master_params = prep_param_lists(model)
    with pytest.raises(ValueError, match="model_params has 2 tensors but master_params has 1"):
        master_params_to_model_params(model_params, master_params[:1])
    # a parameter without a gradient leaves its master's gradient None
    model.weight.grad = torch.ones(2, 2, dtype=torch.float16)
    model_grads_to_master_grads(model_params, master_params)
    assert master_params[0].grad.dtype == torch.float32 and master_params[1].grad is None
    assert to_python_float(torch.tensor([2.5])) == 2.5
    assert clip_grad_norm is torch.nn.utils.clip_grad_norm_
