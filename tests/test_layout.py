"""The layout: units, flat buffers, shards (single process, no collectives)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.core.layout import ALIGN, MIN_UNIT_NUMEL, build_units, padded_size
from tests.models import make_model


def _group_map(model, groups):
    return {id(p): g for g, params in enumerate(groups) for p in params}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [1, 50, 100, 10**9])
def test_units_cover_every_parameter_once_with_values_kept(world, bucket):
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    named = list(model.named_parameters())
    units = build_units(named, _group_map(model, [list(model.parameters())]), world, bucket)
    seen = [s.name for u in units for s in u.slots]
    assert sorted(seen) == sorted(before)  # the tied head/embedding weight appears once
    for unit in units:
        assert unit.padded_numel % (world * ALIGN) == 0
        assert unit.padded_numel - unit.numel < world * ALIGN
        bounds = [unit.shard_bounds(r) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == unit.padded_numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert unit.flat[unit.numel:].abs().sum() == 0  # padding is zero
        for slot in unit.slots:
            # the parameter is a view into the flat buffer, with its values unchanged
            assert slot.param.data.data_ptr() == unit.flat[slot.offset:].data_ptr()
            assert torch.equal(slot.param.detach(), before[slot.name])
        if len(unit.slots) > 1:
            assert unit.numel <= bucket


def test_units_follow_gradient_ready_order():
    model = make_model()
    units = build_units(list(model.named_parameters()),
                        _group_map(model, [list(model.parameters())]), 2, 1)
    order = [s.name for u in units for s in u.slots]
    registration = [n for n, _ in make_model().named_parameters()]
    assert order == list(reversed(registration))


def test_param_groups_and_dtypes_never_share_a_unit():
    model = make_model()
    model.block2.half()
    first = list(model.block1.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    units = build_units(list(model.named_parameters()), _group_map(model, [first, rest]), 2, 10**9)
    for unit in units:
        assert len({id(s.param) in {id(p) for p in first} for s in unit.slots}) == 1
        assert len({s.param.dtype for s in unit.slots}) == 1


def test_unit_cap_keeps_stage2_buffers_small_with_the_default_bucket():
    # DeepSpeed's default bucket (5e8) is larger than this model: without the cap it would be
    # one unit, and stage 2 would hold a whole-model gradient buffer.
    model = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(12)])  # ~12 M parameters
    total = sum(p.numel() for p in model.parameters())
    units = build_units(list(model.named_parameters()),
                        _group_map(model, [list(model.parameters())]), 2, 500_000_000)
    cap = max(total // 8, MIN_UNIT_NUMEL)
    assert len(units) >= 8
    assert all(u.numel <= cap for u in units)


@pytest.mark.parametrize("numel,world,expected", [(1, 1, 16), (16, 1, 16), (17, 2, 32), (33, 2, 64),
                                                    (100, 3, 144), (0, 4, 64)])
def test_padded_size(numel, world, expected):
    assert padded_size(numel, world) == expected
