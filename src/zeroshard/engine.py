"""`initialize()`, the training `Engine`, and `prepare()` for users who keep their own loop.

The engine is the loop around the sharded optimizer: forward (with input casting in mixed
precision), backward (fp16 loss scaling and division by the accumulation steps), step at the
accumulation boundary only (then the LR scheduler, then clearing gradients), and the ledgers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .dist import Comm, default_device, init_distributed
from .config.auto import resolve_auto
from .config.refusals import check_hpz, check_mics, require_supported
from .config.schema import ZeroConfig, load_config, read_raw
from .core.desync import watch_collectives
from .core.hostmem import host_region, mark_cpu_as_host, to_device
from .core.layout import INIT_ATTR
from .core.mics import mics_comms
from .core.no_optimizer import REFUSAL, is_placeholder, make_no_placement, placeholder_optimizer
from .core.optim import ZeroOptimizer, build_optimizer
from .core.reduction import Reduction
from .core.deepspeed_views import ThroughputTimer
from .dist.process_group import mark_engaged
from .core.scaler import LossScaler
from .core.stage3 import Stage3Options
from .offload.optimizer import make_placement
from .offload.param import make_store

PLACEMENTS = ("device", "cpu", "nvme")


class Engine(nn.Module):
    """Wraps the user's model: forward, backward, step, ledgers (DeepSpeed's engine API)."""

    def __init__(self, module: nn.Module, optimizer: ZeroOptimizer, config: ZeroConfig,
                 comm: Comm, lr_scheduler=None, device: torch.device | None = None):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self._config = config
        self.comm = comm
        self.device = device or torch.device("cpu")
        self.scaler = optimizer.scaler
        #: Built without an optimizer (core/no_optimizer.py): forward only.
        self.inference_only = is_placeholder(optimizer.optimizer)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self.training_dataloader = None
        #: DeepSpeed's throughput timer (DeepSpeed-Chat reads it): core/deepspeed_views.py.
        self.tput_timer = ThroughputTimer(self)
        self.compute_dtype = _compute_dtype(config)
        autocast = config.torch_autocast
        self.autocast_dtype = getattr(torch, autocast.dtype) if autocast.enabled else None

    # -- DeepSpeed-style accessors -----------------------------------------------------------------
    @property
    def config(self) -> dict:
        """The resolved configuration as a plain dict."""
        return self._config.to_dict()

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Number of data-parallel ranks."""
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        """Rank within this node (LOCAL_RANK)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def train_batch_size(self) -> int:
        """Global batch per optimizer step (micro x accumulation x world size)."""
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per forward."""
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self._config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        """The configured ZeRO stage."""
        return self._config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        """Whether fp16 mixed precision is on."""
        return self._config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """Whether bf16 mixed precision is on."""
        return self._config.bf16.enabled

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next `step()` applies the optimizer."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force (or with None, stop forcing) the accumulation boundary."""
        self._boundary_override = is_boundary

    def get_lr(self) -> list[float]:
        """Current learning rate of every param group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Unclipped global gradient norm of the last applied step."""
        return self.optimizer.last_grad_norm

    def was_step_applied(self) -> bool:
        """False if the last boundary step was skipped (fp16 overflow)."""
        return self.optimizer.step_applied

    def get_loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 when loss scaling is off)."""
        return self.scaler.scale

    # -- the loop ----------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the wrapped module (floating inputs are cast to the compute dtype)."""
        if self.compute_dtype is not None:
            args = tuple(_cast(a, self.compute_dtype) for a in args)
            kwargs = {k: _cast(v, self.compute_dtype) for k, v in kwargs.items()}
        with self.comm.phase("forward"):
            if self.autocast_dtype is None:
                return self.module(*args, **kwargs)
            # The config's torch_autocast (DeepSpeed's): it also replaces an autocast the caller
            # opened.
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` scaled by the fp16 loss scale and 1/accumulation steps (not the
        latter with `scale_wrt_gas=False`: the caller divided already, as transformers does)."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward expects a scalar loss tensor; reduce it (e.g. "
                             f".mean()) first, got {type(loss).__name__} "
                             f"{tuple(loss.shape) if torch.is_tensor(loss) else ''}")
        if self.inference_only:
            raise RuntimeError(REFUSAL.format(what="engine.backward"))
        scale = self.scaler.scale / (self.gradient_accumulation_steps() if scale_wrt_gas else 1)
        self.optimizer.policy.expect_boundary(self.is_gradient_accumulation_boundary())
        with self.comm.phase("backward"):
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        """Apply the optimizer at the accumulation boundary; count the micro-step either way.

        A step refused for an inf/nan gradient (NonFiniteGradientError) is counted like an fp16
        skip before the error propagates, so a caller that catches it stays on the same
        accumulation schedule.
        """
        if self.inference_only:
            raise RuntimeError(REFUSAL.format(what="engine.step"))
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        applied = False
        try:
            with self.comm.phase("optimizer step"):
                applied = self.optimizer.step()
        finally:
            if applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self.skipped_steps += 1
            self.optimizer.zero_grad()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.micro_steps += 1
        if self._config.steps_per_print and self.global_steps % self._config.steps_per_print == 0 \
                and self.rank == 0 and _verbose():
            print(f"[zeroshard] step {self.global_steps} lr {self.get_lr()} "
                  f"loss_scale {self.scaler.scale:g}", flush=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients."""
        self.optimizer.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate without communicating (DDP's name). Below stage 2 gradients are only
        reduced at the accumulation boundary anyway, so this changes nothing; at stages 2-3 they
        are reduce-scattered in every backward (that is what shards them), so it is refused."""
        if self.zero_optimization_stage() >= 2:
            raise RuntimeError(
                f"engine.no_sync() is not possible at ZeRO stage {self.zero_optimization_stage()}: "
                "gradients are reduce-scattered during every backward, which is what keeps only "
                "1/N of them. Use gradient_accumulation_steps instead, or stage 0/1")
        yield

    # -- ledgers -----------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds, by kind (params/grads/optimizer/buffers) and placement
        ("device", "cpu" memory offload, "nvme" swap files)."""
        seen: set[int] = set()
        report = {kind: dict.fromkeys(PLACEMENTS, 0) for kind in ("params", "grads", "optimizer", "buffers")}
        for kind, placement, tensors in self.optimizer.ledger():
            _tally(report[kind], placement, tensors, seen)
        # What the units do not cover (frozen parameters) is on the device.
        _tally(report["params"], "device", [p.data for p in self.module.parameters()], seen)
        for kind, nbytes in self.optimizer.nvme_bytes().items():
            report[kind]["nvme"] += nbytes
        return report

    def comm_report(self) -> dict[str, int]:
        """Cumulative bytes this rank moved per collective kind (ring model), plus "total".

        "total" is also split into "intra_host" / "inter_host" (torchrun's node layout; see
        zeroshard.comm).
        """
        return self.comm.report()

    # -- checkpoints (checkpoint.py) ---------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Write a sharded checkpoint (every rank calls it); any world size and stage can load it."""
        from .checkpoint.sharded import save_checkpoint

        with self.comm.phase("save_checkpoint"):
            return save_checkpoint(self, save_dir, tag, client_state, save_latest,
                                   exclude_frozen=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Load a checkpoint written at any world size and stage: `(path, client_state)`, or
        `(None, None)` when `load_dir` has no `latest` and no tag was given. With
        `load_module_strict` (the default), parameters or buffers on one side only are an error."""
        from .checkpoint.sharded import load_checkpoint

        with self.comm.phase("load_checkpoint"):
            return load_checkpoint(self, load_dir, tag, load_optimizer_states,
                                   load_lr_scheduler_states, load_module_only,
                                   strict=load_module_strict)

    def gathered_model(self):
        """Context with every parameter whole on every rank (stage 3), e.g. around a generation loop.

        Forward passes inside it gather nothing; it costs the full model's memory on each rank.
        At stages 0-2 it is a no-op.
        """
        from .core.gathered import GatheredParameters

        return GatheredParameters(list(self.module.parameters()))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether `save_16bit_model` gathers stage-3 weights (stage3_gather_16bit_weights_on_model_save)."""
        return self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def consolidated_state_dict(self, rank0_only: bool = True) -> dict:
        """The whole model's state dict in the compute dtype, gathered unit by unit (all ranks call)."""
        from .core.gathered import full_state_dict

        return full_state_dict(self.module, rank0_only)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """DeepSpeed's name (used by Hugging Face Trainer and accelerate): the consolidated state
        dict on rank 0 (empty elsewhere), without frozen parameters if asked (PEFT adapters)."""
        state = self.consolidated_state_dict(rank0_only=True)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the weights in the compute dtype (safetensors for a `.safetensors`
        name, torch.save otherwise); at stage 3 only when stage3_gather_16bit_weights_on_model_save
        is true (False and a warning otherwise, as in DeepSpeed). Every rank calls it."""
        if self.zero_optimization_stage() == 3 and not self.zero_gather_16bit_weights_on_model_save():
            warnings.warn("save_16bit_model: nothing saved, because at stage 3 it needs "
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save=true "
                          "(or use engine.consolidated_state_dict())", stacklevel=2)
            return False
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                from .checkpoint.safetensors_file import write_safetensors

                # Tied weights appear under each of their names, as from_pretrained expects.
                write_safetensors(path, [(n, list(t.shape), t.dtype) for n, t in state.items()],
                                  state.values())
            else:
                tmp = path + ".partial"
                torch.save(state, tmp)
                os.replace(tmp, path)  # never a half-written file under the final name
        self.comm.barrier()
        return True

    def destroy(self, keep_parameters: bool = True) -> None:
        """Remove hooks and delete swap files; the engine is unusable afterwards. At stage 3 the
        model is gathered whole first, unless `keep_parameters=False` (then its parameters stay
        empty: use it for models too large to hold whole, after saving what you need)."""
        self.optimizer.close(keep_parameters)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = super().__getattr__("module")
            return getattr(module, name)


def _tally(bucket: dict, placement: str, tensors, seen: set[int]) -> None:
    """Add each distinct storage's bytes once under `placement`."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        bucket[placement] += storage.nbytes()


def _cast(value, dtype):
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    return value


def _verbose() -> bool:
    return os.environ.get("ZEROSHARD_QUIET", "0") != "1"


def _compute_dtype(config: ZeroConfig) -> torch.dtype | None:
    if config.fp16.enabled:
        return torch.float16
    if config.bf16.enabled:
        return torch.bfloat16
    return None


def _master_dtype(config: ZeroConfig) -> torch.dtype:
    """bf16 for DeepSpeed's bf16_master_weights_and_grads (with bf16_optimizer_states), else fp32."""
    bf16 = config.bf16
    if bf16.enabled and bf16.bf16_master_weights_and_grads and config.zero_optimization.stage > 0:
        return torch.bfloat16
    return torch.float32


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
        return build_optimizer(cfg.optimizer, params)
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
    comm = Comm()
    source = _resolve_config(config, args, config_params)
    if not isinstance(source, ZeroConfig):
        source = resolve_auto(read_raw(source), model=model, world_size=comm.world_size,
                              loader_batch=loader_batch, known=known)
    cfg = source if isinstance(source, ZeroConfig) else load_config(source, comm.world_size)
    require_supported(cfg)
    watch_collectives(comm, cfg.zero_optimization.zeroshard_desync_timeout)
    device = default_device()
    dtype = _compute_dtype(cfg)
    torch_opt = _make_optimizer(optimizer, model_parameters, model, cfg)
    _check_owned(torch_opt, model)
    with host_region():
        for tensor in [*model.parameters(), *model.buffers()]:
            mark_cpu_as_host(tensor)  # strict mode: a model built on the CPU is in host memory
        zopt = _make_zero_optimizer(model, torch_opt, comm, cfg, dtype, device)
        # The units are on the device now (stage 3: one at a time, never the whole model); the
        # rest follows: frozen parameters and buffers, in the compute dtype.
        _move_rest(model, zopt, device, dtype)
        _broadcast_from_rank0(model, zopt, comm)
    scheduler = _make_scheduler(lr_scheduler, cfg, zopt)
    engine = Engine(model, zopt, cfg, comm, scheduler, device)
    return engine, zopt, scheduler, cfg


def _make_zero_optimizer(model: nn.Module, torch_opt, comm: Comm, cfg: ZeroConfig, dtype,
                         device: torch.device) -> ZeroOptimizer:
    zero = cfg.zero_optimization
    check_hpz(zero.zero_hpz_partition_size, zero.stage, comm.world_size,
              zero.offload_param.device if zero.offload_param is not None else "none")
    opt_comm, replicas = _mics_groups(model, comm, cfg)
    scaler = LossScaler.from_config(cfg.fp16)
    zopt = ZeroOptimizer(model, torch_opt, opt_comm, stage=zero.stage,
                         bucket_numel=zero.reduce_bucket_size, compute_dtype=dtype,
                         clip_norm=cfg.gradient_clipping, scaler=scaler,
                         overlap_comm=zero.overlap_comm is not False,
                         stage3=Stage3Options(
                             prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
                             max_live_parameters=zero.stage3_max_live_parameters,
                             max_reuse_distance=zero.stage3_max_reuse_distance,
                             quantized_weights=zero.zero_quantized_weights,
                             quantized_gradients=zero.zero_quantized_gradients,
                             make_store=functools.partial(make_store, zero.offload_param, cfg.aio,
                                                          rank=comm.rank),
                             hpz_partition_size=zero.zero_hpz_partition_size,
                             mics_replicas=replicas),
                         persistence_threshold=zero.stage3_param_persistence_threshold,
                         unit_classes=zero.zeroshard_unit_classes,
                         make_placement=make_no_placement if is_placeholder(torch_opt) else
                         functools.partial(
                             make_placement, zero.offload_optimizer if zero.stage > 0 else None,
                             cfg.aio, rank=comm.rank, master_dtype=_master_dtype(cfg)),
                         device=device, reduction=_reduction(cfg),
                         world_comm=comm)  # GatheredParameters' modifier_rank numbers the world
    return zopt


def _mics_groups(model: nn.Module, comm: Comm, cfg: ZeroConfig) -> tuple[Comm, Comm | None]:
    """The optimizer's Comm and replica Comm: MiCS shard and replica groups when mics_shard_size
    is set (core/mics.py), else the world's Comm and None."""
    zero = cfg.zero_optimization
    if zero.mics_shard_size <= 0:
        return comm, None
    offload = any(o is not None and o.device != "none"
                  for o in (zero.offload_optimizer, zero.offload_param))
    check_mics(zero.mics_shard_size, zero.stage, comm.world_size, zero.zero_hpz_partition_size,
               offload, any(hasattr(p, INIT_ATTR) for p in model.parameters()),
               zero.zero_quantized_weights or zero.zero_quantized_gradients)
    return mics_comms(comm, zero.mics_shard_size)


def _reduction(cfg: ZeroConfig) -> Reduction:
    """The top-level reduction keys (`communication_data_type`, `prescale_gradients`,
    `gradient_predivide_factor`), with DeepSpeed's meaning (core/reduction.py)."""
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    return Reduction(dtype=dtypes.get(cfg.communication_data_type),
                     prescale=cfg.prescale_gradients, predivide=cfg.gradient_predivide_factor)


def _move_rest(model: nn.Module, zopt: ZeroOptimizer, device: torch.device, dtype) -> None:
    """Frozen parameters and buffers (what the units do not hold) to the compute device, floating
    ones in the compute dtype; a tensor registered twice stays one tensor."""
    in_units = {id(p) for unit in zopt.units for p in unit.params()}

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
    in_units = {id(p) for unit in zopt.units for p in unit.params()}
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
