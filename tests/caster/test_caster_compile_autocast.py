"""O1 next to torch.compile and explicit autocast regions (issue 14, items 3 and 4)."""
import functools
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from peak import amp
from peak.amp import _caster

TOL = {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8),
                         nn.Softmax(-1))


@pytest.mark.parametrize("fn", [torch.mm, torch.addmm, F.linear, torch.Tensor.add, torch.matmul,
                                F.softmax])
def test_patch_wrappers_carry_the_wrapped_functions_metadata(low, fn):
    expected = {k: getattr(fn, k, None) for k in functools.WRAPPER_ASSIGNMENTS}
    _caster.enable(low)
    owner, name = _caster.index()[id(fn)][0]
    wrapper = getattr(owner, name)
    wrapper = getattr(wrapper, "__func__", wrapper)
    assert wrapper is not fn
    for key, value in expected.items():
        assert getattr(wrapper, key, None) == value, key
    assert wrapper.__wrapped__ is fn
    assert _caster.unwrap(wrapper) is fn
    pickled = pickle.dumps(wrapper)  # a reference to the function it wraps
    _caster.disable()
    assert getattr(owner, name) is fn or getattr(getattr(owner, name), "__func__", None) is fn
    assert pickle.loads(pickled) is fn


def test_inductor_registers_its_extern_kernels_under_o1(low):
    """inductor (imported lazily, at the first compile) registers torch.mm & co. by __name__:
    every wrapper named alike was 'duplicate extern kernel: peak_o1_cast'."""
    _caster.enable(low)
    names = {torch.mm.__name__, torch.addmm.__name__, torch.bmm.__name__}
    assert names == {"mm", "addmm", "bmm"}


@pytest.mark.parametrize("low_dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_torch_compile_after_o1_initialize_matches_eager_o1(low_dtype):
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = _block()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", low_precision_dtype=low_dtype,
                                verbosity=0)
    x = torch.randn(4, 16)
    eager = model(x)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    out = compiled(x)
    assert out.dtype == eager.dtype == torch.float32  # softmax is fp32 under O1
    torch.testing.assert_close(out, eager, **TOL[low_dtype])
    # Each listed op is a graph break (dynamo cannot trace into the C++ wrapper; docs/caster.md).
    breaks = sum(counters["graph_break"].values())
    assert 1 <= breaks <= 16
    # and training through the compiled model works
    loss = out.sum()
    with amp.scale_loss(loss, opt) as s:
        s.backward()
    opt.step()
    assert torch.isfinite(model[0].weight).all()
    torch._dynamo.reset()


@pytest.mark.parametrize("region", ["torch", "peak"])
def test_explicit_autocast_region_inside_o1_uses_its_own_dtype(region):
    _caster.enable(torch.float16)
    lin = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    assert lin(x).dtype == torch.float16  # O1 outside the region
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if region == "torch"
           else amp.autocast("cpu", dtype=torch.bfloat16))

    def ops():
        inside = lin(x)
        return inside, torch.softmax(inside, -1), torch.mm(x, lin.weight.t()), torch.exp(x)

    with ctx:
        got = ops()
    _caster.disable()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own rules, without O1
        reference = ops()
    _caster.enable(torch.float16)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    for a, b in zip(got, reference):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert lin(x).dtype == torch.float16  # O1 again after the region


def test_explicit_autocast_region_inside_amp_o1_model(low):
    model = nn.Linear(8, 4)
    other = nn.Linear(8, 4)
    model = amp.initialize(model, opt_level="O1", low_precision_dtype=torch.float16, verbosity=0)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert other(x).dtype == torch.bfloat16
    assert model(x).dtype == torch.float16
    assert other(x).dtype == torch.float16


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fn = torch.mm  # built while O1 is on: the wrapper
        self.act = F.softmax  # a Python function's wrapper

    def forward(self, a, b):
        return self.act(self.fn(a, b), -1)


def test_model_saved_under_o1_holding_a_wrapper_pickles():
    _caster.enable(torch.bfloat16)
    assert Holder().fn is not torch.mm.__wrapped__
    buf = io.BytesIO()
    torch.save(Holder(), buf)
    _caster.disable()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.fn is torch.mm and loaded.act is F.softmax


def test_autocast_list_edits_inside_o1():
    """peak.amp.autocast(fp32_ops=[F.softmax]) after O1 patched F.softmax: the edit names the
    function (not the wrapper, whose __name__ once read 'peak_o1_cast' for every listed op)."""
    _caster.enable(torch.bfloat16)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp32_ops=[F.softmax]):
        assert F.softmax(lin(x), -1).dtype == torch.float32
        assert lin(x).dtype == torch.bfloat16
        assert F.gelu(lin(x)).dtype == torch.bfloat16  # not edited: torch's rule
