"""Per-op behaviour of the O1 caster: dtypes, bitwise equality with casting by hand, policies."""
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from peak import amp
from peak.amp import _caster, lists

torch.manual_seed(0)
_g = torch.Generator().manual_seed(0)


_OWNERS = {"F": F, "torch": torch, "Tensor": torch.Tensor}


def resolve(name):
    """Look the function up at call time (under patch dispatch torch.mm is then the wrapper)."""
    owner, attr = name.split(".")
    return getattr(_OWNERS[owner], attr)


def r(*shape):
    return torch.randn(*shape, generator=_g)


def rp(*shape):
    return torch.rand(*shape, generator=_g) + 0.5


# (id, function, args builder, policy). Every policy kind, each of the three namespaces.
CASES = [
    # lower
    ("F.linear", F.linear, lambda: (r(3, 4), r(5, 4), r(5)), "lower"),
    ("F.conv1d", F.conv1d, lambda: (r(1, 2, 8), r(3, 2, 3)), "lower"),
    ("F.conv2d", F.conv2d, lambda: (r(1, 2, 6, 6), r(3, 2, 3, 3)), "lower"),
    ("F.conv_transpose2d", F.conv_transpose2d, lambda: (r(1, 2, 4, 4), r(2, 3, 3, 3)), "lower"),
    ("torch.mm", torch.mm, lambda: (r(3, 4), r(4, 5)), "lower"),
    ("torch.matmul", torch.matmul, lambda: (r(2, 3, 4), r(4, 5)), "lower"),
    ("torch.addmm", torch.addmm, lambda: (r(3, 5), r(3, 4), r(4, 5)), "lower"),
    ("torch.mv", torch.mv, lambda: (r(3, 4), r(4)), "lower"),
    ("torch.addmv", torch.addmv, lambda: (r(3), r(3, 4), r(4)), "lower"),
    ("torch.addr", torch.addr, lambda: (r(3, 4), r(3), r(4)), "lower"),
    ("torch.bmm", torch.bmm, lambda: (r(2, 3, 4), r(2, 4, 5)), "lower"),
    ("torch.baddbmm", torch.baddbmm, lambda: (r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)), "lower"),
    ("torch.addbmm", torch.addbmm, lambda: (r(3, 5), r(2, 3, 4), r(2, 4, 5)), "lower"),
    ("torch.prelu", torch.prelu, lambda: (r(2, 3), r(3)), "lower"),
    ("Tensor.mm", torch.Tensor.mm, lambda: (r(3, 4), r(4, 5)), "lower"),
    ("Tensor.matmul", torch.Tensor.matmul, lambda: (r(3, 4), r(4, 5)), "lower"),
    # fp32
    ("F.softmax", F.softmax, lambda: (r(3, 4), 1), "fp32"),
    ("F.log_softmax", F.log_softmax, lambda: (r(3, 4), 1), "fp32"),
    ("F.gelu", F.gelu, lambda: (r(3, 4),), "fp32"),
    ("F.softplus", F.softplus, lambda: (r(3, 4),), "fp32"),
    ("F.layer_norm", F.layer_norm, lambda: (r(3, 4), (4,), r(4), r(4)), "fp32"),
    ("F.group_norm", F.group_norm, lambda: (r(2, 4, 3), 2), "fp32"),
    ("F.normalize", F.normalize, lambda: (r(3, 4),), "fp32"),
    ("F.mse_loss", F.mse_loss, lambda: (r(3, 4), r(3, 4)), "fp32"),
    ("F.l1_loss", F.l1_loss, lambda: (r(3, 4), r(3, 4)), "fp32"),
    ("F.smooth_l1_loss", F.smooth_l1_loss, lambda: (r(3, 4), r(3, 4)), "fp32"),
    ("F.kl_div", F.kl_div, lambda: (r(3, 4), torch.rand(3, 4, generator=_g), None, None, "batchmean"),
     "fp32"),
    ("F.binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits,
     lambda: (r(3, 4), torch.rand(3, 4, generator=_g)), "fp32"),
    ("F.cosine_similarity", F.cosine_similarity, lambda: (r(3, 4), r(3, 4)), "fp32"),
    ("F.interpolate", F.interpolate, lambda: (r(1, 2, 4), 8), "fp32"),
    ("torch.exp", torch.exp, lambda: (r(3, 4),), "fp32"),
    ("torch.log", torch.log, lambda: (rp(3, 4),), "fp32"),
    ("torch.rsqrt", torch.rsqrt, lambda: (rp(3, 4),), "fp32"),
    ("torch.pow", torch.pow, lambda: (rp(3, 4), 2.5), "fp32"),
    ("torch.sum", torch.sum, lambda: (r(3, 4),), "fp32"),
    ("torch.prod", torch.prod, lambda: (rp(3, 4),), "fp32"),
    ("torch.cumsum", torch.cumsum, lambda: (r(3, 4), 1), "fp32"),
    ("torch.var", torch.var, lambda: (r(3, 4),), "fp32"),
    ("torch.norm", torch.norm, lambda: (r(3, 4),), "fp32"),
    ("torch.dist", torch.dist, lambda: (r(3, 4), r(3, 4)), "fp32"),
    ("Tensor.sum", torch.Tensor.sum, lambda: (r(3, 4),), "fp32"),
    ("Tensor.exp", torch.Tensor.exp, lambda: (r(3, 4),), "fp32"),
    # promote (all same-dtype here: a no-op; mixed inputs below)
    ("torch.add", torch.add, lambda: (r(3, 4), r(3, 4)), "promote"),
    ("torch.mul", torch.mul, lambda: (r(3, 4), r(3, 4)), "promote"),
    ("torch.addcmul", torch.addcmul, lambda: (r(3, 4), r(3, 4), r(3, 4)), "promote"),
    ("torch.atan2", torch.atan2, lambda: (r(3, 4), r(3, 4)), "promote"),
    ("Tensor.add", torch.Tensor.add, lambda: (r(3, 4), r(3, 4)), "promote"),
    # sequence promote
    ("torch.cat", torch.cat, lambda: ([r(3, 4), r(2, 4)],), "sequence_promote"),
    ("torch.stack", torch.stack, lambda: ([r(3, 4), r(3, 4)],), "sequence_promote"),
]

EXPECTED_DTYPE = {"lower": "low", "fp32": torch.float32}


def _to(tree, dtype):
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.dtype in (torch.float16, torch.bfloat16, torch.float32) else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to(t, dtype) for t in tree)
    return tree


@pytest.mark.parametrize("name,fn,make,policy", CASES, ids=[c[0] for c in CASES])
def test_op_dtype_and_bitwise(o1, name, fn, make, policy):
    assert lists.policy_of(fn) == policy
    fn = resolve(name)
    assert lists.policy_of(fn) == policy
    args = make()
    start = {"lower": torch.float32, "fp32": o1}.get(policy, torch.float32)
    args = _to(args, start)
    out = fn(*args)
    if policy == "lower":
        want, ref_args = o1, _to(args, o1)
    elif policy == "fp32":
        want, ref_args = torch.float32, _to(args, torch.float32)
    else:
        want, ref_args = torch.float32, args
    with _caster.disabled():
        ref = fn(*ref_args)
    assert out.dtype == want
    assert torch.equal(out, ref), name


def test_torch_function_sees_listed_identities(o1):
    """What torch hands to __torch_function__ is the object on the list (incl. dunders), also
    while the caster's wrappers stand in torch's namespaces."""
    seen = []

    class Rec(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    a, b = r(2, 2), r(2, 2)
    with _caster.disabled(), Rec():
        a + b; a @ b; a * b; a ** 2; a.add_(b); a.exp(); a.cpu(); torch.cat([a, b]); F.linear(a, b)
    pol = [lists.policy_of(f) for f in seen]
    assert pol == ["promote", "lower", "promote", "fp32", "match_self", "fp32", "fp32",
                   "sequence_promote", "lower"]


def test_every_default_entry_resolves():
    ents = lists.entries()
    assert len(ents) > 200
    names = {(w, n) for w, n, _ in __import__("peak")._C.caster.default_entries()}
    for w, n in [("functional", "linear"), ("torch", "mm"), ("Tensor", "__matmul__"),
                 ("functional", "binary_cross_entropy"), ("torch", "lstm")]:
        assert (w, n) in names
    for fn, pol in ents.items():
        assert callable(fn) and pol in lists.POLICIES + ("hook",)


def test_promote_mixed(o1):
    a32, a16 = r(3), r(3).to(o1)
    assert torch.add(a32, a16).dtype == torch.float32
    assert (a16 * a32).dtype == torch.float32
    assert torch.equal(a16 + a32, a16.float() + a32)
    other = torch.bfloat16 if o1 == torch.float16 else torch.float16
    assert torch.add(a16, r(3).to(other)).dtype == torch.float32  # f16 + bf16 -> f32
    assert torch.add(a16, a16).dtype == o1  # one dtype: untouched
    d = r(3).double()
    assert torch.add(d, a32).dtype == torch.float64  # f64 never cast; torch promotes


def test_promote_through_keywords(o1):
    """NOTE: [Nothing-to-cast fast path] decides on the argument array, keywords included: a low
    tensor passed by keyword still mixes, `out=` keeps the caller's buffer, and a one-dtype call
    with keywords gives torch's result."""
    a32, a16 = r(3), r(3).to(o1)
    mixed = torch.add(a32, other=a16, alpha=2.0)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, a32 + 2.0 * a16.float(), rtol=0, atol=0)
    assert torch.add(a16, a16, alpha=0.5).dtype == o1
    out = torch.empty(3)
    assert torch.add(a32, a16, out=out) is out
    torch.testing.assert_close(out, a32 + a16.float(), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=o1):  # torch's own region: its rules, not the fast path
        assert torch.add(a32, a16).dtype == torch.float32
    m32, m16 = r(3, 3), r(3, 3).to(o1)  # fp32 and lower ops: cast only what is not yet right
    assert F.softmax(m32, dim=0).dtype == torch.float32
    assert F.softmax(input=m16, dim=0).dtype == torch.float32
    assert torch.mm(m16, m16).dtype == o1
    assert torch.mm(m16, mat2=m32).dtype == o1


def test_sequence_promote_mixed(o1):
    a32, a16 = r(2, 3), r(2, 3).to(o1)
    assert torch.cat([a16, a32]).dtype == torch.float32
    assert torch.equal(torch.cat([a16, a32]), torch.cat([a16.float(), a32]))
    assert torch.cat((a16, a16)).dtype == o1
    assert torch.stack([a32, a16]).dtype == torch.float32


def test_fp64_and_integers_untouched(o1):
    d = r(3, 3).double()
    assert torch.mm(d, d).dtype == torch.float64
    assert F.softmax(d, 0).dtype == torch.float64
    i = torch.arange(6).reshape(2, 3)
    assert torch.sum(i).dtype == torch.int64 and torch.cumsum(i, 1).dtype == torch.int64
    # mixed: the float arg is cast, the integer arg is left alone
    idx = torch.tensor([0, 2])
    out = F.cross_entropy(r(2, 3).to(o1), idx)
    assert out.dtype == torch.float32


def test_nested_kwargs_and_dicts(o1):
    w = r(5, 4)
    assert F.linear(input=r(3, 4), weight=w).dtype == o1
    assert torch.cat(tensors=[r(2).to(o1), r(2)]).dtype == torch.float32


def test_dict_arguments_of_decorated_functions_are_the_callers(o1):
    """A dict argument with nothing to cast is passed as it is (a function may fill a cache dict),
    as Apex passed dicts through; one with a cast value is a shallow copy of its own type, the
    caller's untouched. They were always new plain dicts: writes lost, a defaultdict broken."""
    import collections

    @amp.half_function
    def fill(x, cache, stats):
        cache["k"] = x
        stats["calls"] += 1
        return cache, stats

    cache, stats = {}, collections.defaultdict(int)
    got_cache, got_stats = fill(r(3), cache, stats)
    assert got_cache is cache and got_stats is stats and stats["calls"] == 1
    assert cache["k"].dtype == o1

    @amp.half_function
    def read(d):
        return d

    held = collections.defaultdict(list, {"w": r(2), "n": 3})
    copied = read(held)
    assert type(copied) is collections.defaultdict and copied.default_factory is list
    assert copied["w"].dtype == o1 and copied["n"] == 3 and held["w"].dtype == torch.float32
    ordered = collections.OrderedDict([("b", r(2)), ("a", r(2))])
    assert type(read(ordered)) is collections.OrderedDict and list(read(ordered)) == ["b", "a"]


def test_tuple_arguments_keep_their_type_when_cast(o1):
    """A namedtuple is rebuilt from its fields; other tuple types (torch.return_types, a class
    of tuple's) from one sequence, as tuple() takes it (they raised a TypeError)."""
    class Pair(tuple):
        pass

    a = r(4, 4)
    assert torch.cat(Pair((a, a.to(o1)))).dtype == torch.float32  # promote: fp32
    top = torch.topk(a, 2)

    @amp.half_function
    def values(res):
        return res

    got = values(top)
    assert type(got) is type(top) and got.values.dtype == o1 and got.indices.dtype == torch.int64
    assert torch.equal(got.values, top.values.to(o1)) and torch.equal(got.indices, top.indices)


def test_decorated_functions_inside_an_explicit_autocast_region(o1):
    """A decorated function is not an op: in a torch.autocast region its arguments are cast by its
    policy with the region's dtype (as custom_fwd(cast_inputs=) casts; a kernel that needs low
    precision still gets it), and its body runs under the region's autocast, tensors passed
    directly or not. It ran with autocast off, its arguments in O1's dtype."""
    other = torch.bfloat16 if o1 == torch.float16 else torch.float16

    @amp.float_function
    def head(x, w):
        return x.dtype, torch.is_autocast_enabled("cpu"), F.linear(x, w).dtype

    @amp.half_function
    def kernel(x):
        return x.dtype

    class Holder:
        def __init__(self, x, w):
            self.x, self.w = x, w

    @amp.float_function
    def held(h):
        return F.linear(h.x, h.w).dtype

    x, w = r(4, 8), r(8, 8)
    with torch.autocast("cpu", dtype=other):
        assert head(x.to(o1), w) == (torch.float32, True, other)
        assert kernel(x) == other
        assert held(Holder(x, w)) == other
    assert head(x.to(o1), w) == (torch.float32, False, o1)
    assert kernel(x) == o1 and held(Holder(x, w)) == o1


def test_dicts_that_cannot_be_copied_as_their_type_and_cyclic_arguments(o1):
    """A dict type whose copy cannot be written (or is the dict itself) gets a plain dict, the
    caller's untouched; a container inside itself is passed as it is there (it crashed the
    interpreter, recursing)."""
    class Frozen(dict):
        def __setitem__(self, key, value):
            raise TypeError("immutable")

    class SelfCopy(dict):
        def __copy__(self):
            return self

    @amp.half_function
    def read(d):
        return d

    for kind in (Frozen, SelfCopy):
        given = kind(w=r(2))
        got = read(given)
        assert type(got) is dict and got["w"].dtype == o1 and given["w"].dtype == torch.float32
    cyclic = {"w": r(2)}
    cyclic["self"] = cyclic
    got = read(cyclic)
    assert got["w"].dtype == o1 and got["self"] is cyclic
    loop = [r(2)]
    loop.append(loop)
    assert torch.cat(loop[:1] + [r(2).to(o1)]).dtype == torch.float32  # (promote still works)
    assert read(loop)[0].dtype == o1


def test_weight_casts_under_compiled_autograd(o1):
    """Compiled autograd runs the backward of an O1 forward (it refused the cache's hook), and a
    cast its backward reached serves no later forward: a weight written unseen since (through
    .data, as a kernel writes without a version bump) is cast afresh."""
    import torch._dynamo
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    lin, x = torch.nn.Linear(8, 8), r(4, 8)
    eager = torch.nn.Linear(8, 8)
    eager.load_state_dict(lin.state_dict())
    eager(x).float().pow(2).sum().backward()
    torch._dynamo.reset()
    out = lin(x)
    with compiled_autograd._enable(torch.compile(backend="eager")):
        out.float().pow(2).sum().backward()
    assert torch.equal(lin.weight.grad, eager.weight.grad)
    lin.weight.data.mul_(2)
    assert torch.equal(lin(x), F.linear(x.to(o1), lin.weight.to(o1), lin.bias.to(o1)))


def test_banned(o1):
    p = torch.sigmoid(F.linear(r(3, 4), r(2, 4)))
    assert p.dtype == o1
    with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
        F.binary_cross_entropy(p, torch.rand(3, 2))
    # fp32 inputs are fine
    assert F.binary_cross_entropy(p.float(), torch.rand(3, 2)).dtype == torch.float32
    lists.set_allow_banned(True)
    out = F.binary_cross_entropy(p, torch.rand(3, 2))
    assert out.dtype == torch.float32


def test_inplace_twins(o1):
    h = r(3).to(o1)
    with pytest.raises(NotImplementedError, match="exp_"):
        h.exp_()
    h.add_(r(3))  # match_self: the f32 arg is cast to self's dtype
    assert h.dtype == o1
    f = r(3)
    f.mul_(r(3).to(o1))
    assert f.dtype == torch.float32


def test_off_outside_o1(low):
    a = r(3, 3)
    assert torch.mm(a, a).dtype == torch.float32
    _caster.enable(low)
    assert torch.mm(a, a).dtype == low
    _caster.disable()
    assert torch.mm(a, a).dtype == torch.float32
    assert torch._C._len_torch_function_stack() == 0


def test_disable_casts(o1):
    from peak import amp
    a = r(3, 3)
    with amp.disable_casts():
        assert torch.mm(a, a).dtype == torch.float32
    assert torch.mm(a, a).dtype == o1
    with pytest.raises(ZeroDivisionError):
        with amp.disable_casts():
            1 / 0
    assert torch.mm(a, a).dtype == o1  # exception safe


def test_torch_autocast_at_the_same_time(o1):
    a, b = r(4, 4), r(4, 4)
    other = torch.bfloat16 if o1 == torch.float16 else torch.float16
    with torch.autocast("cpu", dtype=other):
        out = torch.mm(a, b)  # an explicit region is torch's: its dtype, not O1's
        assert out.dtype == other
        with torch.autocast("cpu", enabled=False):
            with _caster.disabled():
                assert torch.equal(out, torch.mm(a.to(other), b.to(other)))
            assert torch.mm(a, b).dtype == o1  # autocast off for the device: O1 again
    assert torch.mm(a, b).dtype == o1


def test_thread_isolation(o1):
    import threading
    a = r(3, 3)
    res = {}
    t = threading.Thread(target=lambda: res.setdefault("d", torch.mm(a, a).dtype))
    t.start()
    t.join()
    assert res["d"] == torch.float32
    assert torch.mm(a, a).dtype == o1


def test_patch_restores_everything(low):
    before_tensor = dict(vars(torch.Tensor))
    before = {n: getattr(torch, n) for n in ("mm", "matmul", "cat", "exp", "lstm")}
    before_f = {n: getattr(F, n) for n in ("linear", "softmax", "conv2d")}
    _caster.enable(low)
    assert torch.mm is not before["mm"] and F.conv2d is torch.conv2d  # both sites patched
    assert torch._VF.lstm is not before["lstm"]
    _caster.disable()
    assert dict(vars(torch.Tensor)) == before_tensor
    assert {n: getattr(torch, n) for n in before} == before
    assert {n: getattr(F, n) for n in before_f} == before_f
    assert "lstm" not in vars(torch._VF)


def test_patch_add_while_active(low):
    _caster.enable(low)
    x = torch.randn(3).to(low)
    assert torch.sigmoid(x).dtype == low
    lists.add("fp32", torch.sigmoid)
    assert torch.sigmoid(x).dtype == torch.float32
    lists.remove(torch.sigmoid)  # the wrapper stays but calls through
    assert torch.sigmoid(x).dtype == low


def test_tensor_cpu_of_a_cpu_tensor_is_itself(o1):
    """``cpu`` is on Apex's fp32 list for CUDA tensors (Apex left CPU tensors alone): a CPU
    tensor's ``.cpu()`` stays the tensor itself, so writes through ``t.cpu().numpy()`` land."""
    assert lists.policy_of(torch.Tensor.cpu) == "fp32"
    t = r(3, 4).to(o1)
    assert t.cpu() is t
    f = r(3)
    f.cpu().numpy()[0] = 5.0
    assert f[0] == 5.0


def test_out_argument_receives_the_result(o1):
    """With out=, the caller chose the result's dtype: the inputs are cast to it and the result
    lands in out (Apex cast out too, so the result went to a temporary and was lost)."""
    a, b = r(3, 4), r(4, 5)
    for out_dtype in (torch.float32, o1):
        out = torch.zeros(3, 5, dtype=out_dtype)
        res = torch.mm(a, b, out=out)
        assert res is out
        with amp.disable_casts():
            assert torch.equal(out, torch.mm(a.to(out_dtype), b.to(out_dtype)))
    out = torch.zeros(3, 4)
    torch.exp(r(3, 4).to(o1), out=out)  # an fp32 op into an fp32 out
    assert out.abs().sum() > 0


def test_lists_reject_callables_no_call_could_match():
    x = r(3)
    with pytest.raises(TypeError, match="bound to one tensor"):
        lists.add("fp32", x.relu)
    with pytest.raises(TypeError, match="aten op"):
        lists.add("fp32", torch.ops.aten.sigmoid.default)
    with pytest.raises(TypeError, match="aten op"):
        lists.add("lower", torch.ops.aten.sigmoid)


def test_a_listed_op_is_cast_once_at_its_entry(o1):
    """Calls a listed op makes in turn are not cast again: ``2.0 / h`` (promote, one dtype) runs
    torch's __rtruediv__, whose reciprocal() (fp32 list) stays in the low dtype, exactly as
    "cast by hand, then run with casts off"."""
    h = r(4).to(o1)
    out = 2.0 / h
    with amp.disable_casts():
        ref = 2.0 / h
    assert out.dtype == o1 and torch.equal(out, ref)


def test_set_dispatch_accepts_only_patch():
    """O1 has one dispatch: the documented lists.set_dispatch keeps taking "patch", and "mode"
    (removed) gets an error that says what to do."""
    lists.set_dispatch("patch")
    with pytest.raises(ValueError, match=r"set_dispatch\('mode'\).*removed.*Delete the"):
        lists.set_dispatch("mode")
    with pytest.raises(ValueError, match="dispatch must be 'patch'"):
        lists.set_dispatch("hook")


@pytest.mark.parametrize("policy", ["lower", "fp32", "promote"])
def test_an_in_place_method_given_a_casting_policy_is_refused(policy):
    """Under O1 an in-place Tensor method with a casting policy would run on a cast copy and lose
    its write (silently): lists.add and lists.local refuse it and name the policies that write
    (match_self, inplace_fp32), which stay accepted; dunders are not in-place methods."""
    for edit in (lambda: lists.add(policy, torch.Tensor.add_),
                 lambda: lists.local({torch.Tensor.exp_: policy}).__enter__(),
                 lambda: lists.add(policy, torch.exp_), lambda: lists.add(policy, F.relu_)):
        with pytest.raises(ValueError, match=r"writes its own tensor.*match_self"):
            edit()
    with pytest.raises(ValueError, match=r"writes its own tensor"):
        lists.register_float_function(torch, "exp_")
    import types  # (a user's function named with a trailing underscore is not torch's in-place)
    mine = types.SimpleNamespace(lambda_=lambda x: x)
    lists.register_float_function(mine, "lambda_")
    assert lists.policy_of(torch.Tensor.add_) != policy
    lists.add("match_self", torch.Tensor.add_)
    lists.add(policy, torch.Tensor.__mul__)
    with lists.local(lists.entries()):  # (a table entry may be given again: Apex's fp32 pow_)
        pass
    lists.reset()
