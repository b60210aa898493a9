"""Stage 0 as DDP reduces (issue 37): its units are DDP's gradient buckets (1 MiB first, then
25 MiB, `layout.ddp_bucket_caps`), and the boundary backward averages each gradient on its way
into the bucket (times 1/N) instead of dividing the sum afterwards. Whatever mix of scaled and
unscaled gradients a unit holds, the average is the one a plain sum-then-divide gives, bit for bit
at 2 ranks (scaling by a power of two commutes with the sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from tests.harness import run_world
from zeroshard.core.layout import (DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, build_units,
                                   unit_numel_cap)
from zeroshard.core.reduction import Reduction


class _Branches(nn.Module):
    """`a` in every micro-step; `b` only where asked (its first gradient comes later)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, use_b):
        y = self.a(x)
        return y + self.b(x) if use_b else y


def _micro_batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 8, generator=g) for _ in range(2)]


def _averaged_grads(rank, world):
    """Stage 0 with 2 micro-steps, `b` used in the second only: the engine's gradients at the
    boundary of the second window (the first starts with the buffers attached, not let go), and
    the same gradients summed then divided (plain autograd on the same weights, then gloo)."""
    torch.manual_seed(0)
    model = _Branches()
    reference = _Branches()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 0}}
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    policy = engine.optimizer.policy
    out = {"scale_in": dict(policy.scale_in)}
    for window in range(2):
        reference.load_state_dict(model.state_dict())
        reference.zero_grad(set_to_none=True)
        for micro, x in enumerate(_micro_batches(rank + 10 * window)):
            engine.backward(engine(x, use_b=micro == 1).pow(2).mean())
            (reference(x, use_b=micro == 1).pow(2).mean() / 2).backward()
            if micro == 1:
                out["engine"] = {n: p.grad.clone() for n, p in model.named_parameters()}
                out["scaled"] = sorted(i for s in policy.scaled.values() for i in s)
            engine.step()
    expected = {}
    for name, param in reference.named_parameters():
        summed = param.grad.clone()
        dist.all_reduce(summed)
        expected[name] = summed / world
    out["expected"] = expected
    engine.destroy()
    return out


def test_mixed_scaled_and_unscaled_gradients_average_exactly():
    """`a`'s gradients came unscaled in the first micro-step (divided after the sum), `b`'s only
    in the boundary backward (scaled on the way in): both equal sum / N bit for bit."""
    results = run_world(2, _averaged_grads)
    for rank, got in enumerate(results):
        assert set(got["scale_in"].values()) == {0.5}, got["scale_in"]
        # the layout's slot order is the gradient-ready order: b (slots 0-1) before a (2-3)
        assert got["scaled"] == [0, 1], got["scaled"]
        for name, expected in got["expected"].items():
            assert torch.equal(got["engine"][name], expected), (rank, name)
    assert torch.equal(results[0]["engine"]["b.weight"], results[1]["engine"]["b.weight"])


def test_stage0_units_are_ddp_buckets():
    """1 MiB first (closed by the parameter that fills it), then up to 25 MiB; other stages keep
    the capped units."""
    params = [(f"p{i}", nn.Parameter(torch.zeros(1 << 18))) for i in range(60)]  # 1 MiB each
    group_of = {id(p): 0 for _, p in params}
    units = build_units(params, group_of, 2, 10**9, materialize=False, ddp_buckets=True)
    sizes = [u.numel * 4 for u in units]
    assert sizes[0] == DDP_FIRST_BUCKET_BYTES
    assert all(s == DDP_BUCKET_BYTES for s in sizes[1:-1]) and sizes[-1] <= DDP_BUCKET_BYTES
    assert sum(sizes) == 60 << 20
    capped = build_units(params, group_of, 2, 10**9, materialize=False)
    cap = unit_numel_cap(10**9, 60 << 18)
    assert len(capped) > len(units) and all(u.numel <= cap for u in capped)
    small = build_units(params, group_of, 2, 3 << 18, materialize=False, ddp_buckets=True)
    assert [u.numel for u in small] == [1 << 18] + [3 << 18] * 19 + [2 << 18]


def test_power_of_two_average_multiplies_exactly():
    """The average multiplies by 1/N where that is exact (same bits as dividing), else divides."""
    x = torch.randn(4096) * torch.logspace(-40, 30, 4096)
    for world in (2, 4, 8):
        assert Reduction().exact_post_factor(world) == 1.0 / world
        assert torch.equal(Reduction().after(x.clone(), world), x / world)
    assert Reduction().exact_post_factor(3) is None
    assert Reduction(predivide=2.0).exact_post_factor(4) == 0.5
    assert Reduction(average=False).exact_post_factor(4) is None
    assert torch.equal(Reduction().after(x.clone(), 3), x / 3)
