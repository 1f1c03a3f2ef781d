"""Dtype strings wherever peak takes a dtype (one parser, one error), and the one-time warning for
fp16 on a CPU that computes fp16 slower than bf16."""
import warnings

import pytest
import torch

from peak import _dtypes, amp
from peak.amp import _caster
from peak.amp._amp_state import _amp_state

SPELLINGS = {
    torch.float16: ["fp16", "float16", "half", "FP16", "torch.float16", " half "],
    torch.bfloat16: ["bf16", "bfloat16", "BF16", "torch.bfloat16"],
}


@pytest.fixture(autouse=True)
def fresh_state():
    _caster.disable()
    _amp_state.reset()
    yield
    _caster.disable()
    _amp_state.reset()


def _model_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("dtype, spelling", [(d, s) for d, ss in SPELLINGS.items() for s in ss])
def test_parser_reads_every_spelling(dtype, spelling):
    assert _dtypes.parse_dtype(spelling, "x") is dtype
    assert _dtypes.parse_dtype(dtype, "x") is dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_initialize_with_a_string_is_initialize_with_the_dtype(opt_level, dtype):
    """The same run, bit for bit, whether the dtype is named by a string or a torch.dtype."""
    results = []
    for spelling in (dtype, SPELLINGS[dtype][0], SPELLINGS[dtype][1]):
        _caster.disable()
        _amp_state.reset()
        model, optimizer = _model_opt()
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                          low_precision_dtype=spelling, verbosity=0)
        assert _amp_state.opt_properties.low_precision_dtype is dtype
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        loss = model(x).float().pow(2).mean()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_cast_model_type_and_outputs_take_strings():
    model, optimizer = _model_opt()
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", cast_model_type="bf16",
                                      cast_model_outputs="fp16", verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16
    assert model(torch.randn(2, 8)).dtype == torch.float16


def test_autocast_and_custom_fwd_take_strings():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for dtype, spellings in SPELLINGS.items():
        for spelling in spellings:
            with amp.autocast("cpu", dtype=spelling) as region:
                assert torch.mm(a, b).dtype == dtype
                assert region.fast_dtype == dtype

    class Doubled(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu", cast_inputs="fp32")
        def forward(ctx, x):
            Doubled.seen = x.dtype
            return x * 2

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            return grad * 2

    with amp.autocast("cpu", dtype="bf16"):
        Doubled.apply(torch.randn(3, dtype=torch.bfloat16))
    assert Doubled.seen == torch.float32
    # custom_fwd keeps torch's contract for dtype objects: any dtype
    amp.custom_fwd(device_type="cpu", cast_inputs=torch.float64)


@pytest.mark.parametrize("call, fragment", [
    (lambda: amp.initialize(*_model_opt(), opt_level="O2", low_precision_dtype="fp8", verbosity=0),
     "low_precision_dtype must be one of torch.float16, torch.bfloat16 or None, or one of the strings "
     "'fp16', 'float16', 'half', 'bf16', 'bfloat16'; got low_precision_dtype='fp8'"),
    (lambda: amp.initialize(*_model_opt(), opt_level="O2", low_precision_dtype="fp32", verbosity=0),
     "got low_precision_dtype='fp32'"),
    (lambda: amp.initialize(*_model_opt(), opt_level="O2", cast_model_type="int8", verbosity=0),
     "cast_model_type must be one of torch.float16, torch.bfloat16, torch.float32"),
    (lambda: amp.autocast("cpu", dtype="brain float"),
     "autocast: dtype must be a torch.dtype or None, or one of the strings 'fp16'"),
    (lambda: amp.autocast("cpu", dtype=16), "got dtype=16"),
    (lambda: amp.custom_fwd(device_type="cpu", cast_inputs="double"),
     "custom_fwd: cast_inputs must be a torch.dtype or None, or one of the strings 'fp16', 'float16', "
     "'half', 'bf16', 'bfloat16', 'fp32', 'float32', 'float'; got cast_inputs='double'"),
])
def test_bad_dtype_names_the_argument_and_the_accepted_values(call, fragment):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert fragment in str(info.value)
    # both kinds, so code written against either (torch raises TypeError for non-dtypes) catches it
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert not _amp_state.initialized


# ---------------------------------------------------------------------------------------------- fp16 warning
@pytest.fixture
def cpu_flags(monkeypatch):
    """Pretend to be a CPU with the given /proc/cpuinfo flags; the warning not yet shown."""
    def set_flags(*flags):
        monkeypatch.setattr(_dtypes, "_cpu_flags", lambda: frozenset(flags))
        _dtypes.fp16_cpu_slowdown.cache_clear()
        monkeypatch.setattr(_dtypes, "_warned_slow_fp16", False)
    yield set_flags
    _dtypes.fp16_cpu_slowdown.cache_clear()


AVX512 = ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")


@pytest.mark.parametrize("flags, slowdown", [
    (AVX512, _dtypes.FP16_SLOWDOWN_NO_FP16),                            # Skylake-SP .. Ice Lake
    (AVX512 + ("avx512_bf16",), _dtypes.FP16_SLOWDOWN_NO_FP16),         # Cooper Lake, AMD Zen 4
    (AVX512 + ("avx512_fp16", "amx_bf16", "amx_tile"), _dtypes.FP16_SLOWDOWN_AMX_BF16_ONLY),  # SPR
    (AVX512 + ("avx512_fp16",), None),
    (AVX512 + ("avx512_fp16", "amx_bf16", "amx_fp16"), None),          # Granite Rapids
    (("avx2", "f16c"), None),              # bf16 is on torch's fallback GEMM too: no bf16 advice
    (("avx2", "avx_vnni", "avx_ne_convert", "avx_vnni_int8"), None),    # AVX2-VNNI-2: both fast
    ((), None),                            # flags unreadable (not Linux): no claim, no warning
])
def test_slowdown_follows_the_cpu_flags(cpu_flags, flags, slowdown):
    cpu_flags(*flags)
    assert _dtypes.fp16_cpu_slowdown() == slowdown


def test_reads_this_machines_flags():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    assert _dtypes._cpu_flags() == frozenset(flags)


@pytest.mark.parametrize("entry, fix", [
    (lambda: amp.initialize(*_model_opt(), opt_level="O2", verbosity=0), "low_precision_dtype=torch.bfloat16"),
    (lambda: amp.initialize(*_model_opt(), opt_level="O1", low_precision_dtype="half", verbosity=0),
     "low_precision_dtype=torch.bfloat16"),
    (lambda: amp.autocast("cpu", dtype=torch.float16), "dtype=torch.bfloat16"),
])
def test_fp16_on_a_slow_cpu_warns_once_naming_the_fix(cpu_flags, entry, fix):
    cpu_flags(*AVX512)
    with pytest.warns(UserWarning, match="fp16 chosen on a CPU without AMX-FP16") as record:
        entry()
    (warning,) = [w for w in record if "AMX-FP16" in str(w.message)]
    message = str(warning.message)
    assert fix in message and _dtypes.FP16_SLOWDOWN_NO_FP16 + " slower than bf16" in message
    assert warning.filename == __file__  # points at the caller's line
    _caster.disable()
    _amp_state.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entry()  # once per process


def test_no_warning_for_bf16_fp32_other_devices_or_fast_fp16(cpu_flags):
    cpu_flags(*AVX512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.initialize(*_model_opt(), opt_level="O2", low_precision_dtype="bf16", verbosity=0)
        _amp_state.reset()
        amp.initialize(*_model_opt(), opt_level="O0", verbosity=0)   # fp32: no low dtype
        amp.autocast("cpu", dtype="bf16")
        amp.autocast("cpu", dtype="fp16", enabled=False)
        _dtypes.warn_if_slow_fp16(torch.float16, "cuda", fix="x")
        cpu_flags("avx512_fp16")
        amp.autocast("cpu", dtype="fp16")
