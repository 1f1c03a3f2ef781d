"""Every entry of the O1 caster's default policy tables (issue 4), for fp16 and bf16.

For each default entry ``(where, name, policy)`` of ``peak._C.caster.default_entries()``:

- the output dtype(s) under O1 follow the policy, for the input dtypes that matter to it;
- the output is bitwise equal to "cast the inputs by hand as the policy says, then call the op
  with the caster off" (``amp.disable_casts()``);
- the number of casts the caster made (``cache_stats()["casts"]``) is exactly the number of
  tensors the policy says to cast: this is what shows a promote of a comparison (bool output) or
  of ``torch.equal`` (Python bool) happened, and that integer/fp64 tensors were left alone.

The tests are parametrized over the entries themselves. An entry without inputs in ``BUILDERS``
(or in the elementwise name groups of the default builder) fails with a message naming it.
Entries that do not exist in this torch (e.g. ``Tensor.conv1d``; the lists loader skips them) are
listed in ``ABSENT`` and tested for being absent. No entry is skipped: all run on CPU in torch 2.13.

None of the default entries draws random numbers (dropout/rrelu are on no list; the RNN entries are
called with dropout=0, train=False), so no seeding between the two calls is needed; inputs are
built once from a generator seeded per test and cloned for each call.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import peak
from peak import amp
from peak.amp import _caster, lists

_c = peak._C.caster
_OWNERS = {"torch": torch, "functional": F, "Tensor": torch.Tensor}
_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)

_g = torch.Generator()


# ---------------------------------------------------------------------------------------------
# the entries

ALL_ENTRIES = [(w, n, _c.policy_name(code)) for w, n, code in _c.default_entries()]


def _eid(entry):
    return f"{entry[0]}.{entry[1]}"


def _exists(where, name):
    return getattr(_OWNERS[where], name, None) is not None


PRESENT = [e for e in ALL_ENTRIES if _exists(e[0], e[1])]
MISSING = [e for e in ALL_ENTRIES if not _exists(e[0], e[1])]

# Default entries that are no attribute of torch 2.13 (Apex's lists name them; the loader skips
# them, so they are on no list). Not skips: test_absent_entry checks they are still absent.
_NO_TENSOR_METHOD = "torch.Tensor has no such method"
_NO_INPLACE = "no in-place variant of this op exists"
ABSENT = {
    **{f"Tensor.{n}": _NO_TENSOR_METHOD for n in (
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "conv_tbc", "bilinear")},
    **{f"torch.{n}_": "torch has no module-level in-place function of this name" for n in (
        "erfinv", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var",
        "renorm")},
    **{f"Tensor.{n}_": _NO_INPLACE for n in (
        "dist", "norm", "prod", "std", "sum", "var", "conv1d", "conv2d", "conv3d",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu",
        "matmul", "mm", "mv", "bmm", "cross", "bilinear", "dot", "vdot", "equal")},
}


# ---------------------------------------------------------------------------------------------
# input builders (fp32 floating inputs; integer/index tensors as the op needs them)

def r(*shape):
    return torch.randn(*shape, generator=_g)


def rp(*shape):  # positive, away from 0 (log, rsqrt, divisors)
    return torch.rand(*shape, generator=_g) + 0.5


def ru(*shape):  # inside (-0.9, 0.9) (acos, asin, erfinv)
    return (torch.rand(*shape, generator=_g) * 2 - 1) * 0.9


def rint(*shape):  # small integer-valued floats: exact in fp16/bf16, comparisons get ties
    return torch.randint(-2, 3, shape, generator=_g).float()


def pm1(*shape):  # +-1 labels
    return torch.randint(0, 2, shape, generator=_g).float() * 2 - 1


def idx(high, *shape):
    return torch.randint(0, high, shape, generator=_g)


def _rnn(mode, gates):
    def make():
        t, b, i, h = 3, 2, 4, 5
        hx = (r(1, b, h), r(1, b, h)) if mode == "lstm" else r(1, b, h)
        params = [r(gates * h, i), r(gates * h, h), r(gates * h), r(gates * h)]
        # has_biases, num_layers, dropout (0: no random numbers), train, bidirectional, batch_first
        return (r(t, b, i), hx, params, True, 1, 0.0, False, False, False)
    return make


def _rnn_cell(mode, gates):
    def make():
        b, i, h = 2, 4, 5
        hx = (r(b, h), r(b, h)) if mode == "lstm" else r(b, h)
        return (r(b, i), hx, r(gates * h, i), r(gates * h, h), r(gates * h), r(gates * h))
    return make


def _ctc():
    t, n, c = 6, 2, 4
    log_probs = torch.log_softmax(r(t, n, c), 2)
    targets = torch.randint(1, c, (n, 3), generator=_g)
    return (log_probs, targets, torch.tensor([6, 6]), torch.tensor([3, 2]))


# A builder returns the positional args, or (args, kwargs). Keys: "where.name" first, then name.
BUILDERS = {
    # ---- lower: convolutions, linear, BLAS, prelu, RNNs
    "conv1d": lambda: (r(1, 2, 8), r(3, 2, 3), r(3)),
    "conv2d": lambda: ((r(1, 2, 5, 5), r(3, 2, 3, 3), r(3)), {"padding": 1}),
    "conv3d": lambda: (r(1, 2, 4, 4, 4), r(3, 2, 3, 3, 3), r(3)),
    "conv_transpose1d": lambda: (r(1, 2, 5), r(2, 3, 3), r(3)),
    "conv_transpose2d": lambda: ((r(1, 2, 4, 4), r(2, 3, 3, 3), r(3)), {"stride": 2}),
    "conv_transpose3d": lambda: (r(1, 2, 3, 3, 3), r(2, 3, 2, 2, 2), r(3)),
    "conv_tbc": lambda: (r(5, 2, 3), r(3, 3, 4), r(4), 1),  # (T, B, Cin), (k, Cin, Cout), bias, pad
    "linear": lambda: (r(3, 4), r(5, 4), r(5)),
    "scaled_dot_product_attention": lambda: (r(2, 3, 4), r(2, 5, 4), r(2, 5, 4)),
    "prelu": lambda: (r(2, 3, 4), rp(3)),
    "addmm": lambda: ((r(3, 5), r(3, 4), r(4, 5)), {"beta": 0.5, "alpha": 2.0}),
    "addmv": lambda: (r(3), r(3, 4), r(4)),
    "addr": lambda: (r(3, 4), r(3), r(4)),
    "matmul": lambda: (r(2, 3, 4), r(4, 5)),
    "__matmul__": lambda: (r(2, 3, 4), r(4, 5)),
    "mm": lambda: (r(3, 4), r(4, 5)),
    "mv": lambda: (r(3, 4), r(4)),
    "bmm": lambda: (r(2, 3, 4), r(2, 4, 5)),
    "baddbmm": lambda: (r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)),
    "addbmm": lambda: (r(3, 5), r(2, 3, 4), r(2, 4, 5)),
    "lstm": _rnn("lstm", 4),
    "gru": _rnn("gru", 3),
    "rnn_tanh": _rnn("rnn", 1),
    "rnn_relu": _rnn("rnn", 1),
    "lstm_cell": _rnn_cell("lstm", 4),
    "gru_cell": _rnn_cell("gru", 3),
    "rnn_tanh_cell": _rnn_cell("rnn", 1),
    "rnn_relu_cell": _rnn_cell("rnn", 1),
    # ---- fp32: torch.nn.functional
    "interpolate": lambda: ((r(1, 2, 4),), {"size": 7, "mode": "linear", "align_corners": False}),
    "grid_sample": lambda: ((r(1, 2, 4, 4), ru(1, 3, 3, 2)), {"align_corners": False}),
    "softplus": lambda: (r(3, 4),),
    "softmin": lambda: ((r(3, 4),), {"dim": 1}),
    "log_softmax": lambda: ((r(3, 4),), {"dim": 1}),
    "softmax": lambda: ((r(3, 4),), {"dim": 1}),
    "gelu": lambda: (r(3, 4),),
    "layer_norm": lambda: (r(3, 4), (4,), r(4), r(4)),
    "group_norm": lambda: (r(2, 4, 3), 2, r(4), r(4)),
    "local_response_norm": lambda: (rp(2, 4, 5), 2),
    "normalize": lambda: ((r(3, 4),), {"dim": 1}),
    "cosine_similarity": lambda: (r(3, 4), r(3, 4)),
    "poisson_nll_loss": lambda: (r(3, 4), rp(3, 4)),
    "cosine_embedding_loss": lambda: (r(3, 4), r(3, 4), pm1(3)),
    "cross_entropy": lambda: ((r(3, 5), idx(5, 3)), {"weight": rp(5)}),  # long target untouched
    "hinge_embedding_loss": lambda: (r(3, 4), pm1(3, 4)),
    "kl_div": lambda: ((torch.log_softmax(r(3, 4), 1), torch.rand(3, 4, generator=_g)),
                       {"reduction": "batchmean"}),
    "l1_loss": lambda: (r(3, 4), r(3, 4)),
    "mse_loss": lambda: (r(3, 4), r(3, 4)),
    "margin_ranking_loss": lambda: (r(5), r(5), pm1(5)),
    "multilabel_margin_loss": lambda: (r(3, 4), torch.tensor([[3, 0, -1, 1], [0, 1, 2, 3],
                                                              [1, -1, 0, 0]])),
    "multilabel_soft_margin_loss": lambda: (r(3, 4), torch.randint(0, 2, (3, 4), generator=_g)
                                            .float()),
    "multi_margin_loss": lambda: (r(3, 4), idx(4, 3)),
    "nll_loss": lambda: (torch.log_softmax(r(3, 5), 1), idx(5, 3)),
    "binary_cross_entropy_with_logits": lambda: ((r(3, 4), torch.rand(3, 4, generator=_g)),
                                                 {"pos_weight": rp(4)}),
    "smooth_l1_loss": lambda: (r(3, 4), r(3, 4)),
    "soft_margin_loss": lambda: (r(3, 4), pm1(3, 4)),
    "triplet_margin_loss": lambda: (r(3, 4), r(3, 4), r(3, 4)),
    "ctc_loss": _ctc,
    # ---- banned
    "binary_cross_entropy": lambda: (torch.sigmoid(r(3, 4)), torch.rand(3, 4, generator=_g)),
    # ---- fp32: torch / Tensor (the unary ones are in the default builder's groups)
    "pow": lambda: (rp(3, 4), r(3, 4)),
    "__pow__": lambda: (rp(3, 4), r(3, 4)),
    "__ipow__": lambda: (rp(3, 4), r(3, 4)),
    "__rpow__": lambda: (r(3, 4), rp(3, 4)),  # rp ** r
    "cumprod": lambda: (r(3, 4), 1),
    "cumsum": lambda: ((r(3, 4),), {"dim": 1}),
    "dist": lambda: (r(3, 4), r(3, 4)),
    "renorm": lambda: (r(3, 4), 2, 0, 1.0),
    # ---- promote (the binary arithmetic ones are in the default builder's groups)
    "addcdiv": lambda: ((r(3, 4), r(3, 4), rp(3, 4)), {"value": 0.5}),
    "addcmul": lambda: ((r(3, 4), r(3, 4), r(3, 4)), {"value": 2.0}),
    "atan2": lambda: (r(3, 4), r(3, 4)),
    "cross": lambda: ((r(4, 3), r(4, 3)), {"dim": 1}),
    "bilinear": lambda: (r(2, 3), r(2, 4), r(5, 3, 4), r(5)),
    "dot": lambda: (r(5), r(5)),
    "vdot": lambda: (r(5), r(5)),
    "equal": lambda: _equal_pair(),
    # ---- sequence promote
    "cat": lambda: ([r(3, 4), r(2, 4), r(1, 4)],),
    "stack": lambda: (([r(3, 4), r(3, 4)],), {"dim": 1}),
}

# The default builder: elementwise unary / binary ops by name group.
UNARY = {"cosh", "exp", "expm1", "sinh", "tan", "sum", "std", "var", "norm", "cpu"}
UNARY_POS = {"log", "log10", "log2", "reciprocal", "rsqrt", "prod"}
UNARY_UNIT = {"acos", "asin", "erfinv"}
BINARY = {"add", "mul", "sub", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__",
          "__isub__", "__mul__", "__rmul__", "__imul__"}
BINARY_DIV = {"div", "__div__", "__truediv__", "__idiv__", "__itruediv__", "__rdiv__",
              "__rtruediv__"}  # divisor (the op's second operand) away from 0
COMPARE = {"eq", "ne", "ge", "gt", "le", "lt", "__eq__", "__ne__", "__ge__", "__gt__", "__le__",
           "__lt__"}


def _equal_pair():
    x = rint(3, 4)
    return (x, x.clone())  # equal after any cast: torch.equal's answer is True, not vacuous


def _divisor_pair(name):
    if name in ("__rdiv__", "__rtruediv__"):  # other / self
        return (rp(3, 4), r(3, 4))
    return (r(3, 4), rp(3, 4))


def builder_for(where, name):
    """The input builder of an entry; in-place twins ("add_") use their op's builder."""
    for key in (f"{where}.{name}", name, name[:-1] if name.endswith("_") else None):
        if key is None:
            continue
        if key in BUILDERS:
            return BUILDERS[key]
        if key in UNARY:
            return lambda: (r(3, 4),)
        if key in UNARY_POS:
            return lambda: (rp(3, 4),)
        if key in UNARY_UNIT:
            return lambda: (ru(3, 4),)
        if key in BINARY:
            return lambda: (r(3, 4), r(3, 4))
        if key in BINARY_DIV:
            return lambda key=key: _divisor_pair(key)
        if key in COMPARE:
            return lambda: (rint(3, 4), rint(3, 4))
    return None


def build(where, name):
    make = builder_for(where, name)
    if make is None:
        pytest.fail(f"no inputs for default entry {where}.{name}: add a builder to BUILDERS in "
                    f"{__file__} (or its name to one of the elementwise groups)")
    _g.manual_seed(1234)
    built = make()
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[1], dict) \
            and isinstance(built[0], tuple):
        return built[0], built[1]
    return built, {}


# ---------------------------------------------------------------------------------------------
# helpers

def _map(tree, fn):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(t, fn) for t in tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return tree


def _tensors(tree):
    out = []
    _map(tree, out.append)
    return out


def _floats(tree):
    return [t for t in _tensors(tree) if t.dtype in _ELIGIBLE]


def _cast_all(tree, dtype):
    """Hand cast: every f16/bf16/f32 tensor to ``dtype`` (fp64 and integers untouched)."""
    return _map(tree, lambda t: t.to(dtype) if t.dtype in _ELIGIBLE else t)


def _cast_where(tree, pick):
    """Cast the k-th eligible tensor (flattening order) to ``pick(k)`` when that is not None."""
    k = [0]

    def f(t):
        if t.dtype not in _ELIGIBLE:
            return t
        to = pick(k[0])
        k[0] += 1
        return t if to is None else t.to(to)
    return _map(tree, f)


def _clone(tree):
    return _map(tree, lambda t: t.clone())


def _other_low(low):
    return torch.bfloat16 if low == torch.float16 else torch.float16


def _fn(where, name):
    """Looked up at call time: under the patch dispatch this is peak's wrapper."""
    return getattr(_OWNERS[where], name)


def run_o1(where, name, args, kwargs):
    """(output, number of casts the caster made) for a call under O1, on clones of the inputs."""
    args, kwargs = _clone(args), _clone(kwargs)
    _c.reset_cache_stats()
    out = _fn(where, name)(*args, **kwargs)
    return out, _c.cache_stats()["casts"]


def run_ref(where, name, args, kwargs):
    """The op with the caster off, on clones of the (hand-cast) inputs."""
    args, kwargs = _clone(args), _clone(kwargs)
    with amp.disable_casts():
        return _fn(where, name)(*args, **kwargs)


def assert_same(out, ref, what):
    """Bitwise equality (NaNs in the same places count as equal), same dtypes and structure."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(out, torch.Tensor), what
        assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != reference {ref.dtype}"
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True, check_stride=False,
                                   msg=lambda m: f"{what}: not bitwise equal to the hand-cast "
                                                 f"reference\n{m}")
    elif isinstance(ref, (tuple, list)):
        assert isinstance(out, (tuple, list)) and len(out) == len(ref), what
        for o, rf in zip(out, ref):
            assert_same(o, rf, what)
    else:
        assert type(out) is type(ref) and out == ref, f"{what}: {out!r} != reference {ref!r}"


def assert_float_dtype(out, dtype, what):
    floats = [t for t in _tensors(out) if t.is_floating_point()]
    assert floats, f"{what}: no floating output to check"
    assert all(t.dtype == dtype for t in floats), \
        f"{what}: output dtypes {[t.dtype for t in floats]}, expected {dtype}"


def has_float_output(out):
    return any(t.is_floating_point() for t in _tensors(out))


# ---------------------------------------------------------------------------------------------
# per-policy checks: `args` hold fp32 floating tensors (and whatever else the op needs)

def check_lower(where, name, args, kwargs, low):
    what = f"{where}.{name} ({low})"
    inputs = (args, kwargs)
    n = len(_floats(inputs))
    # fp32 inputs: every float cast to low
    out, casts = run_o1(where, name, args, kwargs)
    ref = run_ref(where, name, *_cast_all(inputs, low))
    assert_float_dtype(out, low, what)
    assert_same(out, ref, what)
    assert casts == n, f"{what}: {casts} casts, expected {n}"
    # the O1 situation: activation already low, weights fp32
    a2, k2 = _cast_where(inputs, lambda k: low if k == 0 else None)
    out, casts = run_o1(where, name, a2, k2)
    assert_float_dtype(out, low, what + " mixed")
    assert_same(out, ref, what + " mixed")
    assert casts == n - 1, f"{what} mixed: {casts} casts, expected {n - 1}"


def check_fp32(where, name, args, kwargs, low):
    what = f"{where}.{name} ({low})"
    if (where, name) == ("Tensor", "cpu"):
        # On Apex's fp32 list for CUDA tensors (Apex never cast CPU ones); a CPU tensor's .cpu()
        # is the tensor itself, whatever its dtype (code writes through t.cpu().numpy()).
        t = args[0].to(low)
        out, casts = run_o1(where, name, (t,), {})
        assert casts == 0 and out.dtype == low, what
        assert _fn(where, name)(t) is t, what
        return
    inputs = (args, kwargs)
    n = len(_floats(inputs))
    a_low, k_low = _cast_all(inputs, low)
    out, casts = run_o1(where, name, a_low, k_low)
    ref = run_ref(where, name, *_cast_all((a_low, k_low), torch.float32))
    assert_float_dtype(out, torch.float32, what)
    assert_same(out, ref, what)
    assert casts == n, f"{what}: {casts} casts, expected {n}"
    # mixed low/fp32: only the low ones are cast
    if n > 1:
        a2, k2 = _cast_where(inputs, lambda k: low if k == 0 else None)
        out, casts = run_o1(where, name, a2, k2)
        ref = run_ref(where, name, *_cast_all((a2, k2), torch.float32))
        assert_float_dtype(out, torch.float32, what + " mixed")
        assert_same(out, ref, what + " mixed")
        assert casts == 1, f"{what} mixed: {casts} casts, expected 1"
    # fp32 inputs: nothing to do
    out, casts = run_o1(where, name, args, kwargs)
    assert_same(out, run_ref(where, name, args, kwargs), what + " fp32 in")
    assert casts == 0


def _promote_checks(where, name, args, kwargs, low, inputs_of, what):
    """``inputs_of(args, kwargs)``: the tree the policy looks at (all args, or the sequence)."""
    n = len(_floats(inputs_of(args, kwargs)))
    assert n >= 2, f"{what}: promote needs two floating inputs to mix, the builder gives {n}"

    def cast_in(pick):
        if inputs_of(args, kwargs) is args[0]:  # sequence promote: only the sequence
            return (type(args)((_cast_where(args[0], pick),) + tuple(args[1:])), kwargs)
        return _cast_where((args, kwargs), pick)

    # one dtype (low, then fp32): untouched
    for dt in (low, torch.float32):
        a, k = cast_in(lambda _: dt)
        out, casts = run_o1(where, name, a, k)
        ref = run_ref(where, name, a, k)
        if has_float_output(out):
            assert_float_dtype(out, dt, f"{what} all {dt}")
        assert_same(out, ref, f"{what} all {dt}")
        assert casts == 0, f"{what} all {dt}: {casts} casts, expected none"
    # mixed low + fp32: the low ones cast to fp32
    a, k = cast_in(lambda i: low if i == 0 else None)
    out, casts = run_o1(where, name, a, k)
    ref = run_ref(where, name, *_cast_all((a, k), torch.float32))
    if has_float_output(out):
        assert_float_dtype(out, torch.float32, what + " mixed")
    assert_same(out, ref, what + " mixed")
    want = 1
    assert casts == want, f"{what} mixed: {casts} casts, expected {want}"
    # mixed fp16 + bf16: all to fp32
    a, k = cast_in(lambda i: low if i == 0 else _other_low(low))
    out, casts = run_o1(where, name, a, k)
    ref = run_ref(where, name, *_cast_all((a, k), torch.float32))
    if has_float_output(out):
        assert_float_dtype(out, torch.float32, what + " f16+bf16")
    assert_same(out, ref, what + " f16+bf16")
    want = n
    assert casts == want, f"{what} f16+bf16: {casts} casts, expected {want}"


def check_promote(where, name, args, kwargs, low):
    what = f"{where}.{name} ({low})"
    _promote_checks(where, name, args, kwargs, low, lambda a, k: (a, k), what)
    if name.startswith("__i"):  # __iadd__ & co: an fp32 self with a low other stays in place
        self_, other = args[0].clone(), _cast_all(args[1:], low)
        out = _fn(where, name)(self_, *other)
        ref = run_ref(where, name, (args[0],) + tuple(_cast_all(other, torch.float32)), kwargs)
        assert out is self_ and out.dtype == torch.float32, what + " fp32 self"
        assert_same(out, ref, what + " fp32 self")


def check_sequence_promote(where, name, args, kwargs, low):
    what = f"{where}.{name} ({low})"
    assert isinstance(args[0], (list, tuple))
    _promote_checks(where, name, args, kwargs, low, lambda a, k: a[0], what)


def check_banned(where, name, args, kwargs, low):
    what = f"{where}.{name} ({low})"
    inputs = (args, kwargs)
    # any low input raises, naming the fix
    for pick in (lambda k: low, lambda k: low if k == 0 else None):
        a, k = _cast_where(inputs, pick)
        with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
            _fn(where, name)(*a, **k)
    # fp32 inputs run as they are
    out, casts = run_o1(where, name, args, kwargs)
    assert_float_dtype(out, torch.float32, what)
    assert_same(out, run_ref(where, name, args, kwargs), what)
    assert casts == 0
    # allow_banned: low inputs run in fp32
    lists.set_allow_banned(True)
    a, k = _cast_all(inputs, low)
    out, casts = run_o1(where, name, a, k)
    assert_float_dtype(out, torch.float32, what + " allow_banned")
    assert_same(out, run_ref(where, name, *_cast_all((a, k), torch.float32)), what + " allowed")
    assert casts == len(_floats(inputs))


def check_inplace_fp32(where, name, args, kwargs, low):
    """The in-place twin of an fp32 op: error on a low-precision self (self left as it was);
    on an fp32 self the other floating arguments are cast to fp32 and self is updated in place."""
    what = f"{where}.{name} ({low})"
    self_low = args[0].to(low)
    before = self_low.clone()
    with pytest.raises(NotImplementedError, match=re.escape(name) + ".*under O1"):
        _fn(where, name)(self_low, *args[1:], **kwargs)
    assert torch.equal(self_low, before), what + ": self changed although the call raised"
    # fp32 self, other floats low (where the op has any): cast to fp32, in place
    others = _cast_all((args[1:], kwargs), low)
    self_ = args[0].clone()
    _c.reset_cache_stats()
    out = _fn(where, name)(self_, *others[0], **others[1])
    casts = _c.cache_stats()["casts"]
    ref = run_ref(where, name, (args[0],) + tuple(_cast_all(others[0], torch.float32)),
                  _cast_all(others[1], torch.float32))
    assert out is self_, what + ": not in place"
    assert out.dtype == torch.float32
    assert_same(out, ref, what)
    assert casts == len(_floats(others)), f"{what}: {casts} casts"


def check_match_self(where, name, args, kwargs, low):
    """The in-place twin of a lower/promote op: the other arguments are cast to self's dtype."""
    what = f"{where}.{name} ({low})"
    n_other = len(_floats((args[1:], kwargs)))
    assert n_other >= 1, what
    for self_dt, other_dt in ((low, torch.float32), (torch.float32, low), (low, _other_low(low))):
        self_ = args[0].to(self_dt)
        others = _cast_all((tuple(args[1:]), kwargs), other_dt)
        ref = run_ref(where, name, (self_,) + _cast_all(others[0], self_dt),
                      _cast_all(others[1], self_dt))
        _c.reset_cache_stats()
        out = _fn(where, name)(self_, *others[0], **others[1])
        casts = _c.cache_stats()["casts"]
        w = f"{what} self {self_dt}, others {other_dt}"
        assert out is self_, w + ": not in place"
        assert out.dtype == self_dt, w
        assert_same(out, ref, w)
        assert casts == n_other, f"{w}: {casts} casts, expected {n_other}"


CHECKS = {"lower": check_lower, "fp32": check_fp32, "promote": check_promote,
          "sequence_promote": check_sequence_promote, "banned": check_banned,
          "inplace_fp32": check_inplace_fp32, "match_self": check_match_self}


# ---------------------------------------------------------------------------------------------
# the tests

@pytest.mark.parametrize("entry", PRESENT, ids=[_eid(e) for e in PRESENT])
def test_entry(o1, entry):
    where, name, policy = entry
    fn = _fn(where, name)
    assert lists.policy_of(fn) == policy, f"{where}.{name} is not on the {policy} list"
    args, kwargs = build(where, name)
    assert _floats((args, kwargs)), f"{where}.{name}: the builder gives no floating input"
    CHECKS[policy](where, name, tuple(args), kwargs, o1)


@pytest.mark.parametrize("entry", MISSING, ids=[_eid(e) for e in MISSING])
def test_absent_entry(entry):
    """Entries torch 2.13 does not have: on no list, and named in ABSENT (with the reason)."""
    where, name, _ = entry
    assert _eid(entry) in ABSENT, (
        f"default entry {_eid(entry)} does not resolve in torch {torch.__version__}: a typo in "
        f"csrc/caster/policy.cpp, or add it to ABSENT with the reason")
    assert not _exists(where, name)


def test_absent_list_is_current():
    """An ABSENT entry that torch now has (or that left the tables) must move to the op tests."""
    missing = {_eid(e) for e in MISSING}
    assert set(ABSENT) == missing, sorted(set(ABSENT) ^ missing)


def test_table_is_the_default_entries():
    """lists.entries() holds exactly the resolvable default entries (the "hook" entries of the
    removed mode dispatch, Tensor.backward & co., are gone with it)."""
    want = {}
    for where, name, policy in PRESENT:
        fn = _fn(where, name)
        assert want.setdefault(fn, policy) == policy, f"{where}.{name}: two policies"
    ents = lists.entries()
    assert "hook" not in ents.values() and torch.Tensor.backward not in ents
    assert ents == want


# ---- dunders through the operator syntax (what models write)

_OPERATOR = {
    "__add__": lambda a, b: a + b, "__sub__": lambda a, b: a - b, "__mul__": lambda a, b: a * b,
    "__truediv__": lambda a, b: a / b, "__matmul__": lambda a, b: a @ b,
    "__pow__": lambda a, b: a ** b, "__eq__": lambda a, b: a == b, "__ne__": lambda a, b: a != b,
    "__ge__": lambda a, b: a >= b, "__gt__": lambda a, b: a > b, "__le__": lambda a, b: a <= b,
    "__lt__": lambda a, b: a < b,
}


def _iop(op):
    def f(a, b):
        if op == "+":
            a += b
        elif op == "-":
            a -= b
        elif op == "*":
            a *= b
        elif op == "/":
            a /= b
        else:
            a **= b
        return a
    return f


_IOPERATOR = {"__iadd__": _iop("+"), "__isub__": _iop("-"), "__imul__": _iop("*"),
              "__itruediv__": _iop("/"), "__ipow__": _iop("**")}
_ROPERATOR = {"__radd__": lambda a, s: s + a, "__rsub__": lambda a, s: s - a,
              "__rmul__": lambda a, s: s * a, "__rtruediv__": lambda a, s: s / a,
              "__rpow__": lambda a, s: s ** a}
# No Python-3 operator calls __div__, __idiv__, __rdiv__ (Python 2 names; test_entry covers them).
_NO_OPERATOR = {"__div__", "__idiv__", "__rdiv__"}
DUNDERS = [e for e in PRESENT
           if e[0] == "Tensor" and e[1].startswith("__") and e[1] not in _NO_OPERATOR]


@pytest.mark.parametrize("entry", DUNDERS, ids=[_eid(e) for e in DUNDERS])
def test_dunder_operator_syntax(o1, entry):
    """``a + b`` (``a += b``, ``2 - a``) is cast as the entry says: a low, b fp32 (a Python
    scalar for the reflected ones); reference: the hand-cast method call with casts off."""
    where, name, policy = entry
    low = o1
    _g.manual_seed(7)
    (a, b), _ = build(where, name)
    a = a.to(low)
    if name in _ROPERATOR:
        s = 2.0
        out = _ROPERATOR[name](a, s)
        # one tensor: fp32 casts it, promote has nothing to mix
        ref_a = a.float() if policy == "fp32" else a
        ref = run_ref(where, name, (ref_a, s), {})
        assert out.dtype == (torch.float32 if policy == "fp32" else low), name
    else:
        op = _OPERATOR.get(name) or _IOPERATOR[name]
        keep, before = a, a.clone()
        out = op(a, b)
        to = {"lower": low, "fp32": torch.float32, "promote": torch.float32}[policy]
        ref = run_ref(where, name, (a.to(to), b.to(to)), {})
        if out.is_floating_point():
            assert out.dtype == to, name
        if name in _IOPERATOR:
            # Apex's semantics (tensor_overrides' CASTS/FP32 lists): the cast self is a copy, so
            # ``a op= b`` rebinds a to the fp32 result and leaves the low tensor as it was.
            assert torch.equal(keep, before) and out is not keep, name
    assert_same(out, ref, f"{name} via operator ({low})")


# ---- fp64 and integers are never cast (a few entries per policy)

def _d(*shape):
    return r(*shape).double()


def _i(*shape):
    return torch.randint(-3, 4, shape, generator=_g)


UNTOUCHED = [
    ("lower", "torch", "mm", lambda lo: (_d(3, 4), _d(4, 5))),
    ("lower", "functional", "linear", lambda lo: (_d(3, 4), _d(5, 4), _d(5))),
    ("lower", "Tensor", "__matmul__", lambda lo: (_i(3, 4), _i(4, 5))),
    ("lower", "torch", "conv1d", lambda lo: (_d(1, 2, 8), _d(3, 2, 3))),
    ("fp32", "torch", "sum", lambda lo: (_i(3, 4),)),
    ("fp32", "torch", "cumsum", lambda lo: (_i(3, 4), 1)),
    ("fp32", "Tensor", "prod", lambda lo: (_i(3, 4),)),
    ("fp32", "functional", "softmax", lambda lo: (_d(3, 4), 1)),
    ("fp32", "torch", "exp", lambda lo: (_d(3, 4),)),
    ("fp32", "functional", "nll_loss", lambda lo: (torch.log_softmax(_d(3, 5), 1), idx(5, 3))),
    ("promote", "torch", "add", lambda lo: (_i(3, 4), _i(3, 4))),
    ("promote", "torch", "mul", lambda lo: (_d(3, 4), r(3, 4).to(lo))),  # f64 + low: torch's rules
    ("promote", "Tensor", "__eq__", lambda lo: (_i(3, 4), _i(3, 4))),
    ("promote", "torch", "atan2", lambda lo: (_d(3, 4), r(3, 4))),  # f64 + f32: no mix
    ("sequence_promote", "torch", "cat", lambda lo: ([_i(2, 3), _i(1, 3)],)),
    ("sequence_promote", "torch", "stack", lambda lo: ([_d(2, 3), r(2, 3).to(lo)],)),
    ("banned", "functional", "binary_cross_entropy",
     lambda lo: (torch.sigmoid(_d(3, 4)), torch.rand(3, 4, generator=_g).double())),
    ("inplace_fp32", "Tensor", "exp_", lambda lo: (_d(3, 4),)),
    ("inplace_fp32", "Tensor", "pow_", lambda lo: (_d(3, 4).abs() + 0.5, _d(3, 4))),
    ("inplace_fp32", "Tensor", "cumsum_", lambda lo: (_i(3, 4), 1)),
    ("match_self", "Tensor", "add_", lambda lo: (_d(3, 4), r(3, 4).to(lo))),  # f64 self: no cast
    ("match_self", "Tensor", "mul_", lambda lo: (_i(3, 4), _i(3, 4))),
    ("match_self", "Tensor", "addmm_", lambda lo: (_d(3, 5), _d(3, 4), _d(4, 5))),
]


@pytest.mark.parametrize("policy,where,name,make", UNTOUCHED,
                         ids=[f"{p}-{w}.{n}" for p, w, n, _ in UNTOUCHED])
def test_fp64_and_integers_untouched(o1, policy, where, name, make):
    assert lists.policy_of(_fn(where, name)) == policy
    _g.manual_seed(3)
    args = make(o1)
    out, casts = run_o1(where, name, args, {})
    ref = run_ref(where, name, args, {})
    assert casts == 0, f"{where}.{name}: {casts} casts of fp64/integer inputs"
    assert_same(out, ref, f"{where}.{name}")
    want = ref.dtype
    assert want in (torch.float64, torch.int64, torch.bool), want  # the case is not vacuous
    assert out.dtype == want
