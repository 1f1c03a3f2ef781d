"""What initialize does to models: dtypes of params/buffers/grads/outputs, forward patching (spec §4.1-4.2)."""
import collections
import copy
import inspect

import pytest
import torch
from torch import nn

from peak import amp

import amp_helpers as H


class Net(nn.Module):
    """Conv + BN (affine and not) + LayerNorm + Linear: every kind of module the casting rules name."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.bn_plain = nn.BatchNorm2d(4, affine=False)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 2)
        self.seen = None

    def forward(self, x):
        self.seen = x.dtype
        h = self.bn_plain(self.bn(self.conv(x)))
        h = h.mean(dim=(2, 3))
        return self.fc(self.ln(h))


def _expected_dtype(level, low, module_name, keep_bn=None):
    """The casting rules of the seeds, restated: O0/O1 keep fp32; O3 casts everything; O2 casts all but
    _BatchNorm modules (keep_batchnorm_fp32 defaults True for O2, False for O3)."""
    if level in ("O0", "O1"):
        return torch.float32
    keep = keep_bn if keep_bn is not None else (level == "O2")
    if keep and module_name.startswith("bn"):
        return torch.float32
    return low


@pytest.mark.parametrize("level, low", H.CONFIGS)
def test_param_buffer_grad_output_dtypes(level, low):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    H.init(model, opt, level, low)
    for name, p in model.named_parameters():
        assert p.dtype == _expected_dtype(level, low, name), name
    for name, b in model.named_buffers():
        if name.endswith("num_batches_tracked"):
            assert b.dtype == torch.int64
        else:
            assert b.dtype == _expected_dtype(level, low, name), name

    # fp64 input: O0/O2/O3 cast it (as Apex); O1 passes inputs through (autocast leaves fp64 alone, so
    # give O1 the usual fp32)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float32 if level == "O1" else torch.float64)
    out = model(x)
    expected_input = {"O0": torch.float32, "O1": torch.float32, "O2": low, "O3": low}[level]
    assert model.seen == expected_input  # O0 also casts inputs to fp32, as Apex
    expected_out = low if level == "O1" else torch.float32  # O1: autocast'ed Linear; O2/O3: cast back to fp32
    assert out.dtype == expected_out
    loss = out.float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
    if level == "O2":  # fp32 masters with fp32 grads in the optimizer
        for p in amp.master_params(opt):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


@pytest.mark.parametrize("level, keep", [("O2", False), ("O3", True), ("O2", "False"), ("O3", "True")])
def test_keep_batchnorm_override(level, keep):
    model = Net()
    amp.initialize(model, opt_level=level, keep_batchnorm_fp32=keep, verbosity=0)
    keep_bool = keep in (True, "True")
    for name, p in model.named_parameters():
        assert p.dtype == _expected_dtype(level, torch.float16, name, keep_bool), name
    assert model.bn_plain.running_mean.dtype == (torch.float32 if keep_bool else torch.float16)


def test_cast_model_type_false_leaves_model_alone():
    model = Net()
    amp.initialize(model, opt_level="O2", cast_model_type=False, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "forward" not in model.__dict__


def test_parameters_keep_identity():
    model = Net()
    params = list(model.parameters())
    amp.initialize(model, opt_level="O3", verbosity=0)
    assert all(a is b for a, b in zip(params, model.parameters()))


class Batch:
    """A custom batch class: amp calls its .to(dtype)."""

    def __init__(self, x):
        self.x = x

    def to(self, dtype):
        return Batch(self.x.to(dtype))


Pair = collections.namedtuple("Pair", "a b")


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        return {"out": self.fc(args[0]), "pair": Pair(self.fc(args[0]), torch.ones(1, dtype=torch.int64)),
                "list": [self.fc(args[0])]}


@pytest.mark.parametrize("low", H.DTYPES.values(), ids=H.DTYPES.keys())
def test_inputs_cast_recursively_outputs_to_fp32(low):
    model = Recorder()
    amp.initialize(model, opt_level="O2", cast_model_type=low, verbosity=0)
    x = torch.randn(3, 2)
    ids = torch.arange(3)
    od = collections.OrderedDict(k=torch.randn(1))
    out = model(x, [x, (x, ids)], Pair(x, "text"), Batch(x), od, flag="s", mapping={"m": x}, n=3)
    args, kwargs = model.args, model.kwargs
    assert args[0].dtype == low
    assert args[1][0].dtype == low and args[1][1][0].dtype == low and args[1][1][1].dtype == torch.int64
    assert isinstance(args[1], list) and isinstance(args[1][1], tuple)
    assert isinstance(args[2], Pair) and args[2].a.dtype == low and args[2].b == "text"
    assert isinstance(args[3], Batch) and args[3].x.dtype == low
    assert type(args[4]) is collections.OrderedDict and args[4]["k"].dtype == low
    assert kwargs["flag"] == "s" and kwargs["mapping"]["m"].dtype == low and kwargs["n"] == 3
    assert out["out"].dtype == torch.float32 and out["list"][0].dtype == torch.float32
    assert isinstance(out["pair"], Pair) and out["pair"].a.dtype == torch.float32
    assert out["pair"].b.dtype == torch.int64


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_cast_model_outputs(level):
    model = Recorder()
    amp.initialize(model, opt_level=level, cast_model_outputs=torch.float16, verbosity=0)
    out = model(torch.randn(3, 2))
    assert out["out"].dtype == torch.float16


@pytest.mark.parametrize("low", H.DTYPES.values(), ids=H.DTYPES.keys())
def test_o1_casts_inside_forward_and_disable_casts(low):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            a = self.fc(x)
            with amp.disable_casts():
                b = self.fc(x)
            return a, b, torch.nn.functional.mse_loss(a, a.detach())

    model = M()
    amp.initialize(model, opt_level="O1", low_precision_dtype=low, verbosity=0)
    a, b, s = model(torch.randn(2, 4))
    assert a.dtype == low  # matmul-class ops run in the low dtype
    assert b.dtype == torch.float32  # not under disable_casts
    assert s.dtype == torch.float32  # mse_loss is an fp32 op (on CPU and CUDA)
    assert model.fc.weight.dtype == torch.float32  # O1 keeps the weights fp32


@pytest.mark.parametrize("level, low", [c for c in H.CONFIGS if c.values[0] in ("O2", "O3")])
def test_state_dict_is_fp32_and_round_trips(level, low):
    model = Net()
    H.init(model, None, level, low)
    sd = model.state_dict()
    assert all(not v.is_floating_point() or v.dtype == torch.float32 for v in sd.values())
    fresh = Net()
    fresh.load_state_dict(sd)  # loads into a plain fp32 model
    other = Net()
    H.init(other, None, level, low)
    other.load_state_dict(sd)
    for (k, a), b in zip(model.state_dict(keep_vars=True).items(), other.state_dict(keep_vars=True).values()):
        assert a.dtype == b.dtype and torch.equal(a, b), k


def test_deepcopy_of_patched_model_is_independent():
    model = Net()
    amp.initialize(model, opt_level="O2", verbosity=0)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.fc.weight.zero_()
        twin.fc.bias.zero_()
    x = torch.randn(2, 3, 5, 5)
    assert torch.all(twin(x) == 0)
    assert not torch.all(model(x) == 0)
    assert twin.seen == torch.float16 and model.seen == torch.float16


class _RotaryAttention(nn.Module):
    """Llama's attention in small: q and k rotated by fp32 cos/sin (`mul` promotes them to fp32
    under O1) while v comes straight from a lowered linear."""

    def __init__(self, dim=8):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        angles = torch.arange(5.0)[:, None] * torch.linspace(0.1, 1.0, dim)[None]
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x):
        def rotate(t):
            return t * self.cos + torch.flip(t, dims=[-1]) * self.sin
        q, k, v = rotate(self.q(x)), rotate(self.k(x)), self.v(x)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("low", H.LOW)
def test_o1_runs_rotary_attention_as_torch_autocast(low):
    """O1 lowers scaled_dot_product_attention (beside Apex's lists, as torch.autocast does): with
    q and k promoted to fp32 and v low it raised for mixed dtypes (every Llama-like model)."""
    torch.manual_seed(0)
    model = _RotaryAttention()
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=low):
        expected = model(x)
    o1_model = amp.initialize(copy.deepcopy(model), opt_level="O1", low_precision_dtype=low,
                              verbosity=0)
    out = o1_model(x)
    assert out.dtype == expected.dtype == low
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


class _Positional(nn.Module):
    """A forward whose optional arguments callers look up by name (transformers' generate()
    passes position_ids only when the forward's signature names it)."""

    def __init__(self):
        super().__init__()
        self.embed, self.positions = nn.Embedding(10, 4), nn.Embedding(8, 4)

    def forward(self, input_ids, position_ids=None, *, attention_mask=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return self.embed(input_ids) + self.positions(position_ids)


def _generate_like(model, input_ids, attention_mask):
    """As transformers' generate(): positions from the mask (left padding), passed only to a
    forward that names position_ids."""
    kwargs = {}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids, **kwargs)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_patched_forward_shows_the_models_signature(level):
    """initialize's forward (it casts inputs and outputs) showed (*args, **kwargs): callers that
    read the signature left position_ids out, and left-padded rows got the pad tokens' positions
    (transformers' generate() under O1: other tokens, silently)."""
    torch.manual_seed(0)
    model = _Positional()
    reference = copy.deepcopy(model)
    expected_signature = inspect.signature(model.forward)
    model = amp.initialize(model, opt_level=level, low_precision_dtype=torch.bfloat16,
                           verbosity=0)
    assert inspect.signature(model.forward) == expected_signature
    assert inspect.signature(copy.deepcopy(model).forward) == expected_signature
    builtin = nn.ReLU()
    builtin.forward = torch.relu  # (an instance forward without a signature: the wrapper's)
    builtin = amp.initialize(builtin, opt_level=level, low_precision_dtype=torch.bfloat16,
                             verbosity=0)
    assert list(inspect.signature(builtin.forward).parameters) == ["args", "kwargs"]
    ids, mask = torch.tensor([[0, 0, 3, 4], [5, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1], [1] * 4])
    out = _generate_like(model, ids, mask)
    with torch.no_grad():  # (O1 runs embeddings and additions in fp32; O2/O3 in bf16)
        expected = _generate_like(reference.to(torch.float32 if level == "O1" else
                                               torch.bfloat16), ids, mask).float()
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("low", H.LOW)
def test_o1_turns_torchs_fused_encoder_path_off_as_autocast_does(low):
    """nn.TransformerEncoderLayer in eval under no_grad takes torch's fused kernel unless autocast
    is on; under O1 it was given a cast layer's fp16/bf16 output with fp32 weights and raised.
    Now it runs the path O1 casts, as in grad mode; the fast path is back where O1 is off."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True).eval()
    model = nn.Sequential(nn.Linear(8, 16), layer)
    x = torch.randn(2, 5, 8)
    o1 = amp.initialize(copy.deepcopy(model), opt_level="O1", low_precision_dtype=low,
                        verbosity=0)
    expected = o1(x)  # (grad mode: torch's own rules leave the fused path)
    assert not torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad():
        out = o1(x)
    torch.testing.assert_close(out, expected.detach(), rtol=0, atol=0)
    with amp.disable_casts():
        assert torch.backends.mha.get_fastpath_enabled()
    held = torch.backends.mha.get_fastpath_enabled  # (a caller's reference outlives the hook)
    from peak.amp import _caster  # noqa: PLC0415
    _caster.disable()
    assert held() and torch.backends.mha.get_fastpath_enabled()
