"""Shared test vocabulary: devices, dtypes with readable ids, per-dtype tolerances."""

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
             torch.float64: "f64"}

# Tolerances for results computed in fp32 and rounded once to the output dtype, compared with a
# float64 reference: half an ulp of the output dtype plus fp32 rounding on the way.
TOLERANCES = {
    torch.float32: dict(rtol=2e-6, atol=1e-30),
    torch.float16: dict(rtol=1e-3, atol=1e-7),
    torch.bfloat16: dict(rtol=8e-3, atol=1e-30),
}

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.cuda)]


def dtype_id(dt):
    return DTYPE_IDS[dt]


def assert_close_to_reference(actual, reference, dtype=None):
    """``actual`` against a float64 ``reference`` with the tolerance of ``dtype``."""
    dtype = dtype or actual.dtype
    torch.testing.assert_close(actual.double(), reference.double(), **TOLERANCES[dtype],
                               equal_nan=True)


def opcheck_op(op, args, kwargs=None, **options):
    """torch.library.opcheck over one of peak's ops, with the arguments written in schema order:
    the ones the schema makes keyword-only (NOTE: [Keyword-only scalars] in csrc/ops/schemas.h)
    are passed by name."""
    arguments = op._schema.arguments
    npos = sum(not a.kwarg_only for a in arguments)
    named = dict(zip([a.name for a in arguments if a.kwarg_only], args[npos:]))
    overlap = set(named) & set(kwargs or {})
    assert not overlap, f"given both positionally and by name: {sorted(overlap)}"
    named.update(kwargs or {})
    return torch.library.opcheck(op, tuple(args[:npos]), named, **options)
