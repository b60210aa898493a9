"""DeepSpeed's stage-3 construction surface, through `import deepspeed` (zeroshard's alias), as
DeepSpeed 0.19.8's own tests use it (unit/runtime/zero/test_zero_context*.py,
test_zero_nesting_init.py, test_zero_dynamic_class.py): parameters partitioned by `zero.Init`
alone carry `ds_status` / `ds_id` / `ds_shape` / `ds_numel` / `ds_tensor`; `zero.Init()` without a
config partitions in half precision, with one in the config's precision; `zero.Init(module=...)`;
nested contexts and classes defined inside one; `GatheredParameters(modifier_rank=r)` publishes
rank r's writes, `modifier_rank=None` drops them or, under `enable_sanity_checks`, raises on every
rank; and `deepspeed.comm`'s names. The multi-rank cases run in one world of 2 ranks."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from tests.harness import run_world

SANITY = {"train_micro_batch_size_per_gpu": 1,
          "zero_optimization": {"stage": 3, "enable_sanity_checks": True}}


def _deepspeed():
    from zeroshard.compat.deepspeed.alias import install

    install()
    import deepspeed

    return deepspeed


class _Conv(nn.Conv1d):
    """A subclass of a torch module that adds a parameter of its own after super().__init__."""

    def __init__(self, *args):
        super().__init__(*args)
        self.extra = nn.Parameter(torch.ones(5))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = _Conv(1, 3, 4)
        self.l1 = nn.Linear(6, 3)
        self.l2 = nn.Linear(3, 2)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def _raises(fn, text: str) -> bool:
    """Whether fn() raises a RuntimeError whose message contains `text`."""
    try:
        fn()
    except RuntimeError as err:
        return text in str(err)
    return False


def _attributes(ds, rank: int, world: int, out: dict) -> None:
    from deepspeed.runtime.zero.partition_parameters import (ZeroParamStatus,
                                                             partitioned_param_data_shape)
    from zeroshard.core.init import half_dtype

    torch.manual_seed(0)
    whole = nn.Linear(6, 3)
    with ds.zero.Init():
        torch.manual_seed(0)
        lin = nn.Linear(6, 3)
    w = lin.weight
    out["not available"] = w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    out["empty shape"] = list(w.shape) == partitioned_param_data_shape
    out["ds_shape"] = tuple(w.ds_shape) == (3, 6) and w.ds_numel == 18
    out["ds_id distinct"] = isinstance(w.ds_id, int) and w.ds_id != lin.bias.ds_id
    out["half dtype"] = w.dtype == w.ds_tensor.dtype == half_dtype()
    out["ds_tensor 1-D"] = w.ds_tensor.dim() == 1 and w.ds_tensor.numel() * world >= 18
    # The ranks' ds_tensors laid end to end are the rank-0-built weight (in the Init dtype).
    parts = [torch.empty_like(w.ds_tensor) for _ in range(world)]
    ds.comm.all_gather(parts, w.ds_tensor)
    out["ds_tensor slices"] = torch.equal(torch.cat(parts)[:18].view(3, 6),
                                          whole.weight.detach().to(w.dtype))
    out["outside untouched"] = not hasattr(nn.Linear(6, 3).weight, "ds_status")
    with ds.zero.GatheredParameters(w):
        out["available inside"] = w.ds_status == ZeroParamStatus.AVAILABLE and \
            tuple(w.shape) == (3, 6)
    out["freed after"] = w.numel() == 0 and w.ds_status == ZeroParamStatus.NOT_AVAILABLE

    # Writes on the modifier rank reach every rank's shard; without one they are dropped.
    with ds.zero.GatheredParameters(w, modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                w.zero_()
    out["modifier shard"] = not w.ds_tensor.any()
    with ds.zero.GatheredParameters(w):
        out["modifier gathered"] = not w.any()
    with ds.zero.GatheredParameters(lin.bias, modifier_rank=None):
        before = lin.bias.detach().clone()
        if rank == 0:
            with torch.no_grad():
                lin.bias.add_(1.0)
    with ds.zero.GatheredParameters(lin.bias):
        out["none discarded"] = torch.equal(lin.bias.detach(), before)


def _configs(ds, rank: int, world: int, out: dict) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    dtypes = {}
    for name, extra in (("fp16", {"fp16": {"enabled": True}}),
                        ("bf16", {"bf16": {"enabled": True}}), ("fp32", {})):
        with ds.zero.Init(config_dict_or_path={"train_batch_size": world,
                                               "zero_optimization": {"stage": 3}, **extra}):
            dtypes[name] = nn.Linear(4, 4).weight.ds_tensor.dtype
    out["config dtypes"] = dtypes == {"fp16": torch.float16, "bf16": torch.bfloat16,
                                      "fp32": torch.float32}
    with ds.zero.Init(config_dict_or_path={"fp16": {"enabled": True},
                                           "zero_optimization": {"stage": 3}},
                      dtype=torch.float32):
        out["dtype argument wins"] = nn.Linear(4, 4).weight.ds_tensor.dtype == torch.float32
    with ds.zero.Init(config={"zero_optimization": {"stage": 3}}):
        net = _Net()
    out["subclass params"] = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE
                                 for p in (net.conv.extra, net.conv.weight, net.l1.weight))
    # module=: a model built whole is partitioned with its values (every rank takes rank 0's).
    torch.manual_seed(1 + rank)
    built = _Net()
    first = [p.detach().clone() for p in built.parameters()]
    torch_dist.broadcast_object_list(first, src=0)
    ds.zero.Init(module=built, config_dict_or_path={"zero_optimization": {"stage": 3}})
    out["module= partitions"] = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE
                                    for p in built.parameters())
    with ds.zero.GatheredParameters(list(built.parameters())):
        out["module= values"] = all(torch.equal(p.detach(), q)
                                    for p, q in zip(built.parameters(), first))
    with ds.zero.Init(config={"zero_optimization": {"stage": 2}}):
        out["stage 2 plain"] = not hasattr(nn.Linear(3, 3).weight, "ds_id")


def _nesting(ds, rank: int, world: int, out: dict) -> None:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with ds.zero.Init(config_dict_or_path=cfg):
        class Defined(nn.Module):  # a class defined inside the context is wrapped too
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x)

        with ds.zero.Init(config_dict_or_path=cfg):
            inner = Defined()
        built = hasattr(inner.fc.weight, "ds_tensor")  # partitioned by the outer context
        # initialize() inside an active Init: the engine's own modules do not re-partition the
        # model it now manages (its construction slices are gone, its stage-3 marks stay).
        engine, *_ = ds.initialize(model=inner, config=cfg)
        after = Defined()
    out["nested partitioned once"] = built and hasattr(inner.fc.weight, "ds_id") and \
        not hasattr(inner.fc.weight, "ds_tensor") and hasattr(after.fc.weight, "ds_tensor")
    x = torch.ones(1, 4)
    engine.backward(engine(x).sum())
    engine.step()
    out["engine trains"] = engine.global_steps == 1
    engine.destroy()
    engine, *_ = ds.initialize(model=after, config=cfg)
    out["after context"] = engine(x).shape == (1, 4)
    engine.destroy()


def _replaced(ds, rank: int, world: int, out: dict) -> None:
    """`p.data = new` (not a write in place) on the modifier rank is published as well."""
    with ds.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        lin = nn.Linear(4, 4)
    with ds.zero.GatheredParameters(lin.weight, modifier_rank=1):
        lin.weight.data = torch.full((4, 4), 5.0 + rank)  # rank 0's is dropped
    with ds.zero.GatheredParameters(lin.weight):
        out["replaced init"] = bool((lin.weight == 6.0).all())

    def wrong_shape():
        with ds.zero.GatheredParameters(lin.weight, modifier_rank=0):
            if rank == 0:
                lin.weight.data = torch.zeros(2, 2)
    try:
        wrong_shape()
        refused = False
    except ValueError as err:
        refused = "modifier rank 0" in str(err) and "weight" in str(err)
    out["wrong shape refused on its rank"] = refused == (rank == 0)
    with ds.zero.GatheredParameters(lin.weight):
        out["wrong shape left values"] = bool((lin.weight == 6.0).all())
    for stage in (1, 3):
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD",
                                                                 "params": {"lr": 0.0}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        model = nn.Linear(4, 4)
        engine, *_ = ds.initialize(model=model, config=cfg)
        with ds.zero.GatheredParameters(model.weight, modifier_rank=0):
            model.weight.data = torch.full((4, 4), 2.0)
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()  # lr 0: what the step writes back must be the published value
        with ds.zero.GatheredParameters(model.weight):
            out[f"replaced engine stage {stage}"] = bool((model.weight == 2.0).all())
        engine.destroy()


def _sanity(ds, rank: int, world: int, out: dict) -> None:
    with ds.zero.Init(config_dict_or_path=SANITY):
        net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    params = [net[0].weight, net[1].weight]

    def write(on_rank):
        with ds.zero.GatheredParameters(params, modifier_rank=None):
            if on_rank in (rank, "all"):
                with torch.no_grad():
                    params[0].add_(0.0)

    out["sanity all ranks"] = _raises(lambda: write("all"), "in-place modification")
    out["sanity one rank"] = _raises(lambda: write(1), "in-place modification")
    out["sanity read only"] = not _raises(lambda: write(None), "")

    def publish():
        with ds.zero.GatheredParameters(params, modifier_rank=0):
            with torch.no_grad():
                params[0].fill_(2.0)
    out["sanity modifier ok"] = not _raises(publish, "")
    # Stage 3 engine parameters follow the engine config's setting.
    cfg = {**SANITY, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {**SANITY["zero_optimization"],
                                 "stage3_param_persistence_threshold": 0}}
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    engine, *_ = ds.initialize(model=model, config=cfg)
    weight = model[0].weight

    def engine_write(modifier):
        with ds.zero.GatheredParameters(weight, modifier_rank=modifier):
            if rank == 1:
                with torch.no_grad():
                    weight.fill_(3.0)

    out["engine sanity"] = _raises(lambda: engine_write(None), "in-place modification")
    engine_write(1)
    with ds.zero.GatheredParameters(weight):
        out["engine modifier"] = bool((weight == 3.0).all())
    engine.destroy()


def _comm(ds, rank: int, world: int, out: dict) -> None:
    dist = ds.comm
    out["ranks"] = (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == \
        (rank, world, rank)
    out["available"] = dist.is_available() and dist.is_initialized() and \
        dist.get_backend() == "gloo"
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["all_reduce"] = t.item() == sum(range(1, world + 1))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["ReduceOp"] = t.item() == world - 1
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=1)
    out["broadcast"] = t.item() == 1.0
    parts = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank)))
    out["all_gather"] = [p[0].item() for p in parts] == [float(r) for r in range(world)]
    flat = torch.zeros(world)
    dist.all_gather_into_tensor(flat, torch.tensor([float(rank)]))
    out["all_gather_into_tensor"] = flat.tolist() == [float(r) for r in range(world)]
    mine = torch.zeros(1)
    dist.reduce_scatter_tensor(mine, torch.arange(world, dtype=torch.float32))
    out["reduce_scatter_tensor"] = mine.item() == rank * world
    group = dist.new_group([1])
    out["new_group"] = dist.get_all_ranks_from_group(group) == [1] if rank == 1 else True
    out["world group"] = dist.get_all_ranks_from_group(dist.get_world_group()) == \
        list(range(world))
    dist.barrier()
    dist.destroy_process_group()
    out["destroyed"] = not dist.is_initialized()


def _all(rank: int, world: int) -> dict:
    ds = _deepspeed()
    out: dict = {}
    for case in (_attributes, _configs, _nesting, _replaced, _sanity, _comm):  # _comm: last
        case(ds, rank, world, out)
    return out


@pytest.fixture(scope="module")
def results():
    """Per-rank results at world size 2."""
    return run_world(2, _all)


GROUPS = {
    "init attributes": ["not available", "empty shape", "ds_shape", "ds_id distinct",
                        "half dtype", "ds_tensor 1-D", "ds_tensor slices", "outside untouched",
                        "available inside", "freed after"],
    "modifier rank": ["modifier shard", "modifier gathered", "none discarded", "replaced init",
                      "wrong shape refused on its rank", "wrong shape left values",
                      "replaced engine stage 1", "replaced engine stage 3"],
    "config and module": ["config dtypes", "dtype argument wins", "subclass params",
                          "module= partitions", "module= values", "stage 2 plain"],
    "nesting": ["nested partitioned once", "engine trains", "after context"],
    "sanity checks": ["sanity all ranks", "sanity one rank", "sanity read only",
                      "sanity modifier ok", "engine sanity", "engine modifier"],
    "comm": ["ranks", "available", "all_reduce", "ReduceOp", "broadcast", "all_gather",
             "all_gather_into_tensor", "reduce_scatter_tensor", "new_group", "world group",
             "destroyed"],
}


@pytest.mark.parametrize("group", GROUPS)
def test_deepspeed_stage3_construction(results, group):
    for rank, got in enumerate(results):
        failed = [key for key in GROUPS[group] if not got[key]]
        assert not failed, f"rank {rank}: {failed}"


def test_comm_without_a_process_group_is_a_world_of_one():
    from zeroshard.compat.deepspeed import comm as dist

    if torch_dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    assert (dist.get_rank(), dist.get_world_size(), dist.is_initialized()) == (0, 1, False)
    parts, out = [torch.zeros(2)], torch.zeros(2)
    dist.all_gather(parts, torch.ones(2))
    dist.all_gather_into_tensor(out, torch.full((2,), 2.0))
    assert parts[0].tolist() == [1.0, 1.0] and out.tolist() == [2.0, 2.0]
    t = torch.ones(1)
    assert dist.all_reduce(t) is None and t.item() == 1.0
    dist.barrier()
    dist.destroy_process_group()  # nothing to destroy: no error


def test_init_starts_the_process_group_and_explicit_rendezvous():
    """`zero.Init()` starts the default group itself (test_scattered_init_dist); DeepSpeed's
    harness starts it with an explicit file rendezvous, rank and world size."""
    from zeroshard.compat.deepspeed import comm as dist
    from zeroshard.compat.deepspeed.zero import Init

    if torch_dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.pop(k, None) for k in rendezvous}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_distributed(dist_backend="gloo", init_method=f"file://{tmp}/store",
                                  rank=0, world_size=1)
            assert dist.is_initialized() and dist.get_world_size() == 1
            assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")
            dist.destroy_process_group()
        assert not dist.is_initialized()
        for key in rendezvous:  # a plain `python script.py`: a world of one on a free port
            os.environ.pop(key, None)
        with Init():
            assert dist.is_initialized()
            lin = nn.Linear(3, 3)
        assert lin.weight.ds_tensor.numel() >= 9
        with pytest.raises(ValueError, match="rank and world_size"):
            dist.destroy_process_group()
            dist.init_distributed(init_method="file:///nonexistent")
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
