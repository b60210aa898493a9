"""The one builder: `initialize()` and `prepare()` turn a model, an optimizer and a config into an
`Engine` (engine.py) over a `ZeroOptimizer` (core/optim.py).

Build order, each step handed what the previous ones made (no object is rewired afterwards):
  1. the process group (dist/), the config validated and its "auto" values resolved (config/),
     refusals checked (config/refusals.py), then the engine's `World` (dist/world.py): the
     world's Comm with its ledger and desync watchdog, and MiCS's groups when asked for;
  2. the torch optimizer (the user's instance, a factory, or the config's `optimizer` block);
  3. the `ZeroOptimizer`: units, the stage policy and the placement of masters and optimizer state
     (core/optim.py, from the stage and placement specs below);
  4. frozen parameters and buffers moved to the device, rank 0's copies broadcast;
  5. the LR scheduler, then the `Engine` around all of it.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from .dist import Comm, default_device, init_distributed
from .dist.world import World
from .config.auto import resolve_auto
from .config.refusals import (check_elementwise, check_hpz, check_mics, check_reduce_and_accumulate,
                              require_supported)
from .config.schema import ZeroConfig, load_config, read_raw
from .core.agreement import check_ranks_agree
from .dist.hostmem import host_region, mark_cpu_as_host, to_device
from .core.layout import INIT_ATTR
from .core.sanity import check_in_place_writes
from .dist.hostsync import HostSyncs
from .core.mics import sync_replicas
from .core.leaf import apply_leaf_module_config
from .core.no_optimizer import NoPlacement, is_placeholder, make_no_placement, placeholder_optimizer
from .core.muon_exchange import MuonExchange
from .core.optim import ZeroOptimizer, build_optimizer
from .core.reduction import Reduction, accumulation_dtype
from .core.scaler import LossScaler
from .core.spec import Stage3Options, StageSpec
from .core.stages import lay_out, make_policy, owned_slices
from .dist.streams import Streams
from .dist.groups import blocks, strided
from .dist.process_group import mark_engaged
from .engine import Engine, _compute_dtype
from .offload.placements import make_placement
from .offload.param import make_store


def _master_dtype(config: ZeroConfig) -> torch.dtype:
    """bf16 for DeepSpeed's bf16_master_weights_and_grads (with bf16_optimizer_states), else fp32."""
    bf16 = config.bf16
    if bf16.enabled and bf16.bf16_master_weights_and_grads and config.zero_optimization.stage > 0:
        return torch.bfloat16
    return torch.float32


def _skips_nonfinite(config: ZeroConfig) -> bool:
    """bf16 with check_grad_overflow (DeepSpeed's default): an inf/nan gradient skips the step."""
    return config.bf16.enabled and config.bf16.check_grad_overflow


def _resolve_config(config, args, config_params):
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    return config


def _make_optimizer(optimizer, model_parameters, module: nn.Module, cfg: ZeroConfig):
    params = list(model_parameters) if model_parameters is not None else \
        [p for p in module.parameters() if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        if cfg.optimizer is not None:
            warnings.warn("zeroshard: both an optimizer instance and a config 'optimizer' block "
                          "were given; the instance is used and the config block ignored",
                          stacklevel=4)
        return optimizer
    if callable(optimizer):
        return optimizer(params)
    if cfg.optimizer is not None:
        return build_optimizer(cfg.optimizer, params, module)
    return placeholder_optimizer(params)  # an engine for inference only (core/no_optimizer.py)


def _check_owned(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    owned = {id(p) for p in module.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in owned:
                raise ValueError(f"optimizer param group {g}, parameter {i} (shape "
                                 f"{tuple(p.shape)}) is not a parameter of the model; build the "
                                 "optimizer from model.parameters()")


def _build(model: nn.Module, optimizer, model_parameters, config, lr_scheduler, args=None,
           config_params=None, loader_batch: int | None = None, known: dict | None = None):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    init_distributed()
    world_size = dist.get_world_size()
    source = _resolve_config(config, args, config_params)
    if not isinstance(source, ZeroConfig):
        source = resolve_auto(read_raw(source), model=model, world_size=world_size,
                              loader_batch=loader_batch, known=known)
    cfg = source if isinstance(source, ZeroConfig) else load_config(source, world_size)
    require_supported(cfg)
    check_reduce_and_accumulate(cfg)
    world = World.build(cfg.zero_optimization.zeroshard_desync_timeout)
    comm = world.comm
    check_ranks_agree(comm, model, cfg)  # before any collective whose sizes depend on the model
    device = default_device()
    dtype = _compute_dtype(cfg)
    torch_opt = _make_optimizer(optimizer, model_parameters, model, cfg)
    _check_owned(torch_opt, model)
    with host_region():
        for tensor in [*model.parameters(), *model.buffers()]:
            mark_cpu_as_host(tensor)  # strict mode: a model built on the CPU is in host memory
        zopt = _make_zero_optimizer(model, torch_opt, world, cfg, dtype, device)
        # The units are on the device now (stage 3: one at a time, never the whole model); the
        # rest follows: frozen parameters and buffers, in the compute dtype.
        _move_rest(model, zopt, device, dtype)
        _broadcast_from_rank0(model, zopt, comm)
    scheduler = _make_scheduler(lr_scheduler, cfg, zopt)
    engine = Engine(model, zopt, cfg, comm, scheduler, device)
    return engine, zopt, scheduler, cfg


def _make_zero_optimizer(model: nn.Module, torch_opt, world: World, cfg: ZeroConfig, dtype,
                         device: torch.device) -> ZeroOptimizer:
    """Units, then the placement (masters taken in full precision), then the cast, then the stage
    policy: each part built from what the earlier ones made, none rewired afterwards."""
    comm = world.comm
    zero = cfg.zero_optimization
    check_hpz(zero.zero_hpz_partition_size, zero.stage, comm.world_size,
              zero.offload_param.device if zero.offload_param is not None else "none")
    check_elementwise(torch_opt)
    opt_comm, replicas = _mics_groups(model, world, cfg)
    scaler = LossScaler.from_config(cfg.fp16)
    syncs = HostSyncs()
    streams = Streams(device)  # the step's one owner of side streams and events
    group_of = {id(p): g for g, group in enumerate(torch_opt.param_groups)
                for p in group["params"] if p.requires_grad}
    # Every rank starts from rank 0's weights (as DDP does), taken in full precision before the
    # masters are made and the units cast, so unseeded initialisations cannot diverge.
    # The config's leaf modules are marked first: stage 3 makes each one unit (as DeepSpeed does,
    # the marks are set at every stage).
    apply_leaf_module_config(model, zero.leaf_module)
    units, layout = lay_out(model, group_of, opt_comm, zero.stage, zero.reduce_bucket_size,
                            zero.stage3_param_persistence_threshold, zero.zeroshard_unit_classes,
                            device)
    frozen = layout.frozen if layout is not None else []
    every = [*units, *frozen]  # stage 3's frozen units are sharded and cast too, never stepped
    if replicas is not None:  # frozen units too: every replica starts from rank 0's weights
        sync_replicas(every, layout.persistent, replicas)
    owned = owned_slices(units, zero.stage, opt_comm.rank, layout)
    if is_placeholder(torch_opt):
        placement = make_no_placement(torch_opt, units)
    else:
        placement = make_placement(zero.offload_optimizer if zero.stage > 0 else None, cfg.aio,
                                   torch_opt, units, owned, dtype, rank=comm.rank,
                                   master_dtype=_master_dtype(cfg), syncs=syncs,
                                   clip_norm=cfg.gradient_clipping,
                                   # a step that may be skipped is not stepped in backward
                                   loss_scaling=scaler.enabled or _skips_nonfinite(cfg),
                                   shards_land=zero.stage >= 2,
                                   streams=streams)
    del owned
    for unit in every:
        unit.cast(dtype or unit.dtype)
    store = None
    if layout is not None:  # the shards move to their placement now they are in the compute dtype
        store = make_store(zero.offload_param, cfg.aio,
                           [u for u in every if u.index not in layout.persistent],
                           rank=comm.rank, streams=streams)
    spec = _stage_spec(cfg, placement, units, dtype, replicas)
    policy = make_policy(units, opt_comm, spec, module=model, layout=layout, store=store,
                         syncs=syncs, early=placement.early, streams=streams)
    muon = None
    if getattr(torch_opt, "_zeroshard_muon", False):  # matrices dealt out to owner ranks
        muon = MuonExchange(units, opt_comm, torch_opt, sharded=policy.shards_optimizer,
                            momentum_dtype=_master_dtype(cfg), on_host=placement.name != "device")
    if zero.stage == 3 and zero.enable_sanity_checks:
        check_in_place_writes(p for unit in every for p in unit.params())
    return ZeroOptimizer(model, torch_opt, opt_comm, units, policy, placement,
                         clip_norm=cfg.gradient_clipping, scaler=scaler, syncs=syncs,
                         world_comm=comm,  # GatheredParameters' modifier_rank numbers the world
                         frozen_units=frozen, muon=muon,
                         skip_nonfinite=_skips_nonfinite(cfg))


def _stage_spec(cfg: ZeroConfig, placement, units, dtype, replicas: Comm | None) -> StageSpec:
    """The stage policy's frozen spec: the config's knobs plus what the placement decided."""
    zero = cfg.zero_optimization
    master_dtype = getattr(placement, "master_dtype", torch.float32)
    return StageSpec(
        stage=zero.stage, overlap_comm=zero.overlap_comm is not False,
        grad_place="cpu" if placement.name != "device" and zero.stage >= 2 else "device",
        reduction=_reduction(cfg),
        accum_dtype=accumulation_dtype(dtype or units[0].dtype, master_dtype) if units else None,
        keeps_gradients=not isinstance(placement, NoPlacement),
        stage3=Stage3Options(
            prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
            max_live_parameters=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            quantized_weights=zero.zero_quantized_weights,
            quantized_gradients=zero.zero_quantized_gradients,
            hpz_partition_size=zero.zero_hpz_partition_size,
            mics_replicas=replicas))


def _mics_groups(model: nn.Module, world: World, cfg: ZeroConfig) -> tuple[Comm, Comm | None]:
    """The optimizer's Comm and replica Comm: the World's MiCS shard group (consecutive ranks)
    and replica group (the same position in every shard group) when mics_shard_size is set
    (core/mics.py), else the world's Comm and None."""
    zero = cfg.zero_optimization
    comm = world.comm
    if zero.mics_shard_size <= 0:
        return comm, None
    offload = any(o is not None and o.device != "none"
                  for o in (zero.offload_optimizer, zero.offload_param))
    check_mics(zero.mics_shard_size, zero.stage, comm.world_size, zero.zero_hpz_partition_size,
               offload, any(hasattr(p, INIT_ATTR) for p in model.parameters()),
               zero.zero_quantized_weights or zero.zero_quantized_gradients)
    size = zero.mics_shard_size
    return world.split(blocks(comm.world_size, size)), world.split(strided(comm.world_size, size))


def _reduction(cfg: ZeroConfig) -> Reduction:
    """The top-level reduction keys (`communication_data_type`, `prescale_gradients`,
    `gradient_predivide_factor`, `gradient_allreduce_op`), with DeepSpeed's meaning
    (core/reduction.py)."""
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    return Reduction(dtype=dtypes.get(cfg.communication_data_type),
                     prescale=cfg.prescale_gradients, predivide=cfg.gradient_predivide_factor,
                     average=cfg.gradient_allreduce_op == "mean")


def _in_units(zopt: ZeroOptimizer) -> set[int]:
    """ids of the parameters the units hold (stage 3's frozen units included)."""
    return {id(p) for unit in zopt.all_units for p in unit.params()}


def _move_rest(model: nn.Module, zopt: ZeroOptimizer, device: torch.device, dtype) -> None:
    """Frozen parameters and buffers (what the units do not hold) to the compute device, floating
    ones in the compute dtype; a tensor registered twice stays one tensor."""
    in_units = _in_units(zopt)

    def place(tensor: torch.Tensor) -> torch.Tensor:
        out = to_device(tensor, device)
        return out.to(dtype) if dtype is not None and out.is_floating_point() else out

    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (original, placed)
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in in_units and id(param) not in done:
                done[id(param)] = (param, param)
                param.data = place(param.data)
        for name, buf in module._buffers.items():
            if buf is not None:
                if id(buf) not in done:
                    done[id(buf)] = (buf, place(buf))
                module._buffers[name] = done[id(buf)][1]


def _broadcast_from_rank0(model: nn.Module, zopt: ZeroOptimizer, comm: Comm) -> None:
    """Give every rank rank 0's frozen parameters and buffers (the units were synced already)."""
    if comm.world_size == 1:
        return
    in_units = _in_units(zopt)
    rest = [p.data for p in model.parameters() if id(p) not in in_units] + list(model.buffers())
    for tensor in rest:
        comm.broadcast(tensor, src=0)


def _make_scheduler(lr_scheduler, cfg: ZeroConfig, zopt: ZeroOptimizer):
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(zopt)
        return lr_scheduler
    if cfg.scheduler is not None:
        from .schedulers import build_scheduler

        return build_scheduler({"type": cfg.scheduler.type, "params": dict(cfg.scheduler.params)}, zopt)
    return None


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, config_params=None):
    """Wrap `model` for ZeRO training: returns `(engine, optimizer, dataloader, lr_scheduler)`."""
    if model is None:
        raise ValueError("initialize() needs model=<torch.nn.Module>")
    if mpu is not None:
        raise ValueError("model parallelism (mpu=) is not supported by zeroshard; pass mpu=None")
    if args is not None and getattr(args, "local_rank", 0) in (None, -1):
        args.local_rank = int(os.environ.get("LOCAL_RANK", 0))  # as DeepSpeed fills it in
    loader_batch = None
    from torch.utils.data import DataLoader

    if isinstance(training_data, DataLoader):  # its batch size answers an "auto" micro batch
        loader_batch, training_data = training_data.batch_size, training_data.dataset
    engine, zopt, scheduler, cfg = _build(model, optimizer, model_parameters, config,
                                          lr_scheduler, args, config_params, loader_batch)
    mark_engaged()
    loader = None
    if training_data is not None:
        loader = make_dataloader(training_data, cfg.train_micro_batch_size_per_gpu, engine.comm,
                                 collate_fn)
        engine.training_dataloader = loader  # its sampler's epoch goes into checkpoints
    return engine, zopt, loader, scheduler


def make_dataloader(dataset, micro_batch: int, comm: Comm, collate_fn=None):
    """A DataLoader over this rank's share of `dataset` at the micro batch size."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=comm.world_size, rank=comm.rank)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn)


def prepare(model: nn.Module, optimizer, config=None):
    """Shard `optimizer` over `model` for a plain `loss.backward(); opt.step(); opt.zero_grad()` loop.

    Returns `(model, optimizer)`: the same module (its parameters now live in zeroshard's flat
    buffers) and a `ZeroOptimizer` whose `.engine` gives `memory_report()` / `comm_report()`.
    Every `optimizer.step()` steps: accumulate by calling backward several times in between.
    """
    cfg_source = config if config is not None else {}
    if isinstance(cfg_source, dict) and "gradient_accumulation_steps" in cfg_source \
            and cfg_source["gradient_accumulation_steps"] != 1:
        warnings.warn("prepare(): gradient_accumulation_steps is ignored; every optimizer.step() "
                      "steps, so accumulate by calling backward() several times before it",
                      stacklevel=2)
        cfg_source = {k: v for k, v in cfg_source.items() if k != "gradient_accumulation_steps"}
    init_distributed()
    cfg = load_config(cfg_source, world_size=dist.get_world_size())
    if optimizer is None and cfg.optimizer is None:
        raise ValueError("prepare() needs an optimizer: pass a torch optimizer, or add an "
                         "\"optimizer\" block to the config (for inference only, use "
                         "zeroshard.initialize(model=..., config=...) without one)")
    if cfg.fp16.enabled:
        raise ValueError("prepare() cannot do fp16: plain loss.backward() skips loss scaling. "
                         "Use bf16 (\"bf16\": {\"enabled\": true}) or zeroshard.initialize() and "
                         "engine.backward(loss)")
    engine, zopt, _, _ = _build(model, optimizer, None, cfg, None)
    zopt.engine = engine
    return model, zopt


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()
