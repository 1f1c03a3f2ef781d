"""The one place dtype arguments are read (``torch.dtype`` objects or the usual strings), so that
``"bf16"`` means the same at every peak entry point and a bad value gets the same error
(docs/integrations.md, "dtype strings"); and the one-time warning when fp16 is chosen on a CPU
whose fp16 matrix products are slower than bf16's (docs/integrations.md, "fp16 on the CPU")."""
from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["parse_dtype", "DTYPE_NAMES", "LOW_PRECISION", "FLOATING", "MOMENT_STORAGE",
           "warn_if_slow_fp16", "fp16_cpu_slowdown"]

#: The strings accepted for each dtype (compared case-insensitively; a leading "torch." is ignored).
DTYPE_NAMES = {
    torch.float16: ("fp16", "float16", "half"),
    torch.bfloat16: ("bf16", "bfloat16"),
    torch.float32: ("fp32", "float32", "float"),
    # Only as an optimizer's moment storage: 8-bit block-quantized moments (codes and per-block
    # scales; "Lean optimizer state" in docs/core.md).
    torch.uint8: ("8bit", "uint8"),
}
_BY_NAME = {name: dtype for dtype, names in DTYPE_NAMES.items() for name in names}

LOW_PRECISION = (torch.float16, torch.bfloat16)
FLOATING = (torch.float16, torch.bfloat16, torch.float32)
#: What a fused optimizer's ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` / ``momentum_dtype`` take
#: (torch.uint8: 8-bit block-quantized).
MOMENT_STORAGE = (torch.float32, torch.bfloat16, torch.uint8)


class DtypeArgumentError(TypeError, ValueError):
    """A dtype argument peak cannot read. Both a TypeError (a value of the wrong kind, which is
    what torch raises for a non-dtype) and a ValueError (a dtype outside the accepted ones)."""


def parse_dtype(value, argument: str, accepted=LOW_PRECISION, *, allow_none: bool = True,
                any_dtype: bool = False):
    """``value`` as a ``torch.dtype``.

    Args:
        value: a ``torch.dtype``, one of the strings of :data:`DTYPE_NAMES` (``"bf16"``,
            ``"fp16"``, ``"half"``, ``"fp32"``, ...), or None.
        argument: the argument's name as the caller wrote it, for the error message
            (``"low_precision_dtype"``, ``"autocast: dtype"``).
        accepted: the dtypes this argument takes.
        allow_none: None passes through (the argument's default).
        any_dtype: every ``torch.dtype`` object passes (torch's own contract, e.g.
            ``custom_fwd(cast_inputs=torch.int32)``); strings still name one of ``accepted``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, torch.dtype) and (any_dtype or value in accepted):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        key = key[len("torch."):] if key.startswith("torch.") else key
        dtype = _BY_NAME.get(key)
        if dtype in accepted:
            return dtype
    dtypes = "a torch.dtype" if any_dtype else "one of " + ", ".join(str(d) for d in accepted)
    strings = ", ".join(repr(n) for d in accepted for n in DTYPE_NAMES.get(d, ()))
    none = " or None" if allow_none else ""
    raise DtypeArgumentError(f"{argument} must be {dtypes}{none}, or one of the strings {strings}; "
                             f"got {argument.split(': ')[-1]}={value!r}")


# ---- fp16 on the CPU
# Slowdowns of fp16 against bf16 measured with benchmarks/fp16_vs_bf16_cpu.py on this project's CI
# machine (docs/integrations.md, "fp16 on the CPU", has the table, the method and the CPU kinds).
FP16_SLOWDOWN_AMX_BF16_ONLY = "5-8x"  # AVX512-FP16, AMX-BF16, no AMX-FP16 (this machine)
FP16_SLOWDOWN_NO_FP16 = "180-1000x"  # neither AVX512-FP16 nor AMX-FP16: torch's fallback GEMM


def _cpu_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def fp16_cpu_slowdown() -> str | None:
    """How much slower than bf16 torch's fp16 matrix products run on this CPU (the measured
    figure, as text), or None where they are not slower or the flags are unknown (not Linux).

    torch (through oneDNN's checks) runs bf16 products on oneDNN from AVX-512 (or AVX2-VNNI-2) on,
    fp16 products only with AVX512-FP16 (or AVX2-VNNI-2), and the rest on its fallback GEMM, where
    bf16 is no faster (AVX2 only: fp32 is the fast type there, so None)."""
    flags = _cpu_flags()
    if not flags or "amx_fp16" in flags or {"avx_ne_convert", "avx_vnni_int8"} <= flags:  # VNNI-2
        return None
    if "avx512_fp16" in flags:
        return FP16_SLOWDOWN_AMX_BF16_ONLY if "amx_bf16" in flags else None
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:  # AVX-512
        return FP16_SLOWDOWN_NO_FP16
    return None


_warned_slow_fp16 = False


def warn_if_slow_fp16(dtype, device_type, *, fix: str, stacklevel: int = 3) -> None:
    """Warn once per process when fp16 is chosen for the CPU and this CPU computes fp16 matrix
    products markedly slower than bf16. ``fix`` names the argument to change, as the caller
    spells it (``"low_precision_dtype=torch.bfloat16"``)."""
    global _warned_slow_fp16
    if _warned_slow_fp16 or dtype != torch.float16 or str(device_type) != "cpu":
        return
    slowdown = fp16_cpu_slowdown()
    if slowdown is None:
        return
    _warned_slow_fp16 = True
    flags = _cpu_flags()
    has = [f.upper().replace("_", "-") for f in ("avx512_fp16", "amx_bf16") if f in flags]
    warnings.warn(
        f"peak: fp16 chosen on a CPU without AMX-FP16 ({', '.join(has) or 'no AVX512-FP16'}): "
        f"torch's fp16 matrix products run about {slowdown} slower than bf16 on such a CPU "
        f"(measured; see docs/integrations.md). Pass {fix}: bf16 has fp32's "
        f"range, so it needs no loss scaling. This warning is shown once per process.",
        UserWarning, stacklevel=stacklevel)
