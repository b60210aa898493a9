"""Block-wise symmetric int8 codec for what ZeRO++ sends over the wire (qwZ weights, qgZ gradients).

A row of S values is cut into blocks of B consecutive elements (the last one may be short; B is
WEIGHT_BLOCK for qwZ, GRADIENT_BLOCK for qgZ).
Each block b gets one fp32 scale s_b = max|x| / 127 over the block, and each value is sent as the
int8 q = round(x / s_b), so |x - q * s_b| <= s_b / 2. A row travels as one uint8 buffer of
`packed_size(S, B, K)` bytes, so one collective moves values and scales together:

    [ S int8 values | zero padding up to a multiple of 4 | ceil(S / B) fp32 scales | K more ]

Blocks never mix two parameters (`BlockPlan`). A row is a rank's shard of a unit's flat buffer,
where parameters lie end to end; a block holding the end of one and the start of the next would
share one scale between, say, a LayerNorm weight near 1 and a bias near 0.001, and round the bias
to 0 at every step (the demo GPT's loss then stalled: README). So a block that a parameter start
cuts is split into parts: its first part keeps the block's scale slot, each later part gets one
of the K extra slots after the regular ones (K: the most any row of the unit needs, so every row
has the same width). Decoding applies the regular scales block by block, then rewrites the few
elements of split blocks with their parts' scales.

Parameters of fewer than two dimensions (biases, LayerNorm gains and shifts: about 1% of a
transformer's values) are not quantized at all: their values travel as fp32 words after the
scales, E of them (the most any row of the unit holds), and decoding writes them back exactly.
A gain near 1.0 rounded to 1/127 of its block's maximum moves by up to 0.004 per gather, more
than Adam's early steps move it. (Suspected in one stalled run of the demo GPT, it was not the
cause there, README; it stays because it costs ~2% of the bytes.) A row is then

    [ S int8 values | padding | ceil(S / B) scales | K split-part scales | E exact values ]

and `packed_size(S, B, K + E)` bytes long: K and E are both fp32 words, the plan's `extra`.

Rows are multiples of 4 bytes long, so a buffer of R rows laid end to end (one row per rank in an
all-gather) keeps every scale section 4-byte aligned and viewable as fp32 in place.

Special values: an all-zero block has scale 0 and comes back as zeros. A block holding an inf or
a nan gets a nan scale and comes back entirely nan, so a gradient overflow (fp16 loss scaling)
still shows up as non-finite after the round trip instead of being clipped to a finite value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

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
    """Regular quantization blocks (= fp32 scales before the extra ones) in a row of `numel`."""
    return math.ceil(numel / block)


def packed_size(numel: int, block: int = BLOCK, extra: int = 0) -> int:
    """Bytes one packed row of `numel` values takes on the wire (int8 values + fp32 scales,
    then `extra` more fp32 words: split-block scales and exact values)."""
    return _data_bytes(numel) + 4 * (num_blocks(numel, block) + extra)


@dataclass(frozen=True)
class Fixups:
    """The elements of a [R, S] tensor of rows that the regular blocks do not cover: those of
    split blocks with their part's scale slot, and the exact ones with their word's slot."""

    rows: torch.Tensor  # int64 [E]: row of each split-block element
    cols: torch.Tensor  # int64 [E]: its position in the row
    slots: torch.Tensor  # int64 [E]: its part's slot in the row's scale section
    exact_rows: torch.Tensor  # int64 [X]: row of each element sent exactly
    exact_cols: torch.Tensor  # int64 [X]: its position in the row
    exact_slots: torch.Tensor  # int64 [X]: its fp32 word after the scales


class BlockPlan:
    """Where the blocks of one unit's shard rows are cut: every `block` elements of a row and at
    every parameter start inside it; `exact` lists the (offset, numel) flat ranges sent
    unquantized. `starts` are the flat-buffer offsets where parameters begin; row r is the shard
    [r*S, (r+1)*S)."""

    def __init__(self, starts: Sequence[int], shard_numel: int, block: int, rows: int,
                 exact: Sequence[tuple[int, int]] = ()):
        regular = num_blocks(shard_numel, block)
        split: list[tuple[list[int], list[int], int]] = []
        kept: list[list[int]] = []
        for row in range(rows):
            lo, hi = row * shard_numel, (row + 1) * shard_numel
            spans = [(max(a, lo) - lo, min(a + n, hi) - lo) for a, n in exact
                     if a < hi and a + n > lo]
            kept.append([c for a, b in sorted(spans) for c in range(a, b)])
            split.append(self._split_parts(starts, lo, shard_numel, block, regular, spans))
        scales = max((used for _, _, used in split), default=0)
        # Per row: (position, slot) of every element of a split block, and of every exact one.
        self._per_row = [(cols, slots, cols_kept,
                          list(range(regular + scales, regular + scales + len(cols_kept))))
                         for (cols, slots, _), cols_kept in zip(split, kept)]
        self.scales = scales  # split-part scales per row beyond the regular ones
        self.exact = max((len(k) for k in kept), default=0)  # exact words per row
        self.extra = scales + self.exact  # fp32 words per row after the regular scales
        self._cache: dict[tuple[int, ...], Fixups | None] = {}

    @staticmethod
    def _split_parts(starts, lo: int, numel: int, block: int, regular: int, spans):
        """(positions, slots, extra slots used) of the elements of row [lo, lo + numel)'s split
        blocks outside the exact spans: a block's first quantized part keeps its slot, later ones
        get extra slots."""
        cuts = sorted({s - lo for s in starts if lo < s < lo + numel and (s - lo) % block})
        by_block: dict[int, list[int]] = {}
        for cut in cuts:
            by_block.setdefault(cut // block, []).append(cut)
        cols: list[int] = []
        slots: list[int] = []
        used = 0
        for index, inner in by_block.items():
            edges = [index * block, *inner, min((index + 1) * block, numel)]
            first = True
            for a, b in zip(edges, edges[1:]):
                if any(x <= a and b <= y for x, y in spans):
                    continue  # a part of an exact parameter: sent as it is
                slot = index if first else regular + used
                used += 0 if first else 1
                first = False
                cols.extend(range(a, b))
                slots.extend([slot] * (b - a))
        return cols, slots, used

    def fixups(self, row_ids: Sequence[int], device: torch.device) -> Fixups | None:
        """The fix-ups of a [len(row_ids), S] tensor whose row i is shard row `row_ids[i]`; None
        where no block is split and nothing is exact."""
        key = tuple(row_ids)
        if key not in self._cache:
            lists: list[list[int]] = [[] for _ in range(6)]
            for i, row in enumerate(key):
                cols, slots, kept, words = self._per_row[row]
                for target, values in zip(lists, ([i] * len(cols), cols, slots,
                                                  [i] * len(kept), kept, words)):
                    target.extend(values)
            self._cache[key] = None if not (lists[1] or lists[4]) else Fixups(
                *(torch.tensor(v, dtype=torch.int64, device=device) for v in lists))
        return self._cache[key]


def _scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) from block maxima: nan scale (and 0 inverse) for a non-finite block,
    0 inverse for an all-zero one."""
    scale = amax / _QMAX  # nan if the block has a nan, inf if it has an inf
    finite = torch.isfinite(scale)
    scale = scale.masked_fill(~finite, float("nan"))
    inverse = torch.where(finite & (scale > 0), 1.0 / scale, torch.zeros_like(scale))
    return scale, inverse


def _to_int(scaled: torch.Tensor) -> torch.Tensor:
    """Round scaled values in place (non-finite ones, under a nan scale, send 0). Finite ones
    already lie in [-127, 127] (up to rounding of the product: never past 127.5), so no clamp."""
    return scaled.nan_to_num_(0.0, _QMAX, -_QMAX).round_()


def _block_max(values: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dimension (nan if any is nan): two reductions, no |x| temporary."""
    return torch.maximum(values.amax(dim=-1), values.amin(dim=-1).neg_())


def _pieces(numel: int, block: int) -> list[tuple[int, int, int]]:
    """(first element, end, first block) of the whole blocks of a row, then of its short tail."""
    whole = numel // block * block
    pieces = [(0, whole, 0)] if whole else []
    return pieces + ([(whole, numel, whole // block)] if whole != numel else [])


def quantize_into(rows: torch.Tensor, packed: torch.Tensor, block: int = BLOCK,
                  fix: Fixups | None = None, extra: int = 0) -> torch.Tensor:
    """Quantize `rows` ([R, S], any float dtype) into `packed` ([R, packed_size(S, block,
    extra)] uint8); `fix` and `extra` from the rows' BlockPlan (none: blocks every `block`)."""
    count, numel = rows.shape
    width = packed_size(numel, block, extra)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (count, width):
        raise ValueError(f"quantize_into: packed must be uint8 of shape {(count, width)}, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    blocks = num_blocks(numel, block)
    values = rows.float()
    pieces = [(values[:, a:b].unflatten(1, (-1, min(block, b - a))), a, b, first)
              for a, b, first in _pieces(numel, block)]
    amax = values.new_zeros(count, blocks + extra)
    for piece, a, b, first in pieces:
        amax[:, first:first + piece.shape[1]] = _block_max(piece)
    if fix is not None and fix.cols.numel():
        picked = values[fix.rows, fix.cols]
        # Split blocks: each part's maximum replaces the whole block's (include_self=False).
        amax = amax.view(-1).scatter_reduce_(0, fix.rows * amax.shape[1] + fix.slots,
                                             picked.abs(), "amax", include_self=False)
        amax = amax.view(count, -1)
    scale, inverse = _scales(amax)
    ints = packed[:, :numel].view(torch.int8)
    for piece, a, b, first in pieces:
        # A copy, then an in-place multiply: on the CPU twice as fast as `piece * inverse`.
        scaled = piece.to(torch.float32, copy=True)
        scaled.mul_(inverse[:, first:first + piece.shape[1]].unsqueeze(2))
        ints[:, a:b].copy_(_to_int(scaled).flatten(1))
    if fix is not None and fix.cols.numel():
        ints[fix.rows, fix.cols] = _to_int(picked * inverse[fix.rows, fix.slots]).to(torch.int8)
    start = _data_bytes(numel)
    packed[:, numel:start].zero_()
    words = packed[:, start:].view(torch.float32)
    words.copy_(scale)
    if fix is not None and fix.exact_cols.numel():
        words[fix.exact_rows, fix.exact_slots] = values[fix.exact_rows, fix.exact_cols]
    return packed


def quantize(rows: torch.Tensor, block: int = BLOCK, plan: BlockPlan | None = None,
             row_ids: Sequence[int] | None = None) -> torch.Tensor:
    """A new packed uint8 tensor holding `rows` ([R, S]) quantized; with a `plan`, row i is
    shard row `row_ids[i]` of its unit (default: rows 0..R-1)."""
    extra = plan.extra if plan is not None else 0
    fix = _fix(rows, plan, row_ids)
    packed = torch.empty(rows.shape[0], packed_size(rows.shape[1], block, extra),
                         dtype=torch.uint8, device=rows.device)
    return quantize_into(rows, packed, block, fix, extra)


def _fix(rows: torch.Tensor, plan: BlockPlan | None, row_ids) -> Fixups | None:
    if plan is None:
        return None
    return plan.fixups(range(rows.shape[0]) if row_ids is None else row_ids, rows.device)


def dequantize_into(packed: torch.Tensor, out: torch.Tensor, block: int = BLOCK,
                    fix: Fixups | None = None, extra: int = 0) -> torch.Tensor:
    """Decode `packed` ([R, packed_size(S, block, extra)] uint8) into `out` ([R, S], its own
    dtype)."""
    count, numel = out.shape
    width = packed_size(numel, block, extra)
    if tuple(packed.shape) != (count, width):
        raise ValueError(f"dequantize_into: packed rows of {width} bytes expected for rows of "
                         f"{numel} values, got shape {tuple(packed.shape)}")
    values = packed[:, :numel].view(torch.int8)
    scale = packed[:, _data_bytes(numel):].view(torch.float32)
    for a, b, first in _pieces(numel, block):
        # int8 -> output dtype (exact: |q| <= 127), then times the scale in place: two
        # vectorized passes, 7x faster on the CPU than one mixed-dtype `torch.mul(out=...)`.
        # The product is formed in fp32 and rounded once to the output dtype either way.
        size = min(block, b - a)
        target = out[:, a:b].unflatten(1, (-1, size))
        target.copy_(values[:, a:b].unflatten(1, (-1, size)))
        target.mul_(scale[:, first:first + (b - a) // size].unsqueeze(2))
    if fix is not None and fix.cols.numel():
        out[fix.rows, fix.cols] = (values[fix.rows, fix.cols].float()
                                   * scale[fix.rows, fix.slots]).to(out.dtype)
    if fix is not None and fix.exact_cols.numel():
        out[fix.exact_rows, fix.exact_cols] = scale[fix.exact_rows,
                                                    fix.exact_slots].to(out.dtype)
    return out


def dequantize(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32,
               block: int = BLOCK, plan: BlockPlan | None = None,
               row_ids: Sequence[int] | None = None) -> torch.Tensor:
    """A new [R, numel] tensor of `dtype` decoded from `packed` (row ids as for `quantize`)."""
    out = torch.empty(packed.shape[0], numel, dtype=dtype, device=packed.device)
    extra = plan.extra if plan is not None else 0
    return dequantize_into(packed, out, block, _fix(out, plan, row_ids), extra)
