"""The O1 caster in training: weight-cast cache, autograd, user functions, list edits, amp."""
import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from peak import amp
from peak.amp import _caster, lists

TOL = {torch.float16: 2e-2, torch.bfloat16: 8e-2}


def _stats():
    return _caster.cache_stats()


# ---- weight-cast cache

def test_cache_hit_counted_once_per_iteration(o1):
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    _caster.clear_cache()
    s0 = _stats()
    y = F.linear(x, w) + F.linear(x, w) + torch.mm(x, w)
    s1 = _stats()
    assert s1["stores"] - s0["stores"] == 1 and s1["hits"] - s0["hits"] == 2 and s1["size"] == 1
    y.float().sum().backward()
    # the gradient of three uses flows back to the fp32 weight in fp32
    with _caster.disabled():
        x16 = x.to(o1).float()
        g = torch.ones(2, 4)
        expected = 2 * (g.t() @ x16) + x16.t() @ g
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, expected, rtol=TOL[o1], atol=TOL[o1])
    _caster.clear_cache()
    assert _stats()["size"] == 0


def test_cache_invalidated_by_inplace_update(o1):
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    y1 = F.linear(x, w)
    with torch.no_grad():
        w.add_(1.0)  # bumps the version counter
    s0 = _stats()
    y2 = F.linear(x, w)
    assert _stats()["hits"] == s0["hits"]  # stale entry not used
    with _caster.disabled():
        ref = F.linear(x.to(o1), w.detach().to(o1))
    assert torch.equal(y2, ref) and not torch.equal(y1, y2)


def test_cache_sees_updates_through_data(o1):
    """NOTE: [Weight-cast cache lifetime]: updates through ``.data`` (a view with a version
    counter of its own) and ``w.data = other`` are seen; the manual-SGD loop without scale_loss
    trains."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    losses = []
    for _ in range(30):
        loss = F.mse_loss(model(x).float(), y)
        losses.append(loss.item())
        model.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        with _caster.disabled():
            fresh = F.linear(x.to(o1), model.weight.detach().to(o1), model.bias.detach().to(o1))
        assert torch.equal(model(x), fresh)  # the next forward casts the updated weight
    assert losses[-1] < 0.9 * losses[0]  # (stale casts: the loss would not move at all)
    w = model.weight
    F.linear(x, w)
    w.data = torch.zeros_like(w)  # a new storage
    assert model(x).abs().max() == model.bias.detach().to(o1).abs().max()


def test_cache_does_not_keep_dead_models_alive(o1):
    import gc
    import weakref
    refs = []
    for _ in range(3000):  # grad-mode forwards of throwaway models, never a backward
        m = nn.Linear(4, 4)
        m(torch.randn(2, 4))  # the casts of m.weight and m.bias are cached
        refs.append(weakref.ref(m.weight))
        del m
    gc.collect()
    assert _stats()["size"] <= 4096  # bounded (NOTE: [Weight-cast cache lifetime])
    assert sum(r() is not None for r in refs) < 2100  # the dropped ones were freed


def test_no_grad_then_grad_keeps_weight_gradients(o1):
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)  # must not fill the cache with a history-less cast
    model(x).float().sum().backward()
    assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0
    # grad first, then no_grad reuse is fine too
    model.zero_grad()
    model(x)
    with torch.no_grad():
        model(x)
    model(x).float().sum().backward()
    assert model.weight.grad is not None


def test_inference_mode_does_not_fill(o1):
    model = nn.Linear(4, 3)
    with torch.inference_mode():
        assert model(torch.randn(2, 4)).dtype == o1
    assert _stats()["size"] == 0
    model(torch.randn(2, 4)).float().sum().backward()
    assert model.weight.grad is not None


# ---- autograd

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.ln = nn.LayerNorm(32)

    def forward(self, x):
        return self.l2(F.gelu(self.ln(self.l1(x))))


def test_small_model_gradients_match_fp32(low):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    x, t = torch.randn(8, 16), torch.randint(0, 4, (8,))
    F.cross_entropy(ref(x), t).backward()
    _caster.enable(low)
    out = model(x)
    assert out.dtype == low
    loss = F.cross_entropy(out, t)
    assert loss.dtype == torch.float32
    loss.backward()
    _caster.disable()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=TOL[low], atol=TOL[low])


class MyMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.mm(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g.to(a.dtype) @ b.t().to(a.dtype), a.t().to(b.dtype) @ g.to(b.dtype)


def test_custom_autograd_function(o1):
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 2, requires_grad=True)
    out = MyMM.apply(a, b)
    assert out.dtype == o1
    out.float().sum().backward()
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


def _recording_mm(**forward_options):
    """A custom_fwd/custom_bwd Function that records the dtypes its forward's and backward's mm
    give (``seen``)."""
    class RecordingMM(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu", **forward_options)
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            out = torch.mm(a, b)
            RecordingMM.seen = [out.dtype]
            return out

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            grad_a = torch.mm(g, b.t())
            RecordingMM.seen.append(grad_a.dtype)
            return grad_a.to(a.dtype), torch.mm(a.t(), g).to(b.dtype)

    return RecordingMM


DecoratedMM = _recording_mm()  # (no cast_inputs: the caller's state)
Fp32MM = _recording_mm(cast_inputs=torch.float32)  # (fp32 both ways, as under torch.autocast)


@pytest.mark.parametrize("forward_cast", [True, False], ids=["fwd cast", "fwd in disable_casts"])
def test_custom_bwd_runs_under_the_o1_state_forward_saw(o1, forward_cast):
    """As custom_bwd re-enters torch.autocast's state of the forward: a backward run in or out of
    disable_casts casts as the forward did (it cast where the forward did not, or failed on mixed
    dtypes where the forward cast)."""
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 2, requires_grad=True)
    with contextlib.nullcontext() if forward_cast else amp.disable_casts():
        out = DecoratedMM.apply(a, b)
    with amp.disable_casts() if forward_cast else contextlib.nullcontext():
        out.float().sum().backward()
    want = o1 if forward_cast else torch.float32
    assert DecoratedMM.seen == [want, want]
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


def test_cast_inputs_backward_stays_fp32_whatever_the_forward_threads_state(o1):
    """A cast_inputs forward run where O1 was off (disable_casts) kept O1 on for its backward."""
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 2, requires_grad=True)
    with amp.disable_casts():
        out = Fp32MM.apply(a, b)
    out.sum().backward()  # (O1 on)
    assert Fp32MM.seen == [torch.float32, torch.float32]


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_rnn(o1, cls):
    rnn = cls(4, 6, num_layers=2)
    x = torch.randn(5, 2, 4)
    out, _ = rnn(x)
    assert out.dtype == o1
    out.float().sum().backward()
    for p in rnn.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN], ids=["lstm", "gru", "rnn"])
def test_rnn_takes_low_precision_input(o1, cls):
    """An RNN after a cast layer (or a stacked RNN module) gets fp16/bf16 input while its weights
    are fp32: torch's module-level dtype check must not refuse it (torch skips it under autocast),
    and the result equals running the module on hand-cast input and weights with the caster off."""
    torch.manual_seed(0)
    proj, rnn, rnn2 = nn.Linear(3, 4), cls(4, 6), cls(6, 5, batch_first=False)
    x = torch.randn(5, 2, 3)
    out, _ = rnn2(rnn(proj(x))[0])  # Linear -> RNN -> RNN: each RNN sees low-precision input
    assert out.dtype == o1
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for m in (proj, rnn, rnn2) for p in m.parameters())
    with _caster.disabled():
        ref_mods = [copy.deepcopy(m).to(o1) for m in (proj, rnn, rnn2)]
        h = ref_mods[0](x.to(o1))
        ref, _ = ref_mods[2](ref_mods[1](h)[0])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_rnn_dtype_check_is_back_after_o1():
    rnn = nn.LSTM(4, 3)
    _caster.enable(torch.bfloat16)
    _caster.disable()
    assert "check_input" not in vars(nn.LSTM) and vars(nn.RNNBase)["check_input"].__module__ \
        == "torch.nn.modules.rnn"
    # torch's own check, back in place (its wording changed in 2.13: "RNN input dtype ...
    # does not match weight dtype", before "input must have the type torch.float32, got ...").
    with pytest.raises(ValueError, match=r"input (dtype|must have the type).*torch\.bfloat16"):
        rnn(torch.randn(2, 1, 4, dtype=torch.bfloat16))


def test_rnn_cell(o1):
    cell = nn.LSTMCell(4, 3)
    h, c = cell(torch.randn(2, 4))
    assert h.dtype == o1


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint(o1, reentrant):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant)
    assert out.dtype == o1
    out.float().sum().backward()
    ref(x.detach()).float().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("region", ["disable_casts", "local"])
def test_checkpoint_recomputes_under_the_forwards_state(o1, reentrant, region):
    """A checkpointed forward run inside disable_casts()/lists.local, with backward outside it:
    the recomputation sees the forward's caster state (as torch's checkpoint does for autocast),
    so the gradients equal those of the same forward without checkpointing."""
    torch.manual_seed(0)
    l1, l2 = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)  # (the reentrant form needs an input that does)

    def block(x):
        return l2(F.relu(l1(x)))

    def inside():
        return amp.disable_casts() if region == "disable_casts" else lists.local({F.linear: None})

    with inside():
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
    assert out.dtype == torch.float32
    out.sum().backward()  # outside the region: O1 would cast F.linear here
    got = [p.grad.clone() for p in (l1.weight, l2.weight)]
    l1.zero_grad(), l2.zero_grad()
    with inside():
        block(x).sum().backward()
    for g, p in zip(got, (l1.weight, l2.weight)):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint_recomputes_cast_after_o1_is_left(low, reentrant):
    """Forward under O1, O1 switched off (in every thread), then backward: the recomputation is
    cast as its forward was (the wrappers are held for it: docs/caster.md)."""
    torch.manual_seed(0)
    l1, l2 = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        return l2(F.relu(l1(x)))

    _caster.enable(low)
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
    ref = block(x)
    _caster.disable()
    assert out.dtype == low and not _caster.patched()
    out.float().sum().backward()
    assert not _caster.patched()
    got = [p.grad.clone() for p in (l1.weight, l2.weight)]
    l1.zero_grad(), l2.zero_grad()
    ref.float().sum().backward()
    for g, p in zip(got, (l1.weight, l2.weight)):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)


def test_checkpoint_module_is_restored_after_o1():
    import torch.utils.checkpoint as ckpt

    names = ("_checkpoint_without_reentrant_generator",
             "_checkpoint_without_reentrant_generator_impl", "CheckpointFunction")
    before = [getattr(ckpt, n, None) for n in names]
    _caster.enable(torch.float16)
    assert ckpt.CheckpointFunction is not before[2]
    _caster.disable()
    assert [getattr(ckpt, n, None) for n in names] == before


# ---- user functions and list edits

def test_decorators(o1):
    @amp.half_function
    def h(a, b):
        return a, b

    @amp.float_function
    def f(a):
        return a

    @amp.promote_function
    def p(a, b):
        return a + b

    a, d = torch.randn(2), torch.randn(2).double()
    x, y = h(a, d)
    assert x.dtype == o1 and y.dtype == torch.float64
    assert f(a.to(o1)).dtype == torch.float32
    assert p(a.to(o1), a).dtype == torch.float32
    with amp.disable_casts():
        assert h(a, a)[0].dtype == torch.float32
    assert h.__name__ == "h"


def test_decorators_off_outside_o1():
    @amp.half_function
    def h(a):
        return a

    assert h(torch.randn(2)).dtype == torch.float32


class _UserModule:
    @staticmethod
    def fn(a):
        return a * 1


def test_register_functions(low):
    orig_sigmoid = torch.sigmoid
    amp.register_float_function(torch, "sigmoid")
    amp.register_half_function(_UserModule, "fn")
    # Apex consumed the registrations at the first initialize, but its patches stayed for every
    # later one: a second initialize (e.g. of another model) keeps them working.
    for _ in range(2):
        _caster.enable(low)
        try:
            # user registration wins over the built-in lists
            assert torch.sigmoid(torch.randn(3).to(low)).dtype == torch.float32
            assert _UserModule.fn(torch.randn(3)).dtype == low
        finally:
            _caster.disable()
        assert torch.sigmoid is orig_sigmoid and lists.policy_of(torch.sigmoid) is None
        assert _UserModule.fn(torch.randn(3)).dtype == torch.float32
    lists.reset()  # drops them
    _caster.enable(low)
    assert torch.sigmoid is orig_sigmoid


def test_register_overrides_builtin(low):
    amp.register_float_function(torch, "mm")
    _caster.enable(low)
    a = torch.randn(2, 2)
    assert torch.mm(a, a).dtype == torch.float32
    assert lists.policy_of(torch.mm) == "fp32"  # (what it does now, not the built-in list)
    _caster.disable()
    assert lists.policy_of(torch.mm) == "lower"
    assert lists.policy_of(amp.float_function(lambda x: x)) == "fp32"


class _Projector:
    @staticmethod
    def project(x, w):
        return x @ w

    @classmethod
    def make(cls):
        return cls.__name__


class _SubProjector(_Projector):
    pass


class _SubSubProjector(_SubProjector):
    pass


def test_register_inherited_static_and_class_methods(low):
    """Registered on a subclass that inherits them: still a staticmethod / a classmethod bound
    to the caller's class; leaving amp removes the subclass's attribute again."""
    amp.register_half_function(_SubProjector, "project")
    amp.register_half_function(_SubProjector, "make")
    _caster.enable(low)
    try:
        x, w = torch.randn(2, 3), torch.randn(3, 3)
        assert _SubProjector().project(x, w).dtype == low
        assert _SubSubProjector.make() == "_SubSubProjector"
        assert _SubProjector().make() == "_SubProjector"
    finally:
        _caster.disable()
    assert "project" not in vars(_SubProjector) and "make" not in vars(_SubProjector)
    lists.reset()


def test_register_static_and_class_methods_stay_what_they_were(low):
    """Registered static/class methods keep working through instances and subclasses under O1,
    and leaving amp puts back the very objects that were in the class."""
    before = dict(vars(_Projector))
    amp.register_half_function(_Projector, "project")
    amp.register_float_function(_Projector, "make")
    _caster.enable(low)
    try:
        x, w = torch.randn(2, 3), torch.randn(3, 3)
        assert _Projector.project(x, w).dtype == low
        assert _Projector().project(x, w).dtype == low  # still a staticmethod
        assert _SubProjector.make() == "_SubProjector"  # still bound to the caller's class
    finally:
        _caster.disable()
    for name in ("project", "make"):
        assert vars(_Projector)[name] is before[name]
    assert _Projector().project(torch.randn(1, 3), torch.randn(3, 3)).dtype == torch.float32
    lists.reset()


def test_register_errors():
    with pytest.raises(ValueError, match="No function named nope in module"):
        amp.register_half_function(torch, "nope")
    with pytest.raises(TypeError, match="name must be a str"):
        amp.register_half_function(torch, torch.mm)
    # not a function: refused at once, so that no later initialize trips over it
    with pytest.raises(TypeError, match="float16 is a dtype, not a function"):
        amp.register_half_function(torch, "float16")
    _caster.enable(torch.bfloat16)  # nothing pending was left behind
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16


def test_lists_api(o1):
    x = torch.randn(3, 4)
    assert F.relu(x.to(o1)).dtype == o1 and lists.policy_of(F.relu) is None
    lists.add("fp32", F.relu)
    assert lists.policy_of(F.relu) == "fp32"
    assert F.relu(x.to(o1)).dtype == torch.float32
    lists.add("lower", F.softmax)  # move
    assert F.softmax(x, 1).dtype == o1
    lists.remove(F.softmax, F.relu)
    assert F.softmax(x, 1).dtype == torch.float32 and lists.policy_of(F.softmax) is None
    assert F.softmax(x.to(o1), 1).dtype == o1
    lists.reset()
    assert lists.policy_of(F.softmax) == "fp32"
    assert lists.entries()[lists._unwrap(F.gelu)] == "fp32"  # keys: the original callables


class _Activation(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = F.gelu  # a listed builtin held by a module (transformers' GELUActivation)

    def forward(self, x):
        return self.act(x)


def test_a_model_holding_a_listed_builtin_pickles_under_o1(low):
    """torch.save(model) while O1 is on, the model built before (as amp.initialize is used):
    pickle finds F.gelu by its __module__, torch._C._nn, which the patch dispatch leaves alone."""
    import io
    import pickle

    model = nn.Sequential(nn.Linear(2, 2), _Activation())
    _caster.enable(low)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back[1].act is lists._unwrap(F.gelu)
    pickle.dumps(torch._C._nn.linear)


def test_local_entered_before_o1(low):
    x = torch.randn(3, 3)
    with lists.local({F.relu: "lower"}):
        _caster.enable(low)
        assert F.relu(x).dtype == low  # the block's edits hold once O1 is on
    assert F.relu(x).dtype == torch.float32


def test_lists_errors():
    with pytest.raises(ValueError, match="policy must be one of"):
        lists.add("half", F.relu)
    with pytest.raises(TypeError, match="func must be a callable"):
        lists.add("fp32", "relu")
    with pytest.raises(TypeError, match="at least one function"):
        lists.add("fp32")
    with pytest.raises(ValueError, match="on no O1 list"):
        lists.remove(F.relu)
    with pytest.raises(TypeError, match="at least one function"):
        lists.remove()

    def mine(x):
        return x

    # never seen by the caster: refused, pointing to the decorators/registrations
    for fn in (mine, nn.ReLU, lambda x: x):
        with pytest.raises(TypeError, match="amp.half_function"):
            lists.add("lower", fn)
        with pytest.raises(TypeError, match="amp.half_function"):
            with lists.local({fn: "lower"}):
                pass
    with pytest.raises(TypeError, match="must be a callable"):
        lists.policy_of(5)
    with pytest.raises(TypeError, match="True or False"):
        lists.set_allow_banned("no")
    with pytest.raises(ValueError, match="low_dtype must be"):
        _caster.enable(torch.float32)


# ---- through amp.initialize

def test_initialize_o1_casts_loss_outside_forward(low):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", low_precision_dtype=low, verbosity=0)
    x, t = torch.randn(8, 16), torch.randn(8, 4)
    out = model(x)
    assert out.dtype == low
    extra = F.linear(out.float(), torch.eye(4))  # outside the model: still cast, as Apex
    assert extra.dtype == low
    loss = F.mse_loss(extra, t)
    assert loss.dtype == torch.float32
    assert _stats()["size"] > 0
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert _stats()["size"] == 0  # cleared on scale_loss exit
    opt.step()
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


def test_multihead_attention_is_cast_under_patch(low):
    mha = nn.MultiheadAttention(16, 2)
    x = torch.randn(5, 2, 16)
    _caster.enable(low)
    out, w = mha(x, x, x)
    assert out.dtype == low  # the F.linear inside F.multi_head_attention_forward is cast
    out.float().sum().backward()
    assert mha.in_proj_weight.grad.dtype == torch.float32


def test_legacy_init_allow_banned():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        amp.init(allow_banned=True)
    p = torch.sigmoid(F.linear(torch.randn(3, 4), torch.randn(2, 4)))
    assert p.dtype == torch.float16
    assert F.binary_cross_entropy(p, torch.rand(3, 2)).dtype == torch.float32
    _caster.disable()
    with pytest.warns(DeprecationWarning):
        amp.init()
    with pytest.raises(NotImplementedError, match="allow_banned=True"):
        F.binary_cross_entropy(torch.sigmoid(F.linear(torch.randn(3, 4), torch.randn(2, 4))),
                               torch.rand(3, 2))


def test_local_edits_are_thread_local(o1):
    import threading
    x = torch.randn(3, 4)
    with lists.local({F.gelu: "lower", F.softmax: None, F.relu: "fp32"}):
        assert lists.policy_of(F.gelu) == "lower" and lists.policy_of(F.softmax) is None
        assert F.gelu(x).dtype == o1
        assert F.softmax(x.to(o1), 1).dtype == o1
        assert F.relu(x.to(o1)).dtype == torch.float32
        with lists.local({F.gelu: "fp32"}):  # inner wins
            assert F.gelu(x.to(o1)).dtype == torch.float32
        assert F.gelu(x).dtype == o1
        seen = {}

        def other():
            seen["policy"] = lists.policy_of(F.gelu)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen["policy"] == "fp32"  # the process-wide list
    assert lists.policy_of(F.gelu) == "fp32" and F.gelu(x.to(o1)).dtype == torch.float32
    with pytest.raises(ValueError, match="policy must be one of"):
        with lists.local({F.gelu: "half"}):
            pass
    with pytest.raises(TypeError, match="edits must be a dict"):
        with lists.local([F.gelu]):
            pass


def test_checkpoint_with_autograd_grad_and_backward_inputs(o1):
    """Not only Tensor.backward(): torch.autograd.grad, backward(inputs=...) and
    torch.autograd.backward also run checkpoint's recomputation cast."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    g = torch.autograd.grad(out.float().sum(), [x] + list(model.parameters()))
    g_ref = torch.autograd.grad(ref(x).float().sum(), [x] + list(ref.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    out.float().sum().backward(inputs=list(model.parameters()))
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    torch.autograd.backward(out.float().sum())
    for p, a in zip(model.parameters(), g[1:]):
        torch.testing.assert_close(p.grad, 2 * a, rtol=0, atol=0)


def _fused_sgd(params):
    from peak.optimizers import FusedSGD
    return FusedSGD(params, lr=0.5)


@pytest.mark.parametrize("make_optimizer", [
    _fused_sgd, lambda params: torch.optim.Adam(params, lr=0.5, fused=True),
    lambda params: torch.optim.SGD(params, lr=0.5)], ids=["peak fused", "torch fused", "torch"])
@pytest.mark.parametrize("through_amp", [True, False], ids=["amp", "optimizer outside amp"])
def test_cache_ends_with_a_fused_step(low, make_optimizer, through_amp):
    """A fused step leaves the weights' version counters as they were (torch's fused kernels and
    peak's); a grad-mode forward between the backward and the step (a metric, a validation pass
    without no_grad) filled the cache with the old weights' casts, which the next forward used."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = make_optimizer(model.parameters())
    options = dict(opt_level="O1", low_precision_dtype=low, loss_scale=1.0, verbosity=0)
    if through_amp:
        model, optimizer = amp.initialize(model, optimizer, **options)
    else:
        model = amp.initialize(model, **options)
    x = torch.randn(4, 8)
    try:
        model(x).float().pow(2).mean().backward()
        model(x)  # the forward no backward goes through: it fills the cache
        before = model.weight.detach().clone()
        optimizer.step()
        assert not torch.equal(model.weight, before)
        with amp.disable_casts():
            expected = F.linear(x.to(low), model.weight.detach().to(low),
                                model.bias.detach().to(low))
        assert torch.equal(model(x), expected)
    finally:
        _caster.disable()
