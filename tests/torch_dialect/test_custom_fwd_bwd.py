"""peak.amp.custom_fwd / custom_bwd: torch's test_autocast_custom_enabled and
test_autocast_custom_cast_inputs on CPU (bf16), with nested container inputs, mixing with
torch.amp's decorators, and peak's list edits carried from forward to backward."""
import warnings

import pytest
import torch

from peak import amp
from peak.amp import _caster


class MyMM(torch.autograd.Function):
    @staticmethod
    @amp.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        assert a.dtype is b.dtype is torch.float32
        assert torch.is_autocast_enabled("cpu")
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        assert torch.is_autocast_enabled("cpu")
        a, b = ctx.saved_tensors
        a_grad, b_grad = grad.mm(b.t()), a.t().mm(grad)
        assert a_grad.dtype is b_grad.dtype is torch.bfloat16
        return a_grad, b_grad


def test_custom_enabled():
    """cast_inputs=None: forward and backward run under the caller's autocast state."""
    x = torch.randn(8, 8, requires_grad=True)
    y = torch.randn(8, 8, requires_grad=True)
    with amp.autocast("cpu"):
        out = MyMM.apply(x, y)
        assert out.dtype is torch.bfloat16
        out.float().sum().backward()
    assert x.grad.dtype is torch.float32 and y.grad.dtype is torch.float32


class CastInputs(torch.autograd.Function):
    """Nested containers: a list holding a string, a tuple, a dict (a tensor key too), a float64
    tensor and an integer tensor."""

    @staticmethod
    @amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, container):
        b = container[1][0]
        d = container[2]["d"]
        key = next(k for k in container[2] if isinstance(k, torch.Tensor))
        ctx.save_for_backward(a, b)
        ctx.seen = dict(a=a.dtype, b=b.dtype, d=d.dtype, key=key.dtype,
                        f64=container[3].dtype, i=container[4].dtype, s=container[0],
                        autocast=torch.is_autocast_enabled("cpu"))
        return a.mm(b)

    @staticmethod
    @amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        assert not torch.is_autocast_enabled("cpu")
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), None


def _container(low):
    return ["text", (torch.randn(8, 8, dtype=low, requires_grad=True),),
            {"d": torch.randn(2, dtype=low), torch.randn(1, dtype=low): 1},
            torch.randn(2, dtype=torch.float64), torch.arange(3)]


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_cast_inputs_nested_containers(low):
    a = torch.randn(8, 8, dtype=low, requires_grad=True)
    container = _container(low)
    with amp.autocast("cpu", dtype=low):
        out = CastInputs.apply(a, container)
        seen = out.grad_fn.seen  # the ctx of a custom Function is its grad_fn
    assert out.dtype is torch.float32
    assert seen["a"] == seen["b"] == seen["d"] == seen["key"] == torch.float32
    assert seen["f64"] == torch.float64 and seen["i"] == torch.int64 and seen["s"] == "text"
    assert seen["autocast"] is False  # forward ran with autocast off
    out.sum().backward()
    assert a.grad.dtype is low  # autograd brings the grad back to the input's dtype


def test_cast_inputs_is_a_no_op_outside_autocast():
    a = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)
    out = CastInputs.apply(a, _container(torch.bfloat16))
    assert out.dtype is torch.bfloat16
    assert out.grad_fn.seen["a"] == torch.bfloat16


def test_cast_inputs_turns_peak_list_edits_off_inside_forward():
    class Fwd(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx, x):
            return torch.exp(x)

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            return g

    x = torch.randn(4)
    with amp.autocast("cpu", lower_ops=["exp"]):
        assert torch.exp(x).dtype == torch.bfloat16
        assert Fwd.apply(x).dtype == torch.float32


def test_backward_sees_the_list_edits_forward_saw():
    class Edited(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu")
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.exp(x)

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            Edited.bwd_dtype = torch.exp(x).dtype  # under the forward's edits again
            return g * torch.exp(x).float()

    x = torch.randn(4, requires_grad=True)
    with amp.autocast("cpu", lower_ops=["exp"]):
        out = Edited.apply(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()  # backward outside the region
    assert Edited.bwd_dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_interoperates_with_torch_decorators():
    class Mixed(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(ctx, a):
            return a * 2

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            Mixed.enabled = torch.is_autocast_enabled("cpu")
            return g * 2

    a = torch.randn(3, requires_grad=True)
    with amp.autocast("cpu"):
        Mixed.apply(a).sum().backward()
    assert Mixed.enabled is True


def test_bad_arguments():
    with pytest.raises(ValueError, match="Expected `device_type` of type `str`"):
        amp.custom_fwd(device_type=torch.device("cpu"))
    with pytest.raises(TypeError, match="device_type"):
        amp.custom_fwd(lambda ctx: None)  # device_type is required, as in torch >= 2.4
    with pytest.raises(TypeError, match="cast_inputs must be a torch.dtype or None, or one of the strings"):
        amp.custom_fwd(device_type="cpu", cast_inputs="float8")
    amp.custom_fwd(device_type="cpu", cast_inputs=torch.int32)  # torch takes any dtype too
    torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.int32)
    with pytest.raises(ValueError, match="Expected `device_type` of type `str`"):
        amp.custom_bwd(device_type=None)

    class NoFwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 1

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            return g

    with pytest.raises(AttributeError, match="not decorated with custom_fwd"):  # as torch
        NoFwd.apply(torch.randn(2, requires_grad=True)).sum().backward()
    assert amp.is_autocast_available("cpu") and amp.is_autocast_available is torch.amp.is_autocast_available


def test_cast_inputs_takes_python_types_as_torch_does():
    """torch takes Python's float where it takes a dtype (Tensor.to(float) is float64)."""
    for mod in (torch.amp, amp):
        class Double(torch.autograd.Function):
            @staticmethod
            @mod.custom_fwd(device_type="cpu", cast_inputs=float)
            def forward(ctx, x):
                return x * 2

            @staticmethod
            @mod.custom_bwd(device_type="cpu")
            def backward(ctx, g):
                return g * 2

        with mod.autocast("cpu"):
            assert Double.apply(torch.ones(2, requires_grad=True)).dtype == torch.float64



def test_forward_without_ctx_casts_as_torchs_and_custom_bwd_says_why_it_cannot_follow():
    """A Function with setup_context: its forward takes no ctx. cast_inputs casts as torch's
    decorator does (which records its state on the first input, as torch's: Dynamo traces that);
    a custom_bwd backward names the missing ctx, not a missing decorator."""
    def make(mod, with_custom_bwd):
        class MatMul(torch.autograd.Function):
            @staticmethod
            @mod.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
            def forward(x, w):
                return x @ w

            @staticmethod
            def setup_context(ctx, inputs, output):
                ctx.save_for_backward(*inputs)

            def backward(ctx, g):
                x, w = ctx.saved_tensors
                return g @ w.t(), x.t() @ g
        if with_custom_bwd:
            MatMul.backward = staticmethod(mod.custom_bwd(device_type="cpu")(MatMul.backward))
        else:
            MatMul.backward = staticmethod(MatMul.backward)
        return MatMul

    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    results = {}
    for mod in (torch.amp, amp):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with mod.autocast("cpu", dtype=torch.bfloat16):
            y = make(mod, with_custom_bwd=False).apply(xs, ws)
        y.sum().backward()
        results[mod] = (y, xs.grad, ws.grad)
    assert results[amp][0].dtype == torch.float32
    for a, b in zip(results[torch.amp], results[amp]):
        assert torch.equal(a, b)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with amp.autocast("cpu", dtype=torch.bfloat16):
        y = make(amp, with_custom_bwd=True).apply(xs, ws)
    with pytest.raises(AttributeError, match="setup_context"):
        y.sum().backward()

def test_compiled_function_under_o1_does_not_trace_the_casters_state():
    """custom_fwd records O1's state for backward only outside Dynamo: Dynamo cannot trace the
    caster's snapshot, and warned of it in every compiled forward with O1 on."""
    class Decorated(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu")
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return torch.mm(x, w)

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return torch.mm(g, w.t()), torch.mm(x.t(), g)

    torch._dynamo.reset()
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    compiled = torch.compile(lambda a, b: Decorated.apply(a, b).sum())
    _caster.enable(torch.bfloat16)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = compiled(x, w)
        out.backward()
    finally:
        _caster.disable()
    assert not [w for w in caught if "snapshot" in str(w.message)]  # (O1's own wrappers break)
    expected = torch.ones(4, 8) @ w.detach().t()
    torch.testing.assert_close(x.grad, expected, rtol=2e-2, atol=2e-2)  # (bf16 products)


@pytest.mark.parametrize("cast_to", [torch.bfloat16, torch.float32])
def test_cast_inputs_compiles_in_one_graph_as_torchs(cast_to):
    """A custom_fwd(cast_inputs=...) Function in an autocast region compiles with
    fullgraph=True, as torch's does, and gives torch's values and gradients."""
    def function(mod):
        class Mm(torch.autograd.Function):
            @staticmethod
            @mod.custom_fwd(device_type="cpu", cast_inputs=cast_to)
            def forward(ctx, a, b):
                ctx.save_for_backward(a, b)
                return a.mm(b).relu()

            @staticmethod
            @mod.custom_bwd(device_type="cpu")
            def backward(ctx, g):
                a, b = ctx.saved_tensors
                g = g * (a.mm(b) > 0)
                return g.mm(b.t()), a.t().mm(g)
        return Mm

    results = []
    for mod in (torch.amp, amp):
        torch._dynamo.reset()
        Mm = function(mod)

        def run(a, b):
            with mod.autocast("cpu", dtype=torch.bfloat16):
                return Mm.apply(a.mm(b), b)

        a, b = (torch.randn(8, 8, generator=torch.Generator().manual_seed(s), requires_grad=True)
                for s in (1, 2))
        out = torch.compile(run, fullgraph=True)(a, b)
        out.float().sum().backward()
        results.append((out, a.grad, b.grad))
    for ours, torchs in zip(*results):
        assert ours.dtype == torchs.dtype
        torch.testing.assert_close(ours, torchs, rtol=0, atol=0)


def test_cast_inputs_under_o1_and_compile_runs_as_eager():
    """Under O1, a compiled custom_fwd(cast_inputs=torch.float32) forward still runs without
    O1's casts: its output equals the eager one's, float32."""
    class Mm(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return torch.mm(a, b)

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return torch.mm(g, b.t()), torch.mm(a.t(), g)

    torch._dynamo.reset()
    a = torch.randn(8, 8, dtype=torch.float64).float()
    b = torch.randn(8, 8, dtype=torch.float64).float()
    compiled = torch.compile(lambda x, y: Mm.apply(x, y))
    before = compiled(a, b)  # (compiled with O1 off: O1 turned on later is seen)
    _caster.enable(torch.bfloat16)
    try:
        eager = Mm.apply(a, b)
        compiled = compiled(a, b)
    finally:
        _caster.disable()
    assert eager.dtype == compiled.dtype == torch.float32
    torch.testing.assert_close(before, eager, rtol=0, atol=0)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, a.double().mm(b.double()).float(), rtol=1e-5, atol=1e-5)
