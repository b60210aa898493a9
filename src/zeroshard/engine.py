"""The training `Engine` (built by `build.py`'s `initialize()` / `prepare()`).

The engine is the loop around the sharded optimizer: forward (with input casting in mixed
precision), backward (fp16 loss scaling and division by the accumulation steps; a plain
`loss.backward()` on its outputs does the same, core/user_backward.py), step at the accumulation
boundary only (then the LR scheduler, then clearing gradients), and the ledgers. With
`managed_gradient_accumulation: false` the caller owns the boundary: every `step()` is one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .dist import Comm
from .config.schema import ZeroConfig
from .monitor.timers import ThroughputTimer
from .core.no_optimizer import REFUSAL, is_placeholder
from .core.optim import ZeroOptimizer
from .activations.checkpointing import use_engine_config
from .monitor import MonitorMaster, TrainingWatch
from .core.user_backward import UserBackward
from .train_state import TrainState

PLACEMENTS = ("device", "cpu", "nvme")


def _kept(name: str, doc: str) -> property:
    """An engine attribute kept in its TrainState (which checkpoints save and load)."""
    return property(lambda self: getattr(self.train_state, name),
                    lambda self, value: setattr(self.train_state, name, value), doc=doc)


class Engine(nn.Module):
    """Wraps the user's model: forward, backward, step, ledgers (DeepSpeed's engine API)."""

    global_steps = _kept("global_steps", "Boundaries reached: optimizer steps, skipped included.")
    global_samples = _kept("global_samples", "Samples trained on, over all ranks.")
    micro_steps = _kept("micro_steps", "Micro-steps (step() calls) taken.")
    skipped_steps = _kept("skipped_steps", "Boundaries whose optimizer step was skipped.")
    lr_scheduler = _kept("lr_scheduler", "The LR scheduler stepped after each applied step.")
    training_dataloader = _kept("dataloader", "The DataLoader initialize() built, or None.")

    def __init__(self, module: nn.Module, optimizer: ZeroOptimizer, config: ZeroConfig,
                 comm: Comm, lr_scheduler=None, device: torch.device | None = None):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        #: Counters, LR scheduler, DataLoader, loss scaler, RNG: what checkpoints save of the run.
        self.train_state = TrainState(optimizer, lr_scheduler,
                                      config.gradient_accumulation_steps)
        #: This rank's shards as checkpoints save them (core/state.ShardedState), made at the
        #: first save or load (it imports torch.distributed.checkpoint) and reused.
        self._shards = None
        self._config = config
        self.comm = comm
        self.device = device or torch.device("cpu")
        self.scaler = optimizer.scaler
        #: Built without an optimizer (core/no_optimizer.py): forward only.
        self.inference_only = is_placeholder(optimizer.optimizer)
        self._boundary_override: bool | None = None
        #: DeepSpeed's `managed_gradient_accumulation`: False, the caller's step() is the boundary.
        self._managed = config.managed_gradient_accumulation
        self._in_step = False  # step() is running (the boundary of unmanaged accumulation)
        self._backwards = 0  # unmanaged: backward passes since the last step()
        self._inside_no_sync = False  # no_sync() or coalesce_grad_reduction() is open
        #: DeepSpeed's flag: gradients are averaged (gradient_allreduce_op "mean"), not summed.
        self.gradient_average = config.gradient_allreduce_op == "mean"
        self._user_backward = UserBackward(self)
        #: DeepSpeed's throughput timer (DeepSpeed-Chat reads it): monitor/timers.py.
        self.tput_timer = ThroughputTimer(self)
        self.compute_dtype = _compute_dtype(config)
        autocast = config.torch_autocast
        self.autocast_dtype = None if not autocast.enabled else \
            getattr(torch, autocast.dtype) if autocast.dtype is not None else \
            torch.get_autocast_dtype(self.device.type)  # no dtype: torch's own default
        #: DeepSpeed's engine.monitor (TensorBoard/CSV/W&B/Comet writers, rank 0), and what the
        #: loop reports: log line, wall-clock breakdown, flops profile (zeroshard/monitor/).
        self.monitor = MonitorMaster(config, comm.rank)
        self._watch = TrainingWatch(self, self.monitor)
        use_engine_config(config.activation_checkpointing,  # deepspeed.checkpointing's defaults
                          "activation_checkpointing" in config.model_fields_set)

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

    def managed_gradient_accumulation(self) -> bool:
        """Whether the engine counts micro-steps to find the boundary (the config key)."""
        return self._managed

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next `step()` applies the optimizer (unmanaged: only while step() runs)."""
        if not self._managed:
            return self._in_step
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force (or with None, stop forcing) the accumulation boundary."""
        if not self._managed:
            raise RuntimeError(
                "set_gradient_accumulation_boundary() with managed_gradient_accumulation=false: "
                "the caller owns the boundary already (every step() is one, as in DeepSpeed); "
                "drop the call, or set managed_gradient_accumulation true")
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
        """Run the wrapped module (floating inputs are cast to the compute dtype); a plain
        `backward()` of a loss computed from the outputs works as `engine.backward(loss)`."""
        if self.compute_dtype is not None:
            args = tuple(_cast(a, self.compute_dtype) for a in args)
            kwargs = {k: _cast(v, self.compute_dtype) for k, v in kwargs.items()}
        with self.comm.phase("forward"), self._watch.forward(args, kwargs):
            if self.autocast_dtype is None:
                output = self.module(*args, **kwargs)
            else:
                # The config's torch_autocast (DeepSpeed's): it also replaces an autocast the
                # caller opened.
                with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                    output = self.module(*args, **kwargs)
        return output if self.inference_only else self._user_backward.wrap(output)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale, for a plain `.backward()` (DeepSpeed's name; the
        division by the accumulation steps happens in that backward)."""
        if self.inference_only:
            raise RuntimeError(REFUSAL.format(what="engine.scale"))
        return self._user_backward.scale(loss)

    def _count_backward(self) -> None:
        """One backward pass began (unmanaged accumulation counts them for global_samples)."""
        with self.comm.phase("backward"):  # counted as engine.backward's are (dist/comm.py tags)
            pass
        if not self._managed:
            self._backwards += 1

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
        self.optimizer.policy.note_loss(loss)
        if not self._managed:
            self._backwards += 1
        with self.comm.phase("backward"), self._watch.backward(loss), \
                self._user_backward.engine_backward(loss):
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        """Apply the optimizer at the accumulation boundary (every call under unmanaged
        accumulation); count the micro-step either way.

        A step refused for an inf/nan gradient (NonFiniteGradientError) is counted like an fp16
        skip before the error propagates, so a caller that catches it stays on the same
        accumulation schedule.
        """
        if self.inference_only:
            raise RuntimeError(REFUSAL.format(what="engine.step"))
        if self._inside_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync() or "
                               "engine.coalesce_grad_reduction(): leave the block first (as "
                               "DeepSpeed requires); it reduces the gradients as it closes")
        self._in_step = True  # unmanaged accumulation: step() is the boundary
        try:
            if not self.is_gradient_accumulation_boundary():
                self.micro_steps += 1
                return
            self._optimizer_step()
        finally:
            self._in_step = False
        self._watch.after_step()  # steps_per_print line, monitor events, flops profile

    def _optimizer_step(self) -> None:
        """The boundary's optimizer step, LR scheduler, gradient clearing and counters."""
        applied = False
        try:
            with self.comm.phase("optimizer step"), self._watch.step():
                applied = self.optimizer.step()
        finally:
            if applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self.skipped_steps += 1
            self.optimizer.zero_grad()
            self.global_steps += 1
            if self._managed:
                self.global_samples += self.train_batch_size()
            else:  # the micro-batches actually accumulated, as DeepSpeed counts them
                per_backward = self.train_batch_size() // self.gradient_accumulation_steps()
                self.global_samples += per_backward * self._backwards
                self._backwards = 0
            self.micro_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients."""
        self.optimizer.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate without communicating (DDP's name). Below stage 2 gradients are only
        reduced at the accumulation boundary anyway, so this changes nothing; at stages 2-3 they
        are reduce-scattered in every backward (that is what shards them), so it is refused
        (`coalesce_grad_reduction` defers them instead). `step()` inside is refused."""
        if self.zero_optimization_stage() >= 2:
            raise RuntimeError(
                f"engine.no_sync() is not possible at ZeRO stage {self.zero_optimization_stage()}: "
                "gradients are reduce-scattered during every backward, which is what keeps only "
                "1/N of them. Use gradient_accumulation_steps or coalesce_grad_reduction() "
                "instead, or stage 0/1")
        if self._inside_no_sync:
            raise RuntimeError("engine.no_sync() inside no_sync() or coalesce_grad_reduction(): "
                               "these blocks do not nest (as in DeepSpeed)")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """One gradient reduction for all the backwards inside (DeepSpeed 0.19's): at stages 2-3
        they keep full local gradients and the block's exit reduce-scatters each unit once; at
        stage 1 gradients are reduced at the step anyway. Refused at stage 0, with
        managed_gradient_accumulation=false, nested in no_sync(), and `step()` inside."""
        if not self._managed:
            raise RuntimeError("coalesce_grad_reduction() with managed_gradient_accumulation="
                               "false: the caller's step() already reduces once per step (as "
                               "in DeepSpeed); drop the block")
        stage = self.zero_optimization_stage()
        if stage == 0:
            raise NotImplementedError("coalesce_grad_reduction() needs ZeRO stage 1-3, the "
                                      "stage is 0 (as in DeepSpeed); use no_sync() at stage 0")
        if self._inside_no_sync:
            raise RuntimeError("coalesce_grad_reduction() inside no_sync() or another "
                               "coalesce_grad_reduction(): these blocks do not nest")
        policy = self.optimizer.policy
        self._inside_no_sync = True
        policy.defer_reduction()
        try:
            yield
        finally:
            self._inside_no_sync = False
            with self.comm.phase("backward"):
                policy.flush_reduction()

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
        zeroshard.dist.comm).
        """
        return self.comm.report()

    # -- checkpoints (checkpoint/) -----------------------------------------------------------------
    def _checkpoint_parts(self):
        """What checkpoint/ saves and loads: the module, the world, the stage, the TrainState and
        the (one) ShardedState."""
        from .checkpoint.names import Parts
        from .core.state import ShardedState

        if self._shards is None:
            self._shards = ShardedState(self.optimizer)
        return Parts(module=self.module, comm=self.comm, stage=self.zero_optimization_stage(),
                     train=self.train_state, shards=self._shards)

    def save_checkpoint(self, save_dir: str, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Write a sharded checkpoint (every rank calls it); any world size and stage can load it."""
        from .checkpoint.sharded import save_checkpoint

        with self.comm.phase("save_checkpoint"):
            return save_checkpoint(self._checkpoint_parts(), save_dir, tag, client_state,
                                   save_latest, exclude_frozen=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Load a checkpoint written at any world size and stage: `(path, client_state)`, or
        `(None, None)` when `load_dir` has no `latest` and no tag was given. With
        `load_module_strict` (the default), parameters or buffers on one side only are an error."""
        from .checkpoint.sharded import load_checkpoint

        with self.comm.phase("load_checkpoint"):
            return load_checkpoint(self._checkpoint_parts(), load_dir, tag,
                                   load_optimizer_states, load_lr_scheduler_states,
                                   load_module_only, strict=load_module_strict)

    # -- torch.compile -----------------------------------------------------------------------------
    def compile(self, backend: str | Callable = "inductor", compile_kwargs: dict | None = None,
                schedule=None, compiled_autograd_enabled: bool = False) -> None:
        """Compile the wrapped module in place with `torch.compile` (DeepSpeed's signature)."""
        # The module is compiled in place (`nn.Module.compile`), so parameter and checkpoint
        # names stay plain. Stage-3 gathers and releases run in hooks that torch.compile does not
        # trace (core/policy.py `eager_hook`): the graphs break at unit boundaries only.
        if self.is_compiled:
            return
        compile_kwargs = dict(compile_kwargs or {})
        if "backend" in compile_kwargs:
            warnings.warn("engine.compile: the backend in compile_kwargs is overridden by the "
                          "backend argument; pass it as engine.compile(backend=...)", stacklevel=2)
        if schedule is not None:
            warnings.warn("engine.compile: schedule (DeepSpeed's DeepCompile passes) has no "
                          "effect in zeroshard; ignored (leave it None)", stacklevel=2)
        if compiled_autograd_enabled:
            warnings.warn("engine.compile: compiled_autograd_enabled has no effect in zeroshard; "
                          "ignored (the backward runs the compiled graphs' own backward)",
                          stacklevel=2)
        compile_kwargs["backend"] = backend
        self.module.compile(**compile_kwargs)
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether the wrapped module is compiled: by `engine.compile`, or by `torch.compile` /
        `module.compile()` before `initialize`."""
        module = self.module
        # An OptimizedModule exists only once dynamo is imported: asking torch._dynamo otherwise
        # would import it (~1.3 s) just to answer no.
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        return bool(self.__dict__.get("_compiled")) or \
            getattr(module, "_compiled_call_impl", None) is not None or \
            (eval_frame is not None and isinstance(module, eval_frame.OptimizedModule))

    def gathered_model(self):
        """Context with every parameter whole on every rank (stage 3), e.g. around a generation loop.

        Forward passes inside it gather nothing; it costs the full model's memory on each rank.
        At stages 0-2 it is a no-op.
        """
        from .core.gathered import GatheredParameters

        return GatheredParameters(list(self.module.parameters()))

    def empty_partition_cache(self) -> None:
        """Free stage-3 memory kept for reuse: gathered units no context holds and the spare
        gathered-unit blocks (DeepSpeed's name; a no-op at stages 0-2)."""
        self.optimizer.policy.empty_cache()

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
        from .checkpoint.weights16 import consolidated_16bit

        return consolidated_16bit(self.module, exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the weights in the compute dtype (safetensors for a `.safetensors`
        name, torch.save otherwise); at stage 3 only when stage3_gather_16bit_weights_on_model_save
        is true (False and a warning otherwise, as in DeepSpeed). Every rank calls it."""
        from .checkpoint.weights16 import save_16bit

        return save_16bit(self.module, self.comm, save_dir, save_filename,
                          stage=self.zero_optimization_stage(),
                          gather_at_stage3=self.zero_gather_16bit_weights_on_model_save(),
                          exclude_frozen=exclude_frozen_parameters)

    def destroy(self, keep_parameters: bool = True) -> None:
        """Remove hooks and delete swap files; the engine is unusable afterwards. At stage 3 the
        model is gathered whole first, unless `keep_parameters=False` (then its parameters stay
        empty: use it for models too large to hold whole, after saving what you need)."""
        self.optimizer.close(keep_parameters)
        self._watch.close()

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


def _compute_dtype(config: ZeroConfig) -> torch.dtype | None:
    if config.fp16.enabled:
        return torch.float16
    if config.bf16.enabled:
        return torch.bfloat16
    return None
