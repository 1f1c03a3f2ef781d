"""8-bit block-quantized moments outside the step: a checkpoint's moments to and from codes and
scales. The format is NOTE: [8-bit moments] in csrc/core/block_quant.h (docs/core.md, "8-bit
moments"); these float32 torch expressions follow the kernels' operations in the same order, so a
moment quantized here codes as the kernels would code it."""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

BLOCK = 256
# (exponent bits, mantissa bits, signed, sqrt-coded) per moment key.
FORMATS = {"exp_avg": (3, 4, True, False), "momentum_buffer": (3, 4, True, False),
           "exp_avg_sq": (3, 5, False, True)}


def scale_key(key: str) -> str:
    return key + "_scale"


def num_blocks(numel: int) -> int:
    return math.ceil(numel / BLOCK)


def _memory_order(x: Tensor) -> list[int]:
    """Dims from outermost to innermost in memory: the kernels walk (and block) a tensor in
    memory order, which is the logical order only for contiguous tensors."""
    return sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))


def _unflat(flat: Tensor, like: Tensor, dtype) -> Tensor:
    out = torch.empty_like(like, dtype=dtype, memory_format=torch.preserve_format)
    out.permute(_memory_order(out)).copy_(flat.view([like.shape[d] for d in _memory_order(like)]))
    return out


def _blocks(x: Tensor) -> Tensor:
    flat = x.detach().permute(_memory_order(x)).reshape(-1).to(torch.float32)
    pad = num_blocks(flat.numel()) * BLOCK - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def _top(m: int) -> float:
    return 2.0 - 2.0 ** -m


def quantize(x: Tensor, key: str) -> tuple[Tensor, Tensor]:
    """(uint8 codes shaped like ``x``, float32 scales): ``x`` (any float dtype) in ``key``'s
    8-bit format, rounded to nearest as the kernels round."""
    e, m, signed, sqrt = FORMATS[key]
    blocks = _blocks(x)
    mag = blocks.abs() if signed else blocks
    absmax = mag.amax(dim=1) if blocks.numel() else blocks.new_zeros(0)
    coded = absmax.sqrt() if sqrt else absmax
    top = torch.tensor(_top(m), dtype=torch.float32)
    inv = torch.where(coded > 0, top / coded, torch.zeros_like(coded))
    a = blocks.sqrt() if sqrt else blocks.abs()
    t = a * inv[:, None]
    t = torch.where(t < top, t, top)
    f = (t.view(torch.int32).to(torch.int64) + (1 << (22 - m))) & ~((1 << (23 - m)) - 1)
    k = (f >> 23) - (127 - (2 ** e - 1))
    q = torch.where(k < 0, torch.zeros_like(k),
                    (k.clamp(min=0) << m) | ((f >> (23 - m)) & (2 ** m - 1)))
    if signed:
        q = q | torch.where(blocks < 0, 0x80, 0)
    else:
        q = torch.where((q == 0) & (a > 0), torch.ones_like(q), q)
    codes = _unflat(q.reshape(-1)[: x.numel()].to(torch.uint8), x, torch.uint8)
    return codes, absmax.to(x.device)


def dequantize(codes: Tensor, scales: Tensor, key: str) -> Tensor:
    """The float32 moments ``codes`` and ``scales`` stand for (exactly as the kernels decode)."""
    e, m, signed, sqrt = FORMATS[key]
    q = _blocks(codes.to(torch.int32)).to(torch.int64)  # (exact: codes < 2**24)
    mag_bits = q & (2 ** (e + m) - 1)
    bits = ((((mag_bits >> m) + (127 - (2 ** e - 1))) << 23)
            | ((mag_bits & (2 ** m - 1)) << (23 - m)))
    level = torch.where(mag_bits == 0, 0, bits).to(torch.int32).view(torch.float32)
    scales = scales.detach().reshape(-1).to(torch.float32)
    coded = scales.sqrt() if sqrt else scales
    inv_top = torch.tensor(np.float32(1.0) / np.float32(_top(m)), dtype=torch.float32)
    value = level * (coded * inv_top)[:, None]
    if sqrt:
        value = value * value
    if signed:
        value = torch.where((q & 0x80) != 0, -value, value)
    return _unflat(value.reshape(-1)[: codes.numel()], codes, torch.float32)


def whole_block_rows(p: Tensor) -> bool:
    """p's rows are whole blocks and p is sharded by rows (FSDP2's default ``Shard(0)``): sharding
    cuts no block, and its blocks are those of the whole tensor on any number of ranks (from the
    global shape alone)."""
    if any(getattr(pl, "dim", 0) != 0 for pl in getattr(p, "placements", None) or ()):
        return False
    return p.dim() >= 2 and p.shape[0] > 0 and (p.numel() // p.shape[0]) % BLOCK == 0


def new_state(p: Tensor) -> tuple[Tensor, Tensor]:
    """Zero codes and scales for a moment of parameter ``p`` (they decode to 0). For a DTensor
    (rows of whole blocks) the scales are ``[rows, blocks per row]``, sharded with the rows."""
    codes = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.preserve_format)
    if getattr(p, "device_mesh", None) is not None:
        from torch.distributed.tensor import zeros  # noqa: PLC0415

        return codes, zeros((p.shape[0], p.numel() // p.shape[0] // BLOCK), dtype=torch.float32,
                            device_mesh=p.device_mesh, placements=p.placements)
    return codes, torch.zeros(num_blocks(p.numel()), dtype=torch.float32, device=p.device)


def load_moment(state: dict, key: str, value: Tensor, scales: Tensor | None, want: torch.dtype,
                p: Tensor) -> None:
    """A saved moment into ``state`` in the storage ``want``: the same storage bit for bit; fp32 ->
    bf16 to nearest even, bf16 -> fp32 exactly; 8-bit codes decoded exactly (then rounded to bf16
    if asked); fp32/bf16 -> 8-bit quantized per block to nearest, as the step does."""
    if getattr(p, "device_mesh", None) is not None and value.dtype != want and torch.uint8 in (
            value.dtype, want):
        raise NotImplementedError(
            f"load_state_dict: '{key}' of a DTensor parameter is {value.dtype} in the checkpoint "
            f"but {want} here; on shards 8-bit moments load from 8-bit sharded checkpoints only "
            "(convert the storage in one process)")
    state.pop(scale_key(key), None)
    if value.dtype == torch.uint8:
        if scales is None:
            raise ValueError(f"the checkpoint's {key} is 8-bit (uint8 codes) but has no "
                             f"{scale_key(key)}; save and load whole state dicts")
        if want == torch.uint8:
            state[key] = value.to(p.device, copy=True)
            state[scale_key(key)] = scales.to(p.device, torch.float32, copy=True)
            return
        value = dequantize(value, scales, key)
    if want == torch.uint8:
        state[key], state[scale_key(key)] = quantize(value.to(p.device), key)
    else:
        state[key] = value.to(device=p.device, dtype=want, copy=True)
