"""opt_level property tables, overrides, validation and verbosity output (seeds 000/001/004, spec §2)."""
import pytest
import torch

from peak import amp
from peak.amp import _caster
from peak.amp._amp_state import _amp_state
from peak.amp.frontend import Properties

import amp_helpers as H

# The seeds' tables, written out independently of the implementation.
SEED_TABLES = {
    "O0": dict(enabled=True, opt_level="O0", cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(enabled=True, opt_level="O1", cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic"),
    "O2": dict(enabled=True, opt_level="O2", cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(enabled=True, opt_level="O3", cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}


def _model_opt():
    m = H.make_mlp()
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.parametrize("level", H.LEVELS)
def test_level_defaults_match_seed_tables(level):
    props = amp.opt_levels[level](Properties())
    assert dict(props.options) == SEED_TABLES[level]
    assert list(props.options) == list(SEED_TABLES[level])  # print order


@pytest.mark.parametrize("level", H.LEVELS)
def test_initialize_without_overrides_keeps_table(level):
    m, o = _model_opt()
    amp.initialize(m, o, opt_level=level, verbosity=0)
    assert dict(_amp_state.opt_properties.options) == SEED_TABLES[level]


def _table(options):
    return "".join("{:22} : {}\n".format(k, v) for k, v in options.items())


def test_verbosity_1_prints_apex_tables(capsys):
    m, o = _model_opt()
    amp.initialize(m, o, opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128.0")
    after = dict(SEED_TABLES["O2"], keep_batchnorm_fp32=False, loss_scale=128.0)
    expected = (
        "Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n\n"
        "Defaults for this optimization level are:\n" + _table(SEED_TABLES["O2"])
        + "Processing user overrides (additional kwargs that are not None)...\n"
        + "After processing overrides, optimization options are:\n" + _table(after))
    assert capsys.readouterr().out == expected
    assert "loss_scale             : 128.0\n" in expected  # the literal Apex layout


def test_verbosity_1_o3_brief_has_no_trailing_blank_line(capsys):
    m, o = _model_opt()
    amp.initialize(m, o, opt_level="O3")
    out = capsys.readouterr().out
    assert out.startswith("Selected optimization level O3:  Pure FP16 training.\nDefaults for this")


def test_verbosity_0_prints_nothing(capsys):
    m, o = _model_opt()
    amp.initialize(m, o, opt_level="O2", verbosity=0)
    assert capsys.readouterr().out == ""


def test_low_precision_dtype_line_only_when_passed(capsys):
    m, o = _model_opt()
    amp.initialize(m, o, opt_level="O1", low_precision_dtype=torch.bfloat16)
    out = capsys.readouterr().out
    assert out.endswith("loss_scale             : 1.0\nlow_precision_dtype    : torch.bfloat16\n")


# ------------------------------------------------------------------------------------------ overrides
@pytest.mark.parametrize("kwargs, expected", [
    ({"keep_batchnorm_fp32": "True"}, {"keep_batchnorm_fp32": True}),
    ({"keep_batchnorm_fp32": "False"}, {"keep_batchnorm_fp32": False}),
    ({"master_weights": "False"}, {"master_weights": False}),
    ({"master_weights": False}, {"master_weights": False}),
    ({"loss_scale": "128.0"}, {"loss_scale": 128.0}),
    ({"loss_scale": 64}, {"loss_scale": 64.0}),
    ({"loss_scale": "dynamic"}, {"loss_scale": "dynamic"}),
    ({"cast_model_type": torch.bfloat16}, {"cast_model_type": torch.bfloat16, "loss_scale": 1.0}),
    ({"cast_model_type": torch.bfloat16, "loss_scale": "dynamic"},
     {"cast_model_type": torch.bfloat16, "loss_scale": "dynamic"}),
    ({"cast_model_type": False}, {"cast_model_type": False}),
], ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else None)
def test_o2_overrides(kwargs, expected):
    m, o = _model_opt()
    amp.initialize(m, o, opt_level="O2", verbosity=0, **kwargs)
    assert dict(_amp_state.opt_properties.options) == dict(SEED_TABLES["O2"], **expected)


def test_o1_patch_torch_functions_string_and_fp32_cast_type_are_legal():
    m, o = _model_opt()
    amp.initialize(m, o, opt_level="O1", verbosity=0, patch_torch_functions="True", cast_model_type=torch.float32)
    assert _amp_state.opt_properties.patch_torch_functions is True
    assert _amp_state.opt_properties.cast_model_type == torch.float32


@pytest.mark.parametrize("level, kwargs", [
    ("O0", {"cast_model_type": torch.float16}),  # "effectively O3"
    ("O3", {"master_weights": True}),
    ("O0", {"loss_scale": "dynamic"}),
    ("O3", {"keep_batchnorm_fp32": True}),
], ids=["O0-cast-f16", "O3-master", "O0-dynamic", "O3-keep-bn"])
def test_legal_unusual_combinations(level, kwargs):
    m, o = _model_opt()
    amp.initialize(m, o, opt_level=level, verbosity=0, **kwargs)
    for k, v in kwargs.items():
        assert getattr(_amp_state.opt_properties, k) == v


@pytest.mark.parametrize("level, kwargs, exc, fragment", [
    ("O1", {"master_weights": True}, RuntimeError, "It doesn't make sense to use master_weights with O1"),
    ("O1", {"master_weights": False}, RuntimeError, "It doesn't make sense to use master_weights with O1"),
    ("O1", {"keep_batchnorm_fp32": True}, RuntimeError, "keep_batchnorm_fp32 should be None"),
    ("O1", {"keep_batchnorm_fp32": "False"}, RuntimeError, "keep_batchnorm_fp32 was False"),
    ("O1", {"cast_model_type": torch.float16}, RuntimeError, "use opt_level='O2' or 'O3'"),
    ("O1", {"cast_model_type": torch.bfloat16}, RuntimeError, "low_precision_dtype=torch.bfloat16"),
    ("O0", {"patch_torch_functions": True}, RuntimeError, "should only be set by selecting opt_level='O1'"),
    ("O2", {"patch_torch_functions": True}, RuntimeError, "should only be set by selecting opt_level='O1'"),
    ("O3", {"patch_torch_functions": "True"}, RuntimeError, "should only be set by selecting opt_level='O1'"),
    ("O2", {"keep_batchnorm_fp32": "yes"}, ValueError, "the string 'True' or 'False', or None"),
    # Apex's check is a plain assert: a script catching AssertionError still catches it
    ("O2", {"keep_batchnorm_fp32": "maybe"}, AssertionError, "found keep_batchnorm_fp32='maybe'"),
    ("O2", {"master_weights": 1}, TypeError, "master_weights must be True, False"),
    ("O2", {"loss_scale": "big"}, ValueError, "'dynamic'"),
    ("O2", {"loss_scale": -1.0}, ValueError, "finite and >= 2**-127 (5.9e-39)"),
    # a scale whose reciprocal is inf in float32: the unscaled gradients would be NaN, unflagged
    ("O2", {"loss_scale": 1e-45}, ValueError, "finite and >= 2**-127 (5.9e-39)"),
    ("O2", {"max_loss_scale": 0.0}, ValueError, "max_loss_scale must be >= 1.18e-38"),
    ("O1", {"max_loss_scale": 1e-45}, ValueError, "max_loss_scale must be >= 1.18e-38"),
    ("O2", {"cast_model_type": "float8"}, TypeError, "cast_model_type must be one of torch.float16"),
    ("O2", {"cast_model_type": torch.int8}, TypeError, "cast_model_type must be a floating torch.dtype"),
    ("O2", {"low_precision_dtype": torch.float32}, ValueError, "low_precision_dtype must be"),
    ("O2", {"low_precision_dtype": torch.bfloat16, "cast_model_type": torch.float16}, ValueError, "disagree"),
    ("O2", {"num_losses": 0}, ValueError, "num_losses must be an int >= 1"),
    ("O2", {"cast_model_outputs": "fp64"}, TypeError, "cast_model_outputs must be"),
    ("O2", {"low_precision_dtype": "fp32"}, ValueError, "the strings 'fp16', 'float16', 'half', 'bf16'"),
    ("O2", {"min_loss_scale": 8.0, "max_loss_scale": 4.0}, ValueError, "must not exceed"),
    ("O2", {"loss_scale": True}, ValueError, "not a bool"),
    ("O2", {"enabled": "no"}, ValueError, "enabled must be True, False, the string 'True' or 'False'"),
])
def test_illegal_overrides_raise_and_change_nothing(level, kwargs, exc, fragment):
    m, o = _model_opt()
    before = H.snapshot(m, o)
    with pytest.raises(exc, match=None) as info:
        amp.initialize(m, o, opt_level=level, verbosity=0, **kwargs)
    assert fragment in str(info.value)
    assert not _amp_state.initialized
    assert "forward" not in m.__dict__ and not hasattr(o, "_amp_stash")
    H.assert_bitwise_equal(H.snapshot(m, o), before)
    # the same objects can still be initialized afterwards
    amp.initialize(m, o, opt_level=level, verbosity=0)


def test_enabled_given_as_the_string_false_turns_amp_off():
    """opt_levels.md: booleans may be the strings "True" and "False" (what argparse hands a
    script); ``enabled="False"`` (truthy as a string) is off, as ``enabled=False``."""
    m, o = _model_opt()
    before = H.snapshot(m, o)
    assert amp.initialize(m, o, opt_level="O2", verbosity=0, enabled="False") == (m, o)
    assert not _amp_state.opt_properties.enabled and amp.state_dict() == {}
    H.assert_bitwise_equal(H.snapshot(m, o), before)
    assert all(p.dtype == torch.float32 for p in m.parameters())
    amp.initialize(m, o, opt_level="O2", verbosity=0, enabled="True")
    assert _amp_state.opt_properties.enabled is True and amp.state_dict()


@pytest.mark.parametrize("bad", ["O4", "o1", "01", "O 2", None])
def test_unknown_opt_level_lists_valid_ones(bad):
    m, o = _model_opt()
    with pytest.raises(RuntimeError, match="Options are 'O0', 'O1', 'O2', 'O3'.*letter O, not the number zero"):
        amp.initialize(m, o, opt_level=bad, verbosity=0)


def test_unknown_property_is_an_error():
    with pytest.raises(TypeError):
        amp.initialize(*_model_opt(), opt_level="O2", keep_batchnorm_fp16=True)
    with pytest.raises(AttributeError, match="valid options are: enabled, opt_level"):
        Properties().fp16_everything = True
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        Properties().nope


def test_hard_override_turns_errors_into_warnings(capsys):
    _amp_state.hard_override = True
    m, o = _model_opt()
    amp.initialize(m, o, opt_level="O1", master_weights=True, verbosity=0)
    assert "Warning:  It doesn't make sense to use master_weights with O1" in capsys.readouterr().out
    assert _amp_state.opt_properties.master_weights is True


# ------------------------------------------------------------------------------------------ bf16
@pytest.mark.parametrize("level, expected_scale", [("O0", 1.0), ("O1", 1.0), ("O2", 1.0), ("O3", 1.0)])
def test_bf16_defaults_to_static_scale_one(level, expected_scale):
    m, o = _model_opt()
    amp.initialize(m, o, opt_level=level, verbosity=0, low_precision_dtype=torch.bfloat16)
    props = _amp_state.opt_properties
    assert props.loss_scale == expected_scale
    assert not _amp_state.loss_scalers[0].dynamic
    if level in ("O2", "O3"):
        assert props.cast_model_type == torch.bfloat16
        assert props.low_precision_dtype == torch.bfloat16
    elif level == "O1":
        assert props.low_precision_dtype == torch.bfloat16 and _caster.low_dtype() == torch.bfloat16
    else:
        assert props.cast_model_type == torch.float32 and props.low_precision_dtype is None


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp16_keeps_apex_dynamic_default(level):
    m, o = _model_opt()
    amp.initialize(m, o, opt_level=level, verbosity=0, low_precision_dtype=torch.float16)
    assert _amp_state.opt_properties.loss_scale == "dynamic"
    assert _amp_state.loss_scalers[0].dynamic and _amp_state.loss_scalers[0].loss_scale() == 2.0**16


def test_bf16_dynamic_on_request():
    m, o = _model_opt()
    amp.initialize(m, o, opt_level="O1", verbosity=0, low_precision_dtype=torch.bfloat16, loss_scale="dynamic")
    assert _amp_state.loss_scalers[0].dynamic


# ------------------------------------------------------------------------------------------ return shapes
def test_return_shapes():
    m, o = _model_opt()
    assert amp.initialize(m, verbosity=0) is m
    m, o = _model_opt()
    rm, ro = amp.initialize(m, o, verbosity=0)
    assert rm is m and ro is o
    m1, m2 = H.make_mlp(1), H.make_mlp(2)
    o = torch.optim.SGD(list(m1.parameters()) + list(m2.parameters()), lr=0.1)
    rms, ros = amp.initialize([m1, m2], [o], verbosity=0)
    assert isinstance(rms, list) and rms[0] is m1 and rms[1] is m2
    assert isinstance(ros, list) and ros[0] is o
    m = H.make_mlp(3)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    rm, ros = amp.initialize(m, [o], verbosity=0)
    assert rm is m and ros == [o]


def test_num_losses_creates_independent_scalers():
    m, o = _model_opt()
    amp.initialize(m, o, opt_level="O2", num_losses=3, verbosity=0, max_loss_scale=2.0**10)
    scalers = _amp_state.loss_scalers
    assert len(scalers) == 3 and len({id(s) for s in scalers}) == 3
    assert [s.loss_scale() for s in scalers] == [2.0**10] * 3  # max caps the initial scale
