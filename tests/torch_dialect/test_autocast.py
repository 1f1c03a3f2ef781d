"""peak.amp.autocast: torch.autocast's semantics (it is torch.autocast underneath), torch's CPU
op-list tests run through it, and peak's per-region list edits (fp32_ops / lower_ops)."""
import copy
import collections
import pathlib
import re
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peak import amp
from peak.amp import _caster
from peak_testing import assert_bitwise_equal
from peak.amp.autocast_mode import (TORCH_AUTOCAST_LISTS, TORCH_AUTOCAST_LIST_CHANGES,
                                    autocast_list_changes)

F = torch.nn.functional
ROOT = pathlib.Path(__file__).resolve().parents[2]

try:
    from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists
except Exception:  # pragma: no cover - private torch module
    AutocastCPUTestLists = None


def _cast(val, to_type):
    if isinstance(val, torch.Tensor):
        return val.to(to_type) if val.is_floating_point() else val
    if isinstance(val, collections.abc.Iterable) and not isinstance(val, str):
        return type(val)(_cast(v, to_type) for v in val)
    return val


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, collections.abc.Iterable):
        return all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _cpu_list_cases():
    if AutocastCPUTestLists is None:
        return []
    lists = AutocastCPUTestLists(torch.device("cpu"))
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for op, args, *rest in lists.torch_16:
            cases.append(pytest.param("torch", op, args, rest[0] if rest else {}, dtype, dtype,
                                      id=f"torch.{op}-{dtype}"))
        for op, args, kw in lists.nn_16:
            cases.append(pytest.param("nn", op, args, kw, dtype, dtype, id=f"nn.{op}-{dtype}"))
        for op, args, *rest in lists.torch_fp32:
            cases.append(pytest.param("torch", op, args, rest[0] if rest else {}, dtype,
                                      torch.float32, id=f"torch.{op}-{dtype}"))
        for op, args, *rest in lists.nn_fp32:
            cases.append(pytest.param("nn", op, args, rest[0] if rest else {}, dtype,
                                      torch.float32, id=f"nn.{op}-{dtype}"))
    return cases


@pytest.mark.skipif(AutocastCPUTestLists is None, reason="torch's autocast test lists unavailable")
@pytest.mark.parametrize("module, op, args, kwargs, amp_dtype, run_as", _cpu_list_cases())
def test_torch_cpu_lists_through_peak_autocast(module, op, args, kwargs, amp_dtype, run_as):
    """torch's _run_autocast_outofplace: output dtype, bitwise equal to torch.autocast, and to
    the control that casts the inputs by hand and runs with autocast off."""
    fn = getattr(torch._C._nn if module == "nn" else torch, op)
    assert not torch.is_autocast_enabled("cpu")
    with amp.autocast("cpu", dtype=amp_dtype):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == amp_dtype
        out = fn(*args, **kwargs)
        if module == "torch" and hasattr(torch.Tensor, op):
            out_method = getattr(args[0], op)(*args[1:], **kwargs)
            assert _equal(out, out_method)
    assert not torch.is_autocast_enabled("cpu")
    if isinstance(out, torch.Tensor):
        assert out.dtype == run_as
    with torch.autocast("cpu", dtype=amp_dtype):
        out_torch = fn(*args, **kwargs)
    assert _equal(out, out_torch)
    control = fn(*_cast(args, run_as), **kwargs)
    assert _equal(out, control)


@pytest.mark.skipif(AutocastCPUTestLists is None, reason="torch's autocast test lists unavailable")
def test_need_autocast_promote_and_builtin_promote():
    lists = AutocastCPUTestLists(torch.device("cpu"))
    for op, args_bf16, args_fp16 in lists.torch_need_autocast_promote:
        for args, dtype in ((args_bf16, torch.bfloat16), (args_fp16, torch.float16)):
            with amp.autocast("cpu", dtype=dtype):
                assert getattr(torch, op)(*args).dtype == torch.float32
    for op, args_bf16, args_fp16, out_type in lists.torch_expect_builtin_promote:
        with amp.autocast("cpu"):
            assert getattr(torch, op)(*args_bf16).dtype == out_type


# ---- the documented lists are torch's ------------------------------------------------------------

@pytest.mark.parametrize("device, key", [("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")])
def test_documented_lists_match_the_dispatcher(device, key):
    registered = {n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}
    listed = [op for ops in TORCH_AUTOCAST_LISTS[device].values() for op in ops]
    assert len(listed) == len(set(listed)), "an op is in two lists"
    expected = set(listed)
    # The lists document 2.13; other recorded releases differ by their changes, and a release
    # with no record has its own lists as they are.
    changes = autocast_list_changes(device=device) or {"added": (), "removed": ()}
    expected = (expected | set(changes["added"])) - set(changes["removed"])
    assert expected == registered, (
        f"torch {torch.__version__}'s {key} ops differ from the lists: missing "
        f"{sorted(registered - expected)}, extra {sorted(expected - registered)}; record the "
        f"release in TORCH_AUTOCAST_LIST_CHANGES")


@pytest.mark.parametrize("version, known", [("2.13.0", True), ("2.14.1+cu130", True),
                                            ("2.10.0", True), ("2.11.0", True),
                                            ("2.12.1", True), ("2.15.0", True),
                                            ("2.99.0", False), ("3.0.0a0", False)])
def test_list_changes_of_any_release(version, known):
    """Every release gets an answer (no KeyError): its record, or None."""
    for device in ("cpu", "cuda"):
        changes = autocast_list_changes(version, device)
        if not known:
            assert changes is None
            continue
        assert set(changes) == {"added", "removed"}
        if version.startswith("2.13"):
            assert changes == {"added": (), "removed": ()}
        else:
            assert changes == TORCH_AUTOCAST_LIST_CHANGES[
                tuple(int(v) for v in version.split(".")[:2])][device]


def test_docs_tables_list_every_op():
    text = (ROOT / "docs" / "torch_dialect.md").read_text()
    for device, lists in TORCH_AUTOCAST_LISTS.items():
        for policy, ops in lists.items():
            m = re.search(rf"<!-- {device}:{policy} -->\n(.*?)\n<!-- end -->", text, re.S)
            assert m, f"docs/torch_dialect.md lacks the {device} {policy} list"
            assert sorted(re.findall(r"`([^`]+)`", m.group(1))) == sorted(ops)


@pytest.mark.parametrize("policy, expected", [("lower_precision_fp", torch.bfloat16),
                                              ("fp32", torch.float32)])
def test_cpu_list_policies_sample(policy, expected):
    """A few ops per CPU list, with their policy's output dtype (fp32 inputs for the lower list,
    bf16 inputs for the fp32 list)."""
    a32, b32 = torch.randn(6, 6), torch.randn(6, 6)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    samples = {
        "lower_precision_fp": [lambda: torch.mm(a32, b32), lambda: a32 @ b32,
                               lambda: F.linear(a32, b32), lambda: torch.addmm(a32, a32, b32),
                               lambda: torch.bmm(a32[None], b32[None])],
        "fp32": [lambda: F.mse_loss(a16, b16), lambda: torch.cdist(a16, b16),
                 lambda: torch.prod(a16), lambda: torch.trace(a16), lambda: F.l1_loss(a16, b16),
                 lambda: torch.linalg.inv(a16 + 6 * torch.eye(6, dtype=torch.bfloat16))],
    }
    for fn in samples[policy]:
        with amp.autocast("cpu"):
            assert fn().dtype == expected


# ---- torch.autocast semantics --------------------------------------------------------------------

def test_context_decorator_nesting_and_enabled_false():
    a = torch.randn(4, 4)

    @amp.autocast("cpu")
    def f(x):
        assert torch.is_autocast_enabled("cpu")
        return torch.mm(x, x)

    assert f(a).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    with amp.autocast("cpu", dtype=torch.float16):
        assert torch.mm(a, a).dtype == torch.float16
        with amp.autocast("cpu", enabled=False):
            assert not torch.is_autocast_enabled("cpu")
            assert torch.mm(a, a).dtype == torch.float32
        with amp.autocast("cpu", dtype=torch.bfloat16):
            assert torch.mm(a, a).dtype == torch.bfloat16
        with amp.autocast("cpu"):  # dtype=None: the current (outer) dtype, read at construction
            assert torch.mm(a, a).dtype == torch.float16
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(TypeError, match="requires a callable"):
        amp.autocast("cpu")(3)


def test_reentrant_decorator_restores_state():
    region = amp.autocast("cpu")

    @region
    def rec(n):
        if n:
            rec(n - 1)
        return torch.is_autocast_enabled("cpu")

    assert rec(3)
    assert not torch.is_autocast_enabled("cpu")


def test_is_a_torch_autocast_and_checkpoint_agrees():
    assert isinstance(amp.autocast("cpu"), torch.autocast)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with amp.autocast("cpu"):
        out = torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()  # recomputation under the recorded autocast state
    assert x.grad is not None and lin.weight.grad.dtype == torch.float32


def test_errors_like_torch():
    with pytest.raises(ValueError, match="Expected `device_type` of type `str`"):
        amp.autocast(torch.device("cpu"))
    with pytest.raises(RuntimeError):
        amp.autocast("not_a_device")
    with pytest.warns(UserWarning, match="CPU Autocast only supports"):
        r = amp.autocast("cpu", dtype=torch.float64)
    with r:
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(TypeError, match="dtype must be a torch.dtype or None, or one of the strings"):
        amp.autocast("cpu", dtype="bfloat8")


class CountCasts(TorchDispatchMode):
    def __init__(self, weight):
        super().__init__()
        self.weight, self.count = weight, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0] is self.weight:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cache_enabled, casts", [(None, 1), (True, 1), (False, 2)])
def test_weight_cast_cache(cache_enabled, casts):
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with CountCasts(lin.weight) as counter:
        with amp.autocast("cpu", cache_enabled=cache_enabled):
            lin(x)
            lin(x)
    assert counter.count == casts


# ---- per-region list edits -----------------------------------------------------------------------

def test_fp32_ops_moves_an_op_out_of_the_lower_list_bitwise():
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    with amp.autocast("cpu", fp32_ops=[torch.mm, "linear"]):
        out_mm, out_meth, out_lin = torch.mm(a, b), a.mm(b), F.linear(a, b)
        out_matmul = a @ b  # not edited: still torch's lower list
    assert out_mm.dtype == out_meth.dtype == out_lin.dtype == torch.float32
    assert torch.equal(out_mm, torch.mm(a, b)) and torch.equal(out_lin, F.linear(a, b))
    assert out_matmul.dtype == torch.bfloat16
    # a bf16 input is cast up, as torch's fp32 policy does
    with amp.autocast("cpu", fp32_ops=["mm"]):
        up = torch.mm(a.bfloat16(), b)
    assert up.dtype == torch.float32 and torch.equal(up, torch.mm(a.bfloat16().float(), b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_lower_ops_bitwise_against_hand_cast(dtype):
    x, y = torch.randn(32), torch.randn(32)
    with amp.autocast("cpu", dtype=dtype, lower_ops=["exp", torch.nn.functional.mse_loss,
                                                     "softmax", "add"]):
        e, e_meth = torch.exp(x), x.exp()
        loss = F.mse_loss(x, y)  # on torch's CPU fp32 list: the edit wins
        sm = F.softmax(x, dim=0)
        s = x + y  # `+` is add
        t = torch.tanh(x)  # not listed: unchanged
    assert e.dtype == e_meth.dtype == loss.dtype == sm.dtype == s.dtype == dtype
    assert torch.equal(e, torch.exp(x.to(dtype))) and torch.equal(e, e_meth)
    assert torch.equal(loss, F.mse_loss(x.to(dtype), y.to(dtype)))
    assert torch.equal(sm, F.softmax(x.to(dtype), dim=0))
    assert torch.equal(s, x.to(dtype) + y.to(dtype))
    assert t.dtype == torch.float32
    # float64 and integer tensors are not eligible, as in torch
    with amp.autocast("cpu", lower_ops=["exp"]):
        assert torch.exp(x.double()).dtype == torch.float64


def test_edits_only_inside_their_region_and_nesting():
    a = torch.randn(8, 8)
    with amp.autocast("cpu"):
        assert torch.mm(a, a).dtype == torch.bfloat16
        with amp.autocast("cpu", fp32_ops=["mm"], lower_ops=["exp"]):
            assert torch.mm(a, a).dtype == torch.float32
            with amp.autocast("cpu", lower_ops=["mm"]):  # inner edit wins
                assert torch.mm(a, a).dtype == torch.bfloat16
                assert torch.exp(a).dtype == torch.bfloat16  # inherited from the outer region
            with amp.autocast("cpu"):  # a plain inner region inherits the edits
                assert torch.mm(a, a).dtype == torch.float32
            with amp.autocast("cpu", enabled=False):  # autocast off: edits off too
                assert torch.exp(a).dtype == torch.float32
                assert torch.mm(a.bfloat16(), a.bfloat16()).dtype == torch.bfloat16
            assert torch.mm(a, a).dtype == torch.float32
        assert torch.mm(a, a).dtype == torch.bfloat16
        assert torch.exp(a).dtype == torch.float32
    assert torch.exp(a).dtype == torch.float32


def test_edits_gradients_flow_to_fp32_leaves():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with amp.autocast("cpu", lower_ops=["gelu"], fp32_ops=["linear"]):
        h = lin(x)
        out = F.gelu(h)
    assert h.dtype == torch.float32 and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32
    ref = torch.nn.Linear(8, 8)
    ref.load_state_dict(lin.state_dict())
    F.gelu(ref(x).bfloat16()).float().sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad)


def test_edit_cast_cache_reuses_weight_casts_and_sees_in_place_updates():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(8, 8)
    with CountCasts(w) as counter:
        with amp.autocast("cpu", lower_ops=["tanh"]):
            torch.tanh(w)
            torch.tanh(w)
            with torch.no_grad():
                w.add_(1.0)  # the version counter moves: the cached cast is stale
            out = torch.tanh(w)
    assert counter.count == 2
    assert torch.equal(out, torch.tanh(w.detach().bfloat16()))
    with CountCasts(w) as counter:
        with amp.autocast("cpu", lower_ops=["tanh"], cache_enabled=False):
            torch.tanh(w)
            torch.tanh(w)
    assert counter.count == 2


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(fp32_ops="mm"), TypeError, "wrap a single op in a list"),
    (dict(fp32_ops=[3]), TypeError, "entries must be torch functions"),
    (dict(lower_ops=["not_an_op"]), ValueError, "'not_an_op' is not a torch function"),
    (dict(lower_ops=[print]), ValueError, "is not a torch function"),
    (dict(fp32_ops=["mm"], lower_ops=[torch.mm]), ValueError, "in both fp32_ops and lower_ops"),
])
def test_bad_list_edits(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        amp.autocast("cpu", **kwargs)


def test_aten_style_names_accepted():
    a = torch.randn(4, 4)
    with amp.autocast("cpu", fp32_ops=["aten::mm.default", "conv2d.padding"]):
        assert torch.mm(a, a).dtype == torch.float32


# ---- list edits write where the op writes; checkpoint recomputes with the edits ------------------

def test_list_edits_keep_out_and_in_place_writes():
    a = torch.randn(3, 3)
    for edit in (dict(lower_ops=["mm"]), dict(fp32_ops=["mm"])):
        o = torch.zeros(3, 3, dtype=torch.bfloat16 if "fp32_ops" in edit else torch.float32)
        with amp.autocast("cpu", **edit):
            r = torch.mm(a.to(o.dtype), a.to(o.dtype), out=o)
        assert r is o  # torch returns out
        with amp.disable_casts():
            expected = torch.mm(a.to(o.dtype).float(), a.to(o.dtype).float())
        torch.testing.assert_close(o.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("edit", ["lower_ops", "fp32_ops"])
def test_list_edits_keep_batch_norm_running_stats(edit):
    torch.manual_seed(0)
    bn, ref = torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    with amp.autocast("cpu", **{edit: ["batch_norm"]}):
        y = bn(x)
    assert y.dtype == (torch.bfloat16 if edit == "lower_ops" else torch.float32)
    in_dtype = torch.bfloat16 if edit == "lower_ops" else torch.float32
    ref(x.to(in_dtype))  # the same statistics update, by hand
    assert torch.equal(bn.running_mean, ref.running_mean)
    assert torch.equal(bn.running_var, ref.running_var)
    assert bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint_recomputes_with_the_list_edits(reentrant):
    """torch pops the edit mode while its __torch_function__ runs: backward must still run the
    engine (and so the recomputation) with the edits on, or the recomputed activations would get
    other dtypes (non-reentrant: CheckpointError; reentrant: other gradients)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    ref = copy.deepcopy(net)
    x = torch.randn(4, 8, requires_grad=True)
    with amp.autocast("cpu", fp32_ops=["linear"]):
        out = torch.utils.checkpoint.checkpoint(net, x, use_reentrant=reentrant)
        assert out.dtype == torch.float32
        out.float().sum().backward()
        ref(x).float().sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    if not reentrant:  # torch's reentrant checkpoint takes neither .grad() nor inputs=
        with amp.autocast("cpu", fp32_ops=["linear"]):
            out = torch.utils.checkpoint.checkpoint(net, x, use_reentrant=False)
            g = torch.autograd.grad(out.float().sum(), list(net.parameters()))
            g_ref = torch.autograd.grad(ref(x).float().sum(), list(ref.parameters()))
            out = torch.utils.checkpoint.checkpoint(net, x, use_reentrant=False)
            out.float().sum().backward(inputs=[net[0].weight])
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref))


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("edit", [dict(fp32_ops=["linear"]), dict(lower_ops=["layer_norm"])],
                         ids=["fp32_ops", "lower_ops"])
def test_checkpoint_recomputes_with_the_list_edits_after_the_region(reentrant, edit):
    """torch's recipe runs backward after the region: the recomputation still sees the forward's
    edits (torch's checkpoint re-enters only torch.autocast's state; without peak's snapshot the
    reentrant one recomputed with torch's lists, the other raised CheckpointError), also when a
    thread with no region runs the backward; nothing of the hooks stays after the region."""
    import torch.utils.checkpoint as ckpt
    original = ckpt.CheckpointFunction
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.GELU(),
                              torch.nn.Linear(16, 4))
    x = torch.randn(8, 16, requires_grad=True)  # (the reentrant checkpoint needs one)

    def grads(checkpointed, in_thread=False):
        net.zero_grad(set_to_none=True)
        with amp.autocast("cpu", dtype=torch.bfloat16, **edit):
            out = (ckpt.checkpoint(net, x, use_reentrant=reentrant) if checkpointed else net(x))
        if in_thread:
            worker = threading.Thread(target=lambda: out.float().square().sum().backward())
            worker.start()
            worker.join()
        else:
            out.float().square().sum().backward()
        return [p.grad.clone() for p in net.parameters()]

    expected = grads(False)
    assert ckpt.CheckpointFunction is original and not _caster.patched()
    for in_thread in (False, True):
        got = grads(True, in_thread)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert ckpt.CheckpointFunction is original and not _caster.patched()


# ---- list edits on the caster's frames: exceptions, threads, in-place writes ---------------------

def test_list_edits_leave_nothing_behind_after_an_exception():
    a, original_mm = torch.randn(4, 4), torch.mm
    with pytest.raises(RuntimeError, match="boom"):
        with amp.autocast("cpu", fp32_ops=["mm"]):
            assert torch.mm(a, a).dtype == torch.float32 and torch.mm is not original_mm
            raise RuntimeError("boom")
    assert torch.mm is original_mm and not _caster.patched()
    assert _caster.open_edits("cpu") == []
    with amp.autocast("cpu"):
        assert torch.mm(a, a).dtype == torch.bfloat16


def test_list_edits_are_thread_local():
    a = torch.randn(4, 4)
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def other():
        inside.wait(10)
        with amp.autocast("cpu"):  # the main thread's edit is not seen here
            seen["mm"] = torch.mm(a, a).dtype
        with amp.autocast("cpu", lower_ops=["exp"]):  # its own edit is
            seen["exp"] = torch.exp(a).dtype
            done.set()

    t = threading.Thread(target=other)
    t.start()
    with amp.autocast("cpu", fp32_ops=["mm"]):
        inside.set()
        assert done.wait(10)
        assert torch.mm(a, a).dtype == torch.float32
        assert torch.exp(a).dtype == torch.float32  # the other thread's edit is not seen here
    t.join()
    assert seen == {"mm": torch.bfloat16, "exp": torch.bfloat16}


def test_list_edits_write_in_place_ops_into_the_callers_tensor():
    x, y = torch.randn(8), torch.randn(8)
    before = x.clone()
    with amp.autocast("cpu", lower_ops=["add_"]):
        r = x.add_(y)
    assert r is x and x.dtype == torch.float32
    assert torch.equal(x, (before.bfloat16() + y.bfloat16()).float())


def test_list_edits_under_inference_mode():
    """Lightning runs validation and prediction under torch.inference_mode: the edited ops cast
    (inference tensors have no version counter for the write-back to read: NOTE: [Region edits
    under inference mode]), in-place and out= writes still reach the caller's tensor, and the
    results are those of no_grad."""
    lin = torch.nn.Linear(4, 4)
    x, y = torch.randn(2, 4), torch.randn(8)
    results = {}
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), amp.autocast("cpu", dtype=torch.bfloat16, fp32_ops=[F.softmax],
                                  lower_ops=["add_", "exp"]):
            out = lin(x)  # bf16, made in the mode (an inference tensor under inference_mode)
            soft = F.softmax(out, -1)
            inplace = x.clone()
            r = inplace.add_(y[:4])
            o = torch.zeros(2, 4)
            e = torch.exp(x, out=o)
        assert soft.dtype == torch.float32 and r is inplace and e is o
        results[mode.__name__] = (out, soft, inplace, o)
    assert_bitwise_equal(results["inference_mode"], results["no_grad"])
    assert torch.equal(results["no_grad"][2], (x.bfloat16() + y[:4].bfloat16()).float())


def test_list_edits_share_the_casters_weight_cache():
    lin, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    _caster.clear_cache()
    with amp.autocast("cpu", lower_ops=["linear"]):
        before = _caster.cache_stats()["hits"]
        lin(x)
        lin(x)
        assert _caster.cache_stats()["hits"] == before + 2  # weight and bias, cast once
    assert _caster.cache_stats()["size"] == 0  # dropped with the region, as torch's cache is


# -- under torch.compile (NOTE: [Regions under torch.compile]) ---------------------------------

def _compile_case():
    import torch._dynamo
    torch._dynamo.reset()
    lin = torch.nn.Linear(32, 8)
    return lin, torch.randn(4, 32)


def test_regions_in_compiled_code_compile_as_torchs_decorated_and_nested():
    """A peak region made in the traced code is torch's own there: a decorated function with a
    nested enabled=False region compiles (in one graph from torch 2.12 on: before, Dynamo breaks
    the graph at the region) and gives eager's bits."""
    lin, x = _compile_case()

    @amp.autocast("cpu", dtype="bf16")
    def forward(x):
        y = lin(x)
        with amp.autocast("cpu", enabled=False):
            z = torch.nn.functional.linear(y.float(), lin.weight[:, :8])
        return y, z

    with torch.no_grad():
        eager = forward(x)
        one_graph = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 12)
        compiled = torch.compile(forward, fullgraph=one_graph)(x)
    assert [t.dtype for t in compiled] == [torch.bfloat16, torch.float32]
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=0, atol=0) if c.dtype == torch.float32 else \
            torch.testing.assert_close(c.float(), e.float(), rtol=1e-2, atol=1e-2)


def test_list_edits_are_never_dropped_silently_under_compile():
    """A region with list edits in code that torch.compile traces is refused with peak's message
    (made there, made outside, as a decorator); it never runs as torch's region without its
    edits (the op in bf16)."""
    lin, x = _compile_case()
    outside = amp.autocast("cpu", dtype=torch.bfloat16, fp32_ops=["linear"])

    def made_inside(x):
        with amp.autocast("cpu", dtype=torch.bfloat16, fp32_ops=["linear"]):
            return lin(x)

    def made_outside(x):
        with outside:
            return lin(x)

    decorated = amp.autocast("cpu", dtype=torch.bfloat16, fp32_ops=["linear"])(lambda x: lin(x))
    for fn in (made_inside, made_outside, decorated):
        with pytest.raises(Exception, match="list edits") as raised:  # (Dynamo's wrapper type)
            torch.compile(fn)(x)
        assert "outside the compiled code" in str(raised.value)
        assert fn(x).dtype == torch.float32  # (eager: the edits apply)
    assert not torch.is_autocast_enabled("cpu")


def test_custom_fwd_bwd_without_cast_inputs_compile():
    lin, x = _compile_case()

    class Twice(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu")
        def forward(ctx, t):
            return t * 2

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            return g * 2

    def loss(x):
        with amp.autocast("cpu", dtype=torch.bfloat16):
            return Twice.apply(lin(x)).float().sum()

    eager_grads = torch.autograd.grad(loss(x), lin.weight)
    compiled_grads = torch.autograd.grad(torch.compile(loss)(x), lin.weight)
    assert_bitwise_equal(compiled_grads[0], eager_grads[0])


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_weights_made_under_inference_mode_cast_in_edited_regions(mode):
    """Parameters made under torch.inference_mode are inference tensors (no version counter):
    the weight-cast cache passes them by, in an edited region and under O1."""
    with torch.inference_mode():
        ln = torch.nn.LayerNorm(6)
        x = torch.randn(4, 6)
    with getattr(torch, mode)():
        with amp.autocast("cpu", dtype=torch.bfloat16, lower_ops=["layer_norm"]):
            out = ln(x)
        ref = torch.nn.functional.layer_norm(x.bfloat16(), (6,), ln.weight.bfloat16(),
                                             ln.bias.bfloat16())
    assert_bitwise_equal(out, ref)


def test_regions_copy_pickle_and_subclass():
    import pickle
    region = amp.autocast("cpu", dtype=torch.bfloat16, fp32_ops=["linear"])
    for twin in (copy.copy(region), copy.deepcopy(region), pickle.loads(pickle.dumps(region))):
        assert type(twin) is amp.autocast and twin.fast_dtype == torch.bfloat16
        with twin:
            assert F.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.float32

    class Tagged(amp.autocast):
        def __init__(self, enabled=True, *, tag=None):
            super().__init__("cpu", dtype=torch.bfloat16, enabled=enabled)
            self.tag = tag

    with Tagged(tag="x") as t:
        assert t.tag == "x" and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with Tagged(False):
        assert not torch.is_autocast_enabled("cpu")


def test_custom_bwd_edits_under_compiled_autograd_are_refused_not_dropped():
    import torch._dynamo

    class MM(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu")
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return torch.mm(g, b.t()), torch.mm(a.t(), g)

    a, b = (torch.randn(8, 8, requires_grad=True) for _ in range(2))
    with amp.autocast("cpu", dtype=torch.bfloat16, fp32_ops=[torch.mm]):
        out = MM.apply(a, b)
    eager = torch.autograd.grad(out.sum(), a, retain_graph=True)[0]
    assert eager.dtype == torch.float32 and torch.equal(eager, torch.mm(torch.ones(8, 8), b.t()))
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            compiled = torch.compile(lambda o: torch.autograd.grad(o.sum(), a)[0],
                                     backend="aot_eager")(out)
    except Exception as e:  # noqa: BLE001 (Dynamo wraps it)
        assert "list edits" in str(e)
    else:
        assert torch.equal(compiled, eager)


@pytest.mark.parametrize("edit", ["lower_exp_", "lower_add_", "fp32_exp_"])
def test_an_edited_in_place_op_is_recorded_by_autograd(edit):
    """What an edited in-place op wrote back into the caller's tensor carries its gradient: the
    same as the op run by hand on the cast copy and copied back (the write-back once ran outside
    autograd, and the gradient skipped the op)."""
    low = torch.bfloat16
    x = torch.tensor([0.5, 1.0, -0.25], requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    kind, name = edit.split("_", 1)
    region = {"lower_ops" if kind == "lower" else "fp32_ops": [name]}
    with amp.autocast("cpu", dtype=low, **region):
        h = x * 1 if kind == "lower" else (x * 1).to(low)
        h.exp_() if name == "exp_" else h.add_(x)
    h.sum().backward()
    dtype = low if kind == "lower" else torch.float32
    r = ref_x * 1 if kind == "lower" else (ref_x * 1).to(low)
    c = r.to(dtype)
    c = c.exp() if name == "exp_" else c + ref_x.to(dtype)
    r = r.clone().copy_(c) if kind == "lower" else c.to(low)
    r.sum().backward()
    assert torch.equal(h.detach(), r.detach())
    assert torch.equal(x.grad, ref_x.grad) and not torch.equal(x.grad, torch.ones(3))


@pytest.mark.parametrize("where", ["O1", "region"])
def test_torch_func_transforms_run_under_casting(where):
    """torch.func.grad and vjp take wrapped tensors without storage: they cast without the
    weight-cast cache (which keys by storage), as torch.autocast lets them run."""
    x, w = torch.randn(2, 8), torch.randn(4, 8)

    def f(w):
        return F.linear(x, w).float().sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.func.grad(f)(w)
    if where == "O1":
        _caster.enable(torch.bfloat16)
        try:
            got = torch.func.grad(f)(w)
            _, vjp = torch.func.vjp(f, w)
        finally:
            _caster.disable()
    else:
        with amp.autocast("cpu", dtype=torch.bfloat16, lower_ops=["linear"]):
            got = torch.func.grad(f)(w)
            _, vjp = torch.func.vjp(f, w)
    assert_bitwise_equal(got, expected)
    assert vjp(torch.tensor(1.0))[0].shape == w.shape


@pytest.mark.parametrize("op", ["exp_", "__imul__", "relu_inplace"])
@pytest.mark.parametrize("transform", ["eager", "vmap", "functionalize"])
def test_an_edited_in_place_op_writes_back_under_torch_func_transforms(transform, op):
    """vmap and functionalize keep a tensor's version counter still through an in-place op: the
    write into the cast copy is found by the in-place call (a name like exp_ or __imul__, or
    inplace=True) returning it, and reaches the caller's tensor."""
    x = torch.tensor([[0.5], [1.0], [-0.25]])
    do = {"exp_": lambda h: h.exp_(), "__imul__": lambda h: h.__imul__(2),
          "relu_inplace": lambda h: F.relu(h, inplace=True)}[op]
    ref = {"exp_": torch.exp, "__imul__": lambda h: h * 2, "relu_inplace": torch.relu}[op]

    def f(x):
        h = x * 3
        alias = h
        do(h)
        return alias

    run = {"eager": f, "vmap": torch.vmap(f), "functionalize": torch.func.functionalize(f)}
    with amp.autocast("cpu", dtype=torch.bfloat16,
                      lower_ops=[F.relu if op == "relu_inplace" else op]):
        got = run[transform](x)
    assert torch.equal(got, ref((x * 3).bfloat16()).float())


@pytest.mark.parametrize("op", ["mul_", "__imul__"])
def test_an_edited_in_place_op_on_a_weight_leaves_its_cached_cast_alone(op):
    """An edited in-place op on a weight (a leaf that requires grad) is refused by autograd at the
    write-back, as torch refuses it; it wrote a copy of its own, not the weight's cached cast, so
    the earlier forward's graph and later forwards are as they were."""
    w, x = torch.nn.Parameter(torch.ones(2, 2)), torch.ones(1, 2, requires_grad=True)
    with amp.autocast("cpu", dtype=torch.bfloat16, lower_ops=[op, "linear"]):
        before = F.linear(x, w)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            getattr(w, op)(2)
        assert torch.equal(w.detach(), torch.ones(2, 2))
        assert torch.equal(F.linear(x, w), before)
    before.float().sum().backward()
    assert torch.equal(w.grad, torch.ones(2, 2))


@pytest.mark.parametrize("transform", ["vmap", "functionalize"])
def test_an_edited_op_returning_its_input_does_not_write_back(transform):
    """Under vmap and functionalize an edited op that returns its (cast) input unchanged
    (dropout in eval mode) leaves the caller's tensor alone and returns the cast, as eagerly."""
    x = torch.tensor([[0.1], [1 / 3], [-0.7]])
    before = x.clone()

    def f(v):
        return F.dropout(v, p=0.5, training=False)

    run = torch.vmap(f) if transform == "vmap" else torch.func.functionalize(f)
    with amp.autocast("cpu", dtype=torch.bfloat16, lower_ops=[F.dropout]):
        out = run(x)
    assert torch.equal(x, before) and out.dtype == torch.bfloat16


def test_an_edited_cast_made_before_a_fused_step_is_not_used_after_it():
    """A fused step bumps no version counter: a cast of an edited op's weight cached between the
    backward and the step (a metric's forward) must not outlive the step inside the region."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(lin.parameters(), lr=0.1, fused=True)
    x = torch.randn(4, 8)
    with amp.autocast("cpu", dtype=torch.bfloat16, lower_ops=["linear"]):
        lin(x).float().sum().backward()
        lin(x)  # (grad mode: the weight's cast is cached)
        opt.step()
        after_step = lin(x)
    with amp.autocast("cpu", dtype=torch.bfloat16, lower_ops=["linear"]):
        assert torch.equal(after_step, lin(x))


def test_attention_compiles_whole_inside_an_edited_region():
    """O1's own hooks (nn's attention fast-path switch reads the caster's C++ state, which Dynamo
    cannot trace) stay out of a region that only edits the lists: one graph, as without peak."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8)
    compiled = torch.compile(lambda t: mha(t, t, t)[0], fullgraph=True, backend="eager")
    with amp.autocast("cpu", dtype=torch.bfloat16, fp32_ops=["softmax"]):
        got = compiled(x)
        expected = mha(x, x, x)[0]
    torch.testing.assert_close(got, expected)
