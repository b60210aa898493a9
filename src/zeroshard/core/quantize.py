"""Block-wise symmetric int8 codec for what ZeRO++ sends over the wire (qwZ weights, qgZ gradients).

A row of S values is cut into blocks of B consecutive elements (the last one may be short; B is
WEIGHT_BLOCK for qwZ, GRADIENT_BLOCK for qgZ).
Each block b gets one fp32 scale s_b = max|x| / 127 over the block, and each value is sent as the
int8 q = round(x / s_b), so |x - q * s_b| <= s_b / 2. A row travels as one uint8 buffer of
`packed_size(S, B)` bytes, so one collective moves values and scales together:

    [ S int8 values | zero padding up to a multiple of 4 | ceil(S / B) fp32 scales ]

Rows are multiples of 4 bytes long, so a buffer of R rows laid end to end (one row per rank in an
all-gather) keeps every scale section 4-byte aligned and viewable as fp32 in place.

Special values: an all-zero block has scale 0 and comes back as zeros. A block holding an inf or
a nan gets a nan scale and comes back entirely nan, so a gradient overflow (fp16 loss scaling)
still shows up as non-finite after the round trip instead of being clipped to a finite value.
"""

from __future__ import annotations

import math

import torch

#: Elements per block for weights (qwZ): one fp32 scale each, 4 / 256 = 1.6% extra bytes.
WEIGHT_BLOCK = 256
#: Elements per block for gradient partial sums (qgZ), 6.3% extra bytes. Smaller than the weights'
#: because round-to-nearest in a block sets values below half a scale to zero on every step, a
#: bias Adam amplifies: the demo GPT's loss after 200 steps was 2.4% above plain stage 3 with
#: blocks of 256, 0.7% with 64 (README).
GRADIENT_BLOCK = 64
BLOCK = WEIGHT_BLOCK  # the default everywhere below
_QMAX = 127.0


def _data_bytes(numel: int) -> int:
    """Bytes of the int8 section of a row: `numel` rounded up to a multiple of 4."""
    return (numel + 3) // 4 * 4


def num_blocks(numel: int, block: int = BLOCK) -> int:
    """Quantization blocks (= fp32 scales) in a row of `numel` values."""
    return math.ceil(numel / block)


def packed_size(numel: int, block: int = BLOCK) -> int:
    """Bytes one packed row of `numel` values takes on the wire (int8 values + fp32 scales)."""
    return _data_bytes(numel) + 4 * num_blocks(numel, block)


def quantize_into(rows: torch.Tensor, packed: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Quantize `rows` ([R, S], any float dtype) into `packed` ([R, packed_size(S, block)]
    uint8)."""
    count, numel = rows.shape
    width = packed_size(numel, block)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (count, width):
        raise ValueError(f"quantize_into: packed must be uint8 of shape {(count, width)}, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    blocks = num_blocks(numel, block)
    values = rows.float()
    if blocks * block != numel:
        values = torch.nn.functional.pad(values, (0, blocks * block - numel))
    values = values.view(count, blocks, block)
    scale = values.abs().amax(dim=2) / _QMAX  # nan if the block has a nan, inf if it has an inf
    finite = torch.isfinite(scale)
    scale = scale.masked_fill(~finite, float("nan"))
    inverse = torch.where(finite & (scale > 0), 1.0 / scale, torch.zeros_like(scale))
    scaled = values * inverse.unsqueeze(2)
    # Blocks with a non-finite value send 0s under a nan scale; nothing else can be out of range.
    scaled = scaled.nan_to_num_(0.0, _QMAX, -_QMAX).round_().clamp_(-_QMAX, _QMAX)
    packed[:, :numel].view(torch.int8).copy_(scaled.view(count, -1)[:, :numel])
    start = _data_bytes(numel)
    packed[:, numel:start].zero_()
    packed[:, start:].view(torch.float32).copy_(scale)
    return packed


def quantize(rows: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """A new [R, packed_size(S, block)] uint8 tensor holding `rows` ([R, S]) quantized."""
    packed = torch.empty(rows.shape[0], packed_size(rows.shape[1], block), dtype=torch.uint8,
                         device=rows.device)
    return quantize_into(rows, packed, block)


def dequantize_into(packed: torch.Tensor, out: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Decode `packed` ([R, packed_size(S, block)] uint8) into `out` ([R, S], its own dtype)."""
    count, numel = out.shape
    width = packed_size(numel, block)
    if tuple(packed.shape) != (count, width):
        raise ValueError(f"dequantize_into: packed rows of {width} bytes expected for rows of "
                         f"{numel} values, got shape {tuple(packed.shape)}")
    values = packed[:, :numel].view(torch.int8)
    scale = packed[:, _data_bytes(numel):].view(torch.float32)
    whole = numel // block  # full blocks: one broadcast multiply; then the short last block
    if whole:
        body = values[:, :whole * block].unflatten(1, (whole, block))
        out[:, :whole * block].unflatten(1, (whole, block)).copy_(
            body.float().mul_(scale[:, :whole].unsqueeze(2)))
    if whole * block != numel:
        out[:, whole * block:].copy_(values[:, whole * block:].float().mul_(scale[:, whole:]))
    return out


def dequantize(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32,
               block: int = BLOCK) -> torch.Tensor:
    """A new [R, numel] tensor of `dtype` decoded from `packed`."""
    out = torch.empty(packed.shape[0], numel, dtype=dtype, device=packed.device)
    return dequantize_into(packed, out, block)
