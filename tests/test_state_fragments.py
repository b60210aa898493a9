"""`core/state.Fragments` through torch's DCP in one process (`no_dist=True`): written from pieces
at arbitrary offsets and read back into other pieces (another split of the same tensor), so a
change in DCP's chunk protocol fails here first; whole tensors read the same bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zeroshard.core.state import Fragments

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to")


def _pieces(values: torch.Tensor, cuts: list[int]) -> list[tuple[int, torch.Tensor]]:
    edges = [0, *cuts, values.numel()]
    return [(a, values[a:b].clone()) for a, b in zip(edges, edges[1:]) if b > a]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fragments_round_trip_at_other_offsets(tmp_path, dtype):
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    saved = Fragments(1000, _pieces(values, [7, 333, 334, 900]), dtype, torch.device("cpu"))
    dcp.save({"model.w": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    # Read into another split (as another world size would own it) and into a whole tensor.
    targets = _pieces(torch.zeros(1000, dtype=dtype), [100, 512])
    dcp.load({"model.w": Fragments(1000, targets, dtype, torch.device("cpu"))},
             checkpoint_id=str(tmp_path), no_dist=True)
    for offset, piece in targets:
        assert torch.equal(piece, values[offset:offset + piece.numel()]), offset
    whole = torch.zeros(1000, dtype=dtype)
    dcp.load({"model.w": whole}, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(whole, values)


def test_fragments_refuse_torch_ops():
    frag = Fragments(4, [(0, torch.ones(2))], torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="pieces"):
        frag + 1
    assert [(o, p.tolist()) for o, p in frag.pieces] == [(0, [1.0, 1.0])]
