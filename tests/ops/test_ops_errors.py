"""Bad input to the ops gets an error that names the argument and says what to do."""
import pytest
import torch

import peak
from peak import ops

_C = peak._C


def flag():
    return ops.new_found_inf()


def test_list_length_mismatch():
    with pytest.raises(RuntimeError, match=r"outputs has 1 tensors but inputs has 2"):
        ops.multi_tensor_scale_([torch.ones(3), torch.ones(3)], [torch.ones(3)], 1.0, flag())
    with pytest.raises(RuntimeError, match=r"ys has 2 tensors but xs has 1"):
        ops.multi_tensor_axpby_([torch.ones(3)], [torch.ones(3)] * 2, [torch.ones(3)], 1, 1, flag())


def test_numel_mismatch():
    with pytest.raises(RuntimeError,
                       match=r"outputs\[0\] has shape \[4\] but inputs\[0\] has shape \[3\]"):
        ops.multi_tensor_scale_([torch.ones(3)], [torch.ones(4)], 1.0, flag())


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.complex64])
def test_unsupported_dtype(dtype):
    with pytest.raises(RuntimeError,
                       match=r"inputs\[0\] has dtype .* supported dtypes are float32, float16 and bfloat16"):
        ops.multi_tensor_scale_([torch.ones(3, dtype=dtype)], [torch.ones(3)], 1.0, flag())
    with pytest.raises(RuntimeError, match="supported dtypes"):
        ops.multi_tensor_l2norm([torch.ones(3, dtype=dtype)])


def test_mixed_dtypes_within_a_list():
    with pytest.raises(RuntimeError,
                       match=r"inputs\[1\] has dtype Half but inputs\[0\] has Float; each list must have one dtype"):
        ops.multi_tensor_scale_([torch.ones(3), torch.ones(3).half()], [torch.ones(3)] * 2, 1.0, flag())


def test_tensors_on_different_devices():
    # The dispatcher would route a meta tensor elsewhere, so call the shared validation through
    # the emulated-grid entry point, which runs the same checks.
    with pytest.raises(RuntimeError, match=r"inputs\[1\] is on meta but inputs\[0\] is on cpu"):
        _C.emulated.multi_tensor_scale_([torch.ones(3), torch.ones(3, device="meta")],
                                        [torch.ones(3)] * 2, torch.ones(1), flag(), 8, 3, 4, 5)


def test_non_dense_input_goes_through_a_dense_copy():
    # Issue 15: a slice is handled inside the op (as ATen's can_use_fast_route), not rejected.
    base = torch.arange(24.0).reshape(4, 6)
    g = base[:, :5]
    out = torch.ones(4, 5)
    found = flag()
    ops.multi_tensor_scale_([g], [out], 2.0, found)
    assert torch.equal(out, g * 2) and found.item() == 0.0
    ops.multi_tensor_scale_([g], [g], 0.5, found)  # in place: only the slice changes
    assert torch.equal(base[:, :5], torch.arange(24.0).reshape(4, 6)[:, :5] * 0.5)
    assert torch.equal(base[:, 5], torch.arange(24.0).reshape(4, 6)[:, 5])


def test_transposed_tensors_are_handled_when_layouts_match():
    x = torch.randn(5, 7).t()
    out = torch.empty(7, 5).t().t()  # contiguous (7,5) -> wrong strides vs x (7,5) transposed
    with pytest.raises(RuntimeError,
                       match=r"outputs\[0\] has strides .* use the same memory format"):
        ops.multi_tensor_scale_([x], [out], 2.0, flag())
    out = torch.empty(5, 7).t()
    ops.multi_tensor_scale_([x], [out], 2.0, flag())
    assert torch.equal(out, x * 2)


@pytest.mark.parametrize("bad", [torch.zeros(1, dtype=torch.float64), torch.zeros(2),
                                 torch.zeros(1, dtype=torch.int32)],
                         ids=["f64", "two_elements", "int32"])
def test_bad_flag(bad):
    with pytest.raises(RuntimeError,
                       match=r"found_inf must be a Float tensor with one element on cpu"):
        ops.multi_tensor_scale_([torch.ones(3)], [torch.ones(3)], 1.0, bad)
    with pytest.raises(RuntimeError, match=r"found_inf must be a Float tensor"):
        ops.multi_tensor_axpby_([torch.ones(3)], [torch.ones(3)], [torch.ones(3)], 1, 1, bad)


def test_flag_on_wrong_device():
    with pytest.raises(RuntimeError,
                       match=r"found_inf must be a Float tensor with one element on cpu .*on meta"):
        _C.emulated.multi_tensor_scale_([torch.ones(3)], [torch.ones(3)], torch.ones(1),
                                        torch.zeros(1, device="meta"), 8, 3, 4, 5)


def test_bad_scale_tensor():
    with pytest.raises(RuntimeError, match=r"scale must be a Float tensor with one element"):
        ops.multi_tensor_scale_([torch.ones(3)], [torch.ones(3)], torch.ones(2), flag())
    with pytest.raises(TypeError, match="scale must be a float"):
        ops.multi_tensor_scale_([torch.ones(3)], [torch.ones(3)], "2", flag())


def test_not_a_list():
    with pytest.raises(TypeError, match="inputs must be a list or tuple of tensors"):
        ops.multi_tensor_scale_(torch.ones(3), [torch.ones(3)], 1.0, flag())


def test_bad_chunk_size_and_check():
    with pytest.raises(RuntimeError, match="chunk_size must be in"):
        ops.multi_tensor_scale_([torch.ones(3)], [torch.ones(3)], 1.0, flag(), chunk_size=0)
    with pytest.raises(ValueError, match="check must be one of"):
        ops.multi_tensor_axpby_([torch.ones(3)], [torch.ones(3)], [torch.ones(3)], 1, 1, flag(),
                                check="z")
    with pytest.raises(RuntimeError, match="check must be 0"):
        torch.ops.peak.multi_tensor_axpby_([torch.ones(3)], [torch.ones(3)], [torch.ones(3)],
                                           a=torch.ones(1), b=torch.ones(1), found_inf=flag(),
                                           check=7, chunk_size=64)
    with pytest.raises(RuntimeError, match=r"a must be a Float tensor with one element"):
        ops.multi_tensor_axpby_([torch.ones(3)], [torch.ones(3)], [torch.ones(3)],
                                torch.ones(2), 1.0, flag())


def test_empty_lists_are_a_no_op():
    f = flag()
    ops.multi_tensor_scale_([], [], 2.0, f)
    ops.multi_tensor_axpby_([], [], [], 1, 1, f)
    total, per = ops.multi_tensor_l2norm([])
    assert f.item() == 0 and total.item() == 0 and per.numel() == 0


def state(scale=1024.0, growth=0, hyst=None):
    s = torch.tensor([scale])
    g = torch.tensor([growth], dtype=torch.int32)
    h = None if hyst is None else torch.tensor([hyst], dtype=torch.int32)
    return s, g, h


def test_update_scale_bad_state():
    s, g, _ = state()
    with pytest.raises(RuntimeError, match=r"growth_tracker must be a Int tensor"):
        ops.update_scale_(s, g.float(), flag(), 2.0, 0.5, 10)
    with pytest.raises(RuntimeError, match=r"scale must be a Float tensor"):
        ops.update_scale_(s.double(), g, flag(), 2.0, 0.5, 10)
    with pytest.raises(RuntimeError, match=r"hysteresis=2 needs a hysteresis_tracker"):
        ops.update_scale_(s, g, flag(), 2.0, 0.5, 10, hysteresis=2)
    with pytest.raises(RuntimeError, match=r"growth_interval must be >= 1"):
        ops.update_scale_(s, g, flag(), 2.0, 0.5, 0)
    with pytest.raises(RuntimeError, match=r"at most 2\*\*31 - 1 \(int32 trackers\)"):
        ops.update_scale_(s, g, flag(), 2.0, 0.5, 2**32 + 1)  # (cast, it would be 1)
    with pytest.raises(RuntimeError, match=r"backoff_factor must be in \(0, 1\]"):
        ops.update_scale_(s, g, flag(), 2.0, 1.5, 10)
    with pytest.raises(RuntimeError, match=r"growth_factor must be >= 1"):
        ops.update_scale_(s, g, flag(), 0.5, 0.5, 10)
    with pytest.raises(RuntimeError, match=r"min_scale <= max_scale"):
        ops.update_scale_(s, g, flag(), 2.0, 0.5, 10, min_scale=4.0, max_scale=2.0)
    assert s.item() == 1024.0 and g.item() == 0, "a rejected update changes nothing"


def test_partial_overlap_between_output_and_input_is_an_error():
    buf = torch.randn(20)
    with pytest.raises(RuntimeError, match=r"outputs\[0\] partially overlaps inputs\[0\]"):
        ops.multi_tensor_scale_([buf[:10]], [buf[5:15]], 2.0, flag())
    with pytest.raises(RuntimeError, match=r"outputs\[0\] partially overlaps ys\[0\]"):
        ops.multi_tensor_axpby_([torch.ones(10)], [buf[:10]], [buf[1:11]], 1, 1, flag())


def test_a_meta_tensor_among_real_ones_is_refused():
    # The dispatcher sends such a call to the fake kernel, which computes nothing.
    x = [torch.ones(3)]
    with pytest.raises(RuntimeError, match="a meta tensor was passed with tensors on"):
        ops.multi_tensor_scale_(x, x, 2.0, torch.zeros(1, device="meta"))
    assert torch.equal(x[0], torch.ones(3))
