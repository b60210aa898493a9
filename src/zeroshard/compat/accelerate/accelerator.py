"""`from zeroshard import Accelerator`: Hugging Face Accelerate's loop on zeroshard's ZeRO engine.

The seed's loop runs with one import changed:

    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    for batch in train_loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

`prepare` builds one `zeroshard.initialize` engine from the model, its optimizer and scheduler,
with the ZeRO stage and offload from `Accelerator(...)` keywords, a DeepSpeedPlugin, a DeepSpeed
JSON config or the launcher's `accelerate config` YAML (accelerate_config.py); data loaders are
sharded across ranks (accelerate_data.py). The prepared model is the engine. As with Accelerate's
DeepSpeed integration, the engine owns accumulation, clipping, mixed precision and the LR
scheduler: `backward` divides the loss by gradient_accumulation_steps (and scales it under fp16),
the optimizer step of an accumulation window is taken by `optimizer.step()` (or, at that step's
own threshold, by `clip_grad_norm_`), `optimizer.zero_grad()` and `scheduler.step()` change
nothing because the engine clears gradients and steps the scheduler once per applied step. The
window ends every gradient_accumulation_steps backwards (DeepSpeed's count); inside
`accumulate(model)` it follows Accelerate's rule instead (that count, and the end of the data).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from ...dist import default_device, init_distributed
from ...dist.world import World
from ...config.auto import resolve_auto
from ...build import initialize
from ...engine import Engine
from .config import (ENV, DeepSpeedPlugin, build_deepspeed_config,
                                read_accelerate_config, zero3_init_flag)
from .data import PreparedDataLoader, SkipBatches
from .ranks import RankMixin

__all__ = ["Accelerator", "DeepSpeedPlugin"]

STATE_TAG = "accelerator_state"
# Accelerate keywords zeroshard accepts at their default only: (default, why not otherwise).
_FIXED = {"split_batches": (False, "batches are never split; each rank gets whole batches"),
          "even_batches": (True, "every rank gets as many batches"),
          "dispatch_batches": (None, "every rank reads its own batches"),
          "fsdp_plugin": (None, "zeroshard runs ZeRO, not FSDP"),
          "megatron_lm_plugin": (None, "no Megatron-LM"), "dynamo_backend": (None, "no torch.compile"),
          "dynamo_plugin": (None, "no torch.compile"), "torch_tp_plugin": (None, "no tensor parallelism"),
          "parallelism_config": (None, "data parallelism only"),
          "use_seedable_sampler": (False, "the sampler is seeded by zeroshard already")}
_IGNORED = {"rng_types", "kwargs_handlers", "dataloader_config", "project_config", "log_with",
            "step_scheduler_with_optimizer", "gradient_accumulation_plugin"}


class Accelerator(RankMixin):
    """Accelerate's Accelerator, running ZeRO (stages 0-3, CPU/NVMe offload) through zeroshard."""

    def __init__(self, *, mixed_precision: str | None = None,
                 gradient_accumulation_steps: int | None = None, cpu: bool = False,
                 deepspeed_plugin: DeepSpeedPlugin | None = None, deepspeed_config=None,
                 zero_stage: int | None = None, offload_optimizer_device: str | None = None,
                 offload_param_device: str | None = None, gradient_clipping: float | None = None,
                 device_placement: bool = True, project_dir: str | None = None, **accelerate_kwargs):
        for name, value in accelerate_kwargs.items():
            if name in _FIXED and value != _FIXED[name][0]:
                raise ValueError(f"Accelerator({name}={value!r}) is not supported by zeroshard "
                                 f"({_FIXED[name][1]}); leave it out")
            if name not in _FIXED and name not in _IGNORED:
                raise TypeError(f"Accelerator() got an unexpected keyword argument {name!r}")
        if isinstance(deepspeed_plugin, dict):
            raise ValueError("Accelerator(deepspeed_plugin={...}): several DeepSpeed plugins are "
                             "not supported; pass one DeepSpeedPlugin")
        if cpu and torch.cuda.is_available():
            raise ValueError("Accelerator(cpu=True) on a machine with CUDA: hide the GPUs instead "
                             "(CUDA_VISIBLE_DEVICES= , or use_cpu: true in the accelerate config "
                             "given to zeroshard run --config_file)")
        init_distributed()
        self.comm = World.current().comm
        launcher_path = os.environ.get(ENV)
        launcher = read_accelerate_config(launcher_path) if launcher_path else None
        plugin = accelerate_kwargs.get("gradient_accumulation_plugin")
        if gradient_accumulation_steps is None and getattr(plugin, "num_steps", None):
            gradient_accumulation_steps = plugin.num_steps
        arguments = {"mixed_precision": mixed_precision, "zero_stage": zero_stage,
                     "gradient_accumulation_steps": gradient_accumulation_steps,
                     "offload_optimizer_device": offload_optimizer_device,
                     "offload_param_device": offload_param_device,
                     "gradient_clipping": gradient_clipping}
        self._config = build_deepspeed_config(arguments=arguments, plugin=deepspeed_plugin,
                                              deepspeed_config=deepspeed_config, launcher=launcher)
        self.zero3_init_flag = zero3_init_flag(deepspeed_plugin, launcher)
        notices = list(launcher.notices if launcher else [])
        if accelerate_kwargs.get("log_with"):
            notices.append("Accelerator(log_with=...): trackers are not supported by zeroshard; "
                           "log() does nothing")
        for notice in notices:
            self._notice(notice)
        self.device_placement = device_placement
        self.project_dir = project_dir
        self.engine: Engine | None = None
        self._loaders: list[PreparedDataLoader] = []
        self._checkpointed: list = []
        self._active: list[PreparedDataLoader] = []
        self._ends: dict[int, bool] = {}
        self._sync, self._pending, self._in_accumulate, self._accumulate_step = True, False, False, 0
        self._backward_seen = False  # an accelerator.backward since the last optimizer.step()

    # -- who and where -----------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        """Number of ranks."""
        return self.comm.world_size

    @property
    def process_index(self) -> int:
        """This rank."""
        return self.comm.rank

    @property
    def local_process_index(self) -> int:
        """This rank on its node (LOCAL_RANK)."""
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    @property
    def is_main_process(self) -> bool:
        """Rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Local rank 0 (the first process on each node)."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """The last rank."""
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.num_processes > 1

    @property
    def distributed_type(self):
        """Accelerate's `DistributedType.DEEPSPEED` (a str enum; the plain string "DEEPSPEED"
        without accelerate installed): every run here is a DeepSpeed-style ZeRO engine."""
        try:
            from accelerate.utils import DistributedType
        except ImportError:
            return "DEEPSPEED"
        return DistributedType.DEEPSPEED

    @property
    def device(self) -> torch.device:
        """The compute device: cuda:LOCAL_RANK with CUDA, else the CPU."""
        return self.engine.device if self.engine is not None else default_device()

    @property
    def mixed_precision(self) -> str:
        """"bf16", "fp16" or "no"."""
        config = self.deepspeed_config
        for name in ("bf16", "fp16"):
            if (config.get(name) or {}).get("enabled") is True:
                return name
        return "no"

    @property
    def deepspeed_config(self) -> dict:
        """The DeepSpeed config the engine runs (resolved once prepare built it)."""
        return self.engine.config if self.engine is not None else copy.deepcopy(self._config)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Backward passes per optimizer step."""
        if self.engine is not None:
            return self.engine.gradient_accumulation_steps()
        return int(self._config.get("gradient_accumulation_steps") or 1)

    @property
    def sync_gradients(self) -> bool:
        """Whether the current backward ends an accumulation window (the optimizer steps)."""
        return self._sync

    # -- prepare -----------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """Return `args` prepared, in the same order: the model becomes the engine, its optimizer
        and schedulers step through it, data loaders are sharded; anything else is unchanged."""
        out = list(args)
        models = [i for i, a in enumerate(args) if isinstance(a, nn.Module) and not isinstance(a, Engine)]
        optimizers = [i for i, a in enumerate(args)
                      if isinstance(a, torch.optim.Optimizer) and not isinstance(a, AcceleratedOptimizer)]
        schedulers = [i for i, a in enumerate(args) if _is_scheduler(a)]
        if len(models) > 1 or (models and self.engine is not None):
            raise ValueError("prepare(): one model per Accelerator (as with Accelerate's DeepSpeed "
                             "integration); this one already has one")
        if len(optimizers) > 1:
            raise ValueError("prepare(): one optimizer per model; combine them as param groups")
        if optimizers and not models:
            raise ValueError("prepare(): pass the optimizer in the same prepare() call as its model")
        for i, arg in enumerate(args):
            if isinstance(arg, DataLoader):
                out[i] = self._prepare_loader(arg, device_placement)
        if models:
            optimizer = args[optimizers[0]] if optimizers else None
            scheduler = next((args[i] for i in schedulers
                              if optimizer is not None and args[i].optimizer is optimizer), None)
            self._build(args[models[0]], optimizer, scheduler)
            out[models[0]] = self.engine
            if optimizers:
                out[optimizers[0]] = AcceleratedOptimizer(self)
        for i in schedulers:
            out[i] = self._prepare_scheduler(args[i])
        return out[0] if len(out) == 1 else tuple(out)

    def _build(self, model: nn.Module, optimizer, scheduler) -> None:
        config = copy.deepcopy(self._config)
        if optimizer is None and "optimizer" not in config:
            raise ValueError("prepare(): the model needs its optimizer in the same call (or an "
                             "\"optimizer\" block in the DeepSpeed config)")
        micro = next((loader.batch_size for loader in self._loaders if loader.batch_size), None)
        if micro is not None and config.get("train_micro_batch_size_per_gpu") in (None, "auto") \
                and config.get("train_batch_size") in (None, "auto"):
            config["train_micro_batch_size_per_gpu"] = micro
        config = resolve_auto(config, model=model, world_size=self.num_processes, loader_batch=micro)
        built_partitioned = any(hasattr(p, "ds_numel") for p in model.parameters())
        self.engine = initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                 config=config)[0]
        if self.zero3_init_flag and self.engine.zero_optimization_stage() == 3 and not built_partitioned:
            self._notice("zero3_init_flag: the model was built whole and partitioned by prepare(); "
                         "to build it partitioned, construct it under "
                         "`with zeroshard.Init(config=accelerator.deepspeed_config):`")

    def _prepare_loader(self, loader: DataLoader, device_placement) -> PreparedDataLoader:
        seed = torch.zeros(1, dtype=torch.int64)
        if self.is_main_process and isinstance(loader.sampler, RandomSampler):
            # Drawn as RandomSampler would draw its own (from its generator, else torch's).
            seed.random_(0, 2**62, generator=loader.sampler.generator)
        self.comm.broadcast(seed, src=0)
        place = self.device_placement if device_placement is None else device_placement
        prepared = PreparedDataLoader(loader, self.num_processes, self.process_index,
                                      self.device if place else None, int(seed.item()), state=self)
        self._loaders.append(prepared)
        return prepared

    def _prepare_scheduler(self, scheduler):
        engine = self.engine
        if engine is None or scheduler.optimizer is not engine.optimizer.optimizer:
            raise ValueError("prepare(): a scheduler is prepared with (or after) its model and "
                             "optimizer, and must have been built over that optimizer")
        if engine.lr_scheduler is None:
            engine.lr_scheduler = scheduler
        elif engine.lr_scheduler is not scheduler:
            raise ValueError("prepare(): the engine already steps another LR scheduler")
        return AcceleratedScheduler(scheduler)

    # -- the training step -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """engine.backward(loss): divided by gradient_accumulation_steps (and fp16-scaled)."""
        engine = self._engine("backward")
        if self._pending:
            raise RuntimeError(
                "accelerator.backward(): the previous backward ended an accumulation window but "
                "optimizer.step() was not called; call optimizer.step() after backward (the "
                "prepared optimizer applies the step there)")
        if self._in_accumulate:
            engine.set_gradient_accumulation_boundary(self._sync)
        else:
            engine.set_gradient_accumulation_boundary(None)
            self._sync = engine.is_gradient_accumulation_boundary()
        engine.backward(loss, **kwargs)
        self._backward_seen = True
        if self._sync:
            self._pending = True
        else:
            engine.step()  # counts the micro-step; nothing is applied

    def _step(self) -> None:
        """Apply the pending optimizer step of this accumulation window (if any)."""
        if self._pending:
            self._pending = False
            self.engine.step()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        """Clip this window's step at `max_norm` (the global norm over every shard) and apply it;
        returns the unclipped norm. Between boundaries: the last applied step's norm."""
        engine = self._engine("clip_grad_norm_")
        if norm_type != 2:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): ZeRO clips by the global "
                             "L2 norm over all shards; use norm_type=2")
        trainable = {id(p) for p in engine.module.parameters() if p.requires_grad}
        given = {id(p) for p in parameters}
        if not trainable <= given:
            raise ValueError("clip_grad_norm_: zeroshard clips all of the model's parameters "
                             "together (one global norm over the shards); pass model.parameters()")
        if self._pending:
            saved = engine.optimizer.clip_norm
            engine.optimizer.clip_norm = float(max_norm)
            try:
                self._step()
            finally:
                engine.optimizer.clip_norm = saved
        norm = engine.get_global_grad_norm()
        return None if norm is None else torch.tensor(norm, device=self.device)

    def clip_grad_value_(self, parameters, clip_value: float):
        """Not possible under ZeRO (as in Accelerate's DeepSpeed integration)."""
        raise NotImplementedError("clip_grad_value_ is not supported with ZeRO, which clips by "
                                  "the global norm: use clip_grad_norm_ or gradient_clipping")

    @contextlib.contextmanager
    def accumulate(self, *models):
        """Accelerate's accumulation window: the step happens every gradient_accumulation_steps
        entries and at the last batch of a prepared data loader."""
        self._accumulate_step += 1
        if self.end_of_dataloader_now:
            self._accumulate_step, self._sync = 0, True
        else:
            self._sync = self._accumulate_step % self.gradient_accumulation_steps == 0
        self._in_accumulate = True
        try:
            yield
        finally:
            self._in_accumulate = False

    def no_sync(self, model):
        """engine.no_sync(): nothing at stages 0-1, refused at 2-3 (use accumulate instead)."""
        return self._engine("no_sync").no_sync()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last step was skipped (fp16 overflow)."""
        return self.engine is not None and self.engine.global_steps > 0 and \
            not self.engine.was_step_applied()

    def autocast(self, autocast_handler=None):
        """torch.autocast in the mixed-precision dtype ("no": nothing)."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's model inside a prepared engine (the model itself otherwise)."""
        return model.module if isinstance(model, Engine) else model

    # -- data --------------------------------------------------------------------------------------
    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """The prepared loader's current epoch without its first `num_batches` batches."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise ValueError("skip_first_batches takes a data loader returned by prepare()")
        return SkipBatches(dataloader, num_batches)

    def begin(self, loader: PreparedDataLoader) -> None:
        """A prepared loader starts an iteration (called by the loader)."""
        self._active.append(loader)
        self._ends[id(loader)] = False

    def mark_end(self, loader: PreparedDataLoader) -> None:
        """A prepared loader is about to hand out its last batch (called by the loader)."""
        self._ends[id(loader)] = True

    def finish(self, loader: PreparedDataLoader) -> None:
        """A prepared loader's iteration ended (called by the loader)."""
        if loader in self._active:
            self._active.remove(loader)
        self._ends.pop(id(loader), None)

    @property
    def end_of_dataloader_now(self) -> bool:
        """Whether the innermost running prepared loader has handed out its last batch."""
        return bool(self._active) and self._ends.get(id(self._active[-1]), False)

    # -- saving ------------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects) -> None:
        """Objects with state_dict()/load_state_dict() that save_state/load_state keep too."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"register_for_checkpointing: {type(obj).__name__} has no "
                                 "state_dict()/load_state_dict()")
        self._checkpointed.extend(objects)

    def save_state(self, output_dir: str | None = None, **kwargs) -> str:
        """A zeroshard checkpoint of everything prepare() made (engine, optimizer, scheduler, RNG,
        data loader epochs, registered objects) under output_dir; every rank calls it."""
        if output_dir is None:
            raise ValueError("save_state() needs output_dir (automatic checkpoint naming is not "
                             "supported)")
        client = {"loaders": [loader.state_dict() for loader in self._loaders],
                  "accumulate_step": self._accumulate_step,
                  "custom": [obj.state_dict() for obj in self._checkpointed]}
        return self._engine("save_state").save_checkpoint(output_dir, tag=STATE_TAG,
                                                          client_state={"accelerator": client})

    def load_state(self, input_dir: str | None = None, **kwargs) -> None:
        """Restore what save_state wrote (any world size or stage can load it)."""
        engine = self._engine("load_state")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path, client = engine.load_checkpoint(input_dir)
        if path is None:
            raise FileNotFoundError(f"load_state: no checkpoint in {input_dir} (no 'latest' file)")
        state = (client or {}).get("accelerator", {})
        loaders = state.get("loaders", [])
        if len(loaders) != len(self._loaders):
            raise ValueError(f"load_state: {input_dir} was saved with {len(loaders)} prepared data "
                             f"loaders, this run has {len(self._loaders)}; prepare the same ones")
        for loader, saved in zip(self._loaders, loaders):
            loader.load_state_dict(saved)
        for obj, saved in zip(self._checkpointed, state.get("custom", [])):
            obj.load_state_dict(saved)
        self._accumulate_step = int(state.get("accumulate_step", 0))
        self._pending = False

    def get_state_dict(self, model, unwrap: bool = True) -> dict:
        """The whole model's state dict on rank 0 (empty elsewhere), gathered unit by unit."""
        return self._engine("get_state_dict").consolidated_state_dict(rank0_only=True)

    def save_model(self, model, save_directory: str, max_shard_size="10GB",
                   safe_serialization: bool = True) -> None:
        """Rank 0 writes the whole model (model.safetensors, or shards + index); all ranks call."""
        from ...checkpoint.consolidate import parse_size
        from ...checkpoint.safetensors_file import write_safetensors

        state = self._engine("save_model").consolidated_state_dict(rank0_only=True)
        if self.is_main_process:
            os.makedirs(save_directory, exist_ok=True)
            limit = parse_size(max_shard_size)
            shards, size = [[]], 0
            for name, tensor in state.items():
                nbytes = tensor.numel() * tensor.element_size()
                if shards[-1] and size + nbytes > limit:
                    shards.append([])
                    size = 0
                shards[-1].append(name)
                size += nbytes
            ext = "safetensors" if safe_serialization else "bin"
            stem = "model" if safe_serialization else "pytorch_model"
            names = [f"{stem}.{ext}"] if len(shards) == 1 else \
                [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
            for file, keys in zip(names, shards):
                path = os.path.join(save_directory, file)
                if safe_serialization:
                    write_safetensors(path, [(k, list(state[k].shape), state[k].dtype) for k in keys],
                                      [state[k] for k in keys])
                else:
                    torch.save({k: state[k] for k in keys}, path)
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                        for t in state.values())},
                         "weight_map": {k: file for file, keys in zip(names, shards) for k in keys}}
                with open(os.path.join(save_directory, f"{stem}.{ext}.index.json"), "w") as fh:
                    json.dump(index, fh, indent=2)
        self.wait_for_everyone()

    # -- trackers (none) ---------------------------------------------------------------------------
    def init_trackers(self, project_name: str, config=None, init_kwargs=None) -> None:
        """Experiment trackers are not supported: nothing is started."""

    def log(self, values: dict, step: int | None = None, log_kwargs=None) -> None:
        """Experiment trackers are not supported: nothing is logged."""

    def end_training(self) -> None:
        """Wait for every rank (there are no trackers to close)."""
        self.wait_for_everyone()

    # -- helpers -----------------------------------------------------------------------------------
    def _engine(self, what: str) -> Engine:
        if self.engine is None:
            raise RuntimeError(f"accelerator.{what}(): prepare the model (with its optimizer) "
                               "first: model, optimizer = accelerator.prepare(model, optimizer)")
        return self.engine

    def _notice(self, message: str) -> None:
        if self.is_main_process:
            warnings.warn(f"zeroshard Accelerator: {message}", stacklevel=3)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """The prepared optimizer: `step()` applies the accumulation window's pending step;
    `zero_grad()` does nothing (the engine clears gradients after each applied step)."""

    def __init__(self, accelerator: Accelerator):
        # torch.optim.Optimizer.__init__ is not called: the state is the engine's.
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self.accelerator = accelerator
        self.optimizer = accelerator.engine.optimizer

    param_groups = property(lambda self: self.optimizer.param_groups,
                            doc="The engine's param groups (LR schedulers act on them).")
    state = property(lambda self: self.optimizer.state, doc="The engine's optimizer state.")
    defaults = property(lambda self: self.optimizer.defaults, doc="The optimizer's defaults.")

    def step(self, closure=None) -> None:
        """Apply the step of the accumulation window that the last backward ended (if any)."""
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported with ZeRO")
        if not self.accelerator._backward_seen:
            raise RuntimeError("optimizer.step() without accelerator.backward(loss) since the last "
                               "step: call accelerator.backward(loss) instead of loss.backward() "
                               "(the engine scales, accumulates and steps through it)")
        self.accelerator._backward_seen = False
        self.accelerator._step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Nothing: the engine clears gradients after each applied step."""

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped (fp16 overflow)."""
        return self.accelerator.optimizer_step_was_skipped

    def state_dict(self):
        """The engine optimizer's state dict (save_state saves everything together)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load into the engine's optimizer."""
        self.optimizer.load_state_dict(state_dict)


class AcceleratedScheduler:
    """The prepared LR scheduler: the engine steps it once per applied optimizer step, so
    `step()` does nothing; everything else is the scheduler's."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def step(self, *args, **kwargs) -> None:
        """Nothing: the engine steps the scheduler after each applied optimizer step."""

    def __getattr__(self, name: str):
        scheduler = self.__dict__.get("scheduler")
        if scheduler is None:
            raise AttributeError(name)
        return getattr(scheduler, name)


def _is_scheduler(obj) -> bool:
    return not isinstance(obj, (nn.Module, torch.optim.Optimizer, AcceleratedScheduler)) and \
        hasattr(obj, "step") and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)
