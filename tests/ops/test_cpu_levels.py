"""The CPU kernels' levels (NOTE: [CPU levels] in csrc/ops/cpu_dispatch.cpp; docs/build.md).

Every level this CPU runs computes the same bits as every other (the same inputs through every
op, compared as integers); PEAK_CPU_LEVEL forces a level, and a level that cannot run is refused
with its reason; the built module holds AVX code only in functions named after a level (so that
no baseline path can reach it). The kernel test files under each forced level: test_wheel.py.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import peak
from peak import ops
from peak.optimizers import FusedAdam, FusedLAMB, FusedSGD

LEVELS = ops.cpu_levels()
SUPPORTED = LEVELS["supported"]
REPO = Path(__file__).resolve().parents[2]
DISPATCH_BUILD = len(LEVELS["compiled"]) > 1
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Sizes around the vector widths (8, 16) and tiles (256, 512, 1024: NOTE: [Tile size] in
# csrc/core/cpu_apply.h) and across a chunk boundary (65536).
SIZES = [1, 7, 8, 15, 17, 33, 255, 257, 1000, 1025, 4099, 65536 + 77]


@pytest.fixture(autouse=True)
def _restore_level():
    before = ops.cpu_level()
    yield
    peak._C._set_cpu_level(before)


def _values(n, dtype, gen, special=True):
    """Normal, large, tiny and subnormal magnitudes; with `special`, some infs and NaNs too."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 12, (n,), generator=gen).float())
    if n > 20:
        x[1::13] = torch.randn(len(x[1::13]), generator=gen) * 1e-39  # fp32 subnormals
        x[5::17] = torch.randn(len(x[5::17]), generator=gen) * 3e-6   # fp16 subnormal range
    if n > 60:
        # fp16's edges: largest finite, the rounding boundary to inf, beyond; smallest
        # subnormal and the halfway points around it; a tie to even.
        edges = [65504.0, 65519.996, 65520.0, 1e5, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001,
                 3 * 2.0**-26, 1.0 + 2.0**-11, 6.1e-5, 2.0**-14 - 2.0**-25]
        x[40:40 + len(edges)] = torch.tensor(edges)
        x[41:41 + len(edges):2] *= -1
    if special and n > 40:
        x[3] = float("inf")
        x[11] = float("-inf")
        x[29] = float("nan")
    return x.to(dtype)


def _lists(dtype, seed, special=True):
    gen = torch.Generator().manual_seed(seed)
    return [_values(n, dtype, gen, special) for n in SIZES]


def _bits(t):
    return t.contiguous().view(BITS[t.dtype]).clone() if t.dtype in BITS else t.clone()


# Bit patterns of a NaN, per storage width (fp32; fp16 and bf16 share int16 views).
def _nan_mask(bits, dtype):
    if dtype == torch.float32:
        return (bits & 0x7FFFFFFF) > 0x7F800000
    if dtype == torch.float16:
        return (bits & 0x7FFF) > 0x7C00
    if dtype == torch.bfloat16:
        return (bits & 0x7FFF) > 0x7F80
    return torch.zeros_like(bits, dtype=torch.bool)


def _run_elementwise():
    """Every elementwise op over every dtype combination; returns name -> result tensors."""
    out = {}
    for din in DTYPES:
        for dout in DTYPES:
            xs = _lists(din, 1)
            ys = [torch.empty_like(x, dtype=dout) for x in xs]
            found = ops.new_found_inf()
            per = torch.zeros(len(xs))
            ops.multi_tensor_scale_(xs, ys, 1.0 / 3.0, found, per_tensor_found_inf=per)
            out[f"scale {din}->{dout}"] = ys + [found, per]
            for check in ["none", "both"]:
                a = _lists(din, 2, special=check == "both")
                b = _lists(dout, 3, special=check == "both")
                o = [torch.empty_like(x, dtype=dout) for x in a]
                found = ops.new_found_inf()
                ops.multi_tensor_axpby_(a, b, o, 0.7, -1.3, found, check=check)
                out[f"axpby {din},{dout} {check}"] = o + [found]
        finite = _lists(din, 4, special=False)
        total, per = ops.multi_tensor_l2norm(finite, per_tensor=True)
        out[f"l2norm {din}"] = [total, per]
        found = ops.new_found_inf()
        per = torch.zeros(len(SIZES))
        ops.multi_tensor_check_finite_(_lists(din, 5), found, per_tensor_found_inf=per)
        out[f"check_finite {din}"] = [found, per]
    return out


def _train(opt_cls, dtype, steps=3, **kw):
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(_values(n, torch.float32, gen, special=False).to(dtype))
              for n in SIZES]
    opt = opt_cls(params, lr=1e-2, **kw)
    for _ in range(steps):
        for p in params:
            p.grad = _values(p.numel(), torch.float32, gen, special=False).to(dtype)
        opt.step()
    # The state holds the moments, step counts and fp32 master weights.
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach() for p in params] + state


def _run_optimizers():
    out = {}
    for dtype in DTYPES:
        out[f"adam {dtype}"] = _train(FusedAdam, dtype, weight_decay=0.01)
        out[f"adamw amsgrad {dtype}"] = _train(FusedAdam, dtype, adam_w_mode=True, amsgrad=True,
                                               weight_decay=0.1)
        out[f"adam clipped {dtype}"] = _train(FusedAdam, dtype, max_grad_norm=0.5)
        out[f"sgd nesterov {dtype}"] = _train(FusedSGD, dtype, momentum=0.9, nesterov=True,
                                              weight_decay=1e-4)
        out[f"lamb {dtype}"] = _train(FusedLAMB, dtype)
    out["adam bf16 stochastic rounding"] = _train(FusedAdam, torch.bfloat16, master_weights=False,
                                                  stochastic_rounding=True)
    # The lean states (each its own kernel instantiation): moments in bf16 and in 8 bits, bf16
    # masters as remainders, gradients not stored back.
    for moments in ("bf16", "8bit"):
        for dtype in (torch.float32, torch.bfloat16):
            out[f"adam {moments} moments {dtype}"] = _train(
                FusedAdam, dtype, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
        out[f"sgd {moments} momentum"] = _train(FusedSGD, torch.bfloat16, momentum=0.9,
                                                momentum_dtype=moments)
    out["adam bf16 remainders"] = _train(FusedAdam, torch.bfloat16, store_param_remainders=True)
    out["adam remainders 8bit"] = _train(FusedAdam, torch.bfloat16, store_param_remainders=True,
                                         exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit")
    out["adam fp16 grads kept scaled"] = _train(FusedAdam, torch.float16,
                                                store_unscaled_grads=False)
    out["sgd bf16 stochastic rounding"] = _train(FusedSGD, torch.bfloat16, momentum=0.9,
                                                 master_weights=False, stochastic_rounding=True)
    return out


def _at_every_level(run):
    results = {}
    for level in SUPPORTED:
        peak._C._set_cpu_level(level)
        assert ops.cpu_level() == level
        results[level] = {k: [(_bits(t), t.dtype) for t in v] for k, v in run().items()}
    return results


def _assert_same_bits(results, any_nan=False):
    """Bit-for-bit equal results at every level. any_nan: a NaN matches any NaN (sign and payload
    of a NaN computed from two NaN/inf operands are not promised: see docs/build.md)."""
    ref_level = SUPPORTED[0]
    ref = results[ref_level]
    for level in SUPPORTED[1:]:
        for name, tensors in results[level].items():
            for i, ((a, dtype), (b, _)) in enumerate(zip(ref[name], tensors)):
                differ = a != b
                if any_nan:
                    nan_a, nan_b = _nan_mask(a, dtype), _nan_mask(b, dtype)
                    differ = (nan_a != nan_b) | (differ & ~nan_a)
                diff = differ.nonzero()
                assert diff.numel() == 0, (
                    f"{name}, tensor {i}: level {level} differs from {ref_level} at "
                    f"{diff.flatten()[:5].tolist()} ({a.flatten()[diff[0]].tolist()} vs "
                    f"{b.flatten()[diff[0]].tolist()} as integers)")


@pytest.mark.skipif(len(SUPPORTED) < 2, reason=f"this build/CPU has one level only: {SUPPORTED}")
def test_elementwise_ops_same_bits_at_every_level():
    # Strict, NaNs included: each NaN output comes from one NaN input (or the same NaN in both of
    # axpby's inputs), so its bits are determined.
    _assert_same_bits(_at_every_level(_run_elementwise))


@pytest.mark.skipif(len(SUPPORTED) < 2, reason=f"this build/CPU has one level only: {SUPPORTED}")
def test_fused_optimizers_same_bits_at_every_level():
    # fp16 training meets overflow here (the inputs reach 1e5): inf, then NaN, in the steps.
    _assert_same_bits(_at_every_level(_run_optimizers), any_nan=True)


@pytest.mark.skipif(len(SUPPORTED) < 2, reason=f"this build/CPU has one level only: {SUPPORTED}")
def test_nan_payloads_convert_alike_at_every_level():
    # NaNs with payloads (not only the default NaN) through fp16/bf16 stores and loads.
    payloads = torch.tensor([0x7FC00001, 0x7FA00000, 0xFFC12345 - 2**32, 0x7F800001, 0x7FFFFFFF],
                            dtype=torch.int32).view(torch.float32).repeat(40)

    def run():
        out = {}
        for dout in DTYPES:
            y = torch.empty(len(payloads), dtype=dout)
            ops.multi_tensor_scale_([payloads.clone()], [y], 1.0, ops.new_found_inf())
            back = torch.empty(len(payloads), dtype=torch.float32)
            ops.multi_tensor_scale_([y], [back], 1.0, ops.new_found_inf())
            out[f"nan payload ->{dout}"] = [y, back]
        return out
    _assert_same_bits(_at_every_level(run))


def test_cpu_levels_report():
    assert ops.cpu_level() == LEVELS["active"]
    assert LEVELS["active"] in LEVELS["supported"]
    assert set(LEVELS["supported"]) <= set(LEVELS["compiled"])
    assert LEVELS["compiled"] == peak._C.build_info()["cpu_levels_compiled"].split(",")
    if DISPATCH_BUILD and LEVELS["forced"] is None:
        assert LEVELS["active"] == LEVELS["supported"][-1], "the default is the best level"
    if peak._C.build_info()["cpu_isa"] == "dispatch" and sys.platform == "linux" \
            and os.uname().machine == "x86_64":
        assert LEVELS["compiled"] == ["baseline", "avx2", "avx512"]
        assert "baseline" in LEVELS["supported"]


def test_set_level_refuses_unknown_names():
    with pytest.raises(RuntimeError, match=r"level=sse9 is not a CPU level of this build\. "
                                           r"Accepted values: auto, " + ", ".join(LEVELS["compiled"])):
        peak._C._set_cpu_level("sse9")


def _python(code, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("PEAK_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full,
                          cwd=REPO)


@pytest.mark.parametrize("level", LEVELS["compiled"])
def test_env_var_forces_each_supported_level(level):
    r = _python("from peak import ops; print(ops.cpu_levels())", PEAK_CPU_LEVEL=level)
    if level in SUPPORTED:
        assert r.returncode == 0, r.stderr
        assert f"'active': '{level}'" in r.stdout and f"'forced': '{level}'" in r.stdout
    else:
        assert "this CPU lacks" in r.stderr


def test_env_var_ignores_case():
    level = SUPPORTED[0]
    r = _python("from peak import ops; print(ops.cpu_level())", PEAK_CPU_LEVEL=level.upper())
    assert r.returncode == 0 and r.stdout.strip() == level, r.stderr


def test_env_var_unknown_level_is_refused_at_import():
    r = _python("import peak", PEAK_CPU_LEVEL="avx1024")
    assert r.returncode != 0
    msg = r.stderr.strip().splitlines()[-1]
    assert msg.startswith("ImportError: peak: PEAK_CPU_LEVEL=avx1024 is not a CPU level of this "
                          "build. Accepted values: auto, " + ", ".join(LEVELS["compiled"])), msg


@pytest.mark.skipif(not DISPATCH_BUILD, reason="a single-level build has no level to lack")
def test_env_var_level_the_cpu_lacks_is_refused_at_import():
    # PEAK_TESTING_CPU_MAX_LEVEL hides the levels above it, as on an older CPU.
    lowest, top = LEVELS["compiled"][0], LEVELS["compiled"][-1]
    r = _python("import peak", PEAK_CPU_LEVEL=top, PEAK_TESTING_CPU_MAX_LEVEL=lowest)
    assert r.returncode != 0
    msg = r.stderr.strip().splitlines()[-1]
    assert re.match(rf"ImportError: peak: PEAK_CPU_LEVEL={top}, but this CPU lacks .+\. Levels this "
                    rf"CPU runs: {lowest} \(or auto\)\.$", msg), msg
    # ... and without the variable, the best level the (pretended) CPU runs is chosen.
    r = _python("from peak import ops; print(ops.cpu_level())", PEAK_TESTING_CPU_MAX_LEVEL=lowest)
    assert r.returncode == 0 and r.stdout.strip() == lowest, r.stderr


def test_python_m_peak_info_names_the_level():
    r = subprocess.run([sys.executable, "-m", "peak.info"], capture_output=True, text=True,
                       env={**os.environ, "PEAK_CPU_LEVEL": SUPPORTED[0]})
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^cpu_level +{SUPPORTED[0]} \(forced by PEAK_CPU_LEVEL={SUPPORTED[0]}\)$",
                     r.stdout, re.M), r.stdout
    assert re.search(r"^cpu_levels_compiled +" + ",".join(LEVELS["compiled"]) + "$", r.stdout, re.M)


def _functions_with_avx(so):
    """(name, is_global) of every function in `so` holding a VEX/EVEX instruction."""
    symbols = {}
    for line in subprocess.run(["nm", "--defined-only", so], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3:
            symbols[(int(parts[0], 16), parts[2])] = parts[1]
    found = {}
    current = None
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True,
                         text=True, check=True).stdout
    for line in dis.splitlines():
        m = re.match(r"^([0-9a-f]+) <(.+)>:$", line)
        if m:
            current = (int(m.group(1), 16), m.group(2))
            continue
        fields = line.split("\t")
        if current is None or len(fields) < 2:
            continue
        insn = fields[-1].strip()
        mnemonic = insn.split(" ")[0]
        operands = insn[len(mnemonic):].split("<")[0]
        if mnemonic.startswith("v") or re.search(r"%[xyz]mm(1[6-9]|2\d|3[01])|%[yz]mm|%k[0-7]\b",
                                                 operands):
            kind = symbols.get(current, "?")
            found[current[1]] = kind.isupper()  # T/W: global or weak (link-once); t: local
    return found


@pytest.mark.skipif(not DISPATCH_BUILD or os.uname().machine != "x86_64",
                    reason="a single-level build is all one level (nothing to keep apart)")
@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("nm") is None,
                    reason="binutils (objdump, nm) not installed")
def test_avx_code_only_in_functions_of_a_level():
    # A global/weak function with AVX instructions that is not named after a level could be a
    # link-once copy that baseline code calls too (NOTE: [CPU levels]): on a CPU without AVX,
    # an illegal instruction. Local ones (GCC's .constprop/.isra clones) are private to the
    # object that made them, so to its level.
    found = _functions_with_avx(peak._C.__file__)
    in_levels = [n for n in found if re.search(r"3cpu(4avx2|6avx512)", n)]
    assert in_levels, "no AVX code in the avx2/avx512 levels: were they built with their flags?"
    stray = sorted(n for n, is_global in found.items() if is_global and n not in in_levels)
    assert not stray, f"AVX code outside the level namespaces: {stray[:10]}"
