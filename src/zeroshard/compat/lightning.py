"""Lightning integration: `Trainer(strategy=ZeroShardStrategy(config=ds_config))` trains with ZeRO.

The strategy is Lightning's DDP strategy (launchers, process group, collectives, distributed
sampler) with the model wrapped by a zeroshard engine instead of DistributedDataParallel:

- `configure_model()` runs under `zeroshard.Init` at stage 3 (`model_sharded_context`): modules
  built there are partitioned as they are built.
- `setup` builds the engine from the LightningModule and the one optimizer (and LR schedulers)
  `configure_optimizers` returns, or the config's `optimizer` / `scheduler` blocks. Lightning
  keeps stepping the schedulers; they act on the re-seated param groups.
- backward, the optimizer step, gradient clipping (the config's `gradient_clipping`, global norm
  over all shards) and mixed precision (the config's `bf16` / `fp16`) are the engine's: a precision
  plugin routes Lightning's calls to `engine.backward` / `engine.step` and casts batches.
- Accumulation boundaries are Lightning's (`Trainer(accumulate_grad_batches=k)`, which also
  divides the loss by k); a config `gradient_accumulation_steps` (or `train_batch_size`) is taken
  as that k. The engine itself runs with accumulation 1 and keeps the partial sums in its shards.
- Checkpoints are directories written by `engine.save_checkpoint(path, tag=...)`, with Lightning's
  own checkpoint dict (epoch, global_step, loops, callbacks, LR schedulers, hyper-parameters) as
  `client_state`; `Trainer.fit(ckpt_path=path)` restores both.
- The engine outlives each `fit` / `validate` / `test` call, so the trained (at stage 3 still
  sharded) model can be saved, evaluated or trained further; `strategy.engine.destroy()` gives the
  module back whole.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from lightning_utilities.core.apply_func import apply_to_collection

import zeroshard
from zeroshard.dist import default_device
from zeroshard.config import read_raw

__all__ = ["ZeroShardStrategy"]


class ZeroShardStrategy(DDPStrategy):
    """Lightning strategy that trains through a zeroshard engine at any ZeRO stage (0-3)."""

    strategy_name = "zeroshard"

    def __init__(self, config: Any = None, *, tag: str = "checkpoint", accelerator=None,
                 parallel_devices: Optional[list[torch.device]] = None, cluster_environment=None,
                 checkpoint_io=None, process_group_backend: Optional[str] = None,
                 timeout=default_pg_timeout, start_method: str = "popen") -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)
        #: The DeepSpeed-format config (dict, JSON path or base64 JSON), read once.
        self.config = copy.deepcopy(read_raw(config))
        #: Checkpoint tag: a checkpoint PATH holds PATH/<tag>/ and PATH/latest.
        self.tag = tag
        #: The zeroshard engine, from the first `setup` on (None before).
        self.engine: Optional[zeroshard.Engine] = None
        self._trains = False  # whether the engine holds the real optimizer (not an inference stub)

    # -- set-up --------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        """Build (or reuse) the engine around the LightningModule; Lightning's optimizer goes in."""
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        if not isinstance(self.precision_plugin, _EnginePrecision):
            if type(self.precision_plugin) is not Precision:
                raise ValueError(
                    "ZeroShardStrategy: leave Trainer(precision=...) at '32-true'; mixed precision "
                    "comes from the zeroshard config ({\"bf16\": {\"enabled\": true}} or "
                    "{\"fp16\": {\"enabled\": true}}), got "
                    f"{type(self.precision_plugin).__name__}")
            self.precision_plugin = _EnginePrecision(self)
        if self._layer_sync is not None:
            raise ValueError("ZeroShardStrategy does not support Trainer(sync_batchnorm=True)")
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks but the Trainer "
                             f"asks for {self.world_size} (devices x num_nodes)")
        if self.root_device != default_device():
            raise ValueError(f"zeroshard puts this rank's engine on {default_device()} "
                             f"(LOCAL_RANK) but Lightning chose {self.root_device}; give "
                             "Trainer(devices=N) rather than a list of device ids")
        fitting = trainer.state.fn == TrainerFn.FITTING
        module = self.lightning_module
        stale = self.engine is not None and (self.engine.module is not module
                                             or fitting and not self._trains)
        if stale:  # another module, or an inference engine that now has to train
            self.engine.destroy()
            self.engine = None
        if self.engine is None:
            self._build_engine(trainer, fitting)
        elif fitting:
            self.optimizers = [self.engine.optimizer]  # trained before: same optimizer state
        if self.engine.zero_optimization_stage() == 3:
            # Gathered stage-3 buffers must not become inference tensors that training then reuses.
            for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop,
                         trainer.test_loop, trainer.predict_loop):
                loop.inference_mode = False
        self.model = self.engine

    def _build_engine(self, trainer, fitting: bool) -> None:
        """zeroshard.initialize() with Lightning's optimizer (fitting) or a stateless stand-in."""
        module = self.lightning_module
        config = copy.deepcopy(self.config)
        accumulation = _pop_accumulation(config, self.world_size)
        schedulers: list[LRSchedulerConfig] = []
        if fitting:
            if accumulation > 1:
                if not module.automatic_optimization:
                    raise ValueError("gradient_accumulation_steps in the config needs automatic "
                                     "optimization; with manual optimization accumulate yourself")
                if trainer.accumulate_grad_batches not in (1, accumulation):
                    raise ValueError(
                        f"the config asks for {accumulation} accumulation steps and Trainer("
                        f"accumulate_grad_batches={trainer.accumulate_grad_batches}); give one")
                trainer.accumulate_grad_batches = accumulation
            clip = trainer.gradient_clip_val
            if clip:
                if trainer.gradient_clip_algorithm not in (None, "norm"):
                    raise ValueError("zeroshard clips by global norm only, not "
                                     f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}")
                if config.get("gradient_clipping", clip) != clip:
                    raise ValueError(f"Trainer(gradient_clip_val={clip}) and the config's "
                                     f"gradient_clipping={config['gradient_clipping']} differ")
                config["gradient_clipping"] = float(clip)
            self.setup_optimizers(trainer)  # Lightning's configure_optimizers
            if len(self.optimizers) != 1:
                raise ValueError(f"ZeroShardStrategy trains one optimizer; configure_optimizers "
                                 f"returned {len(self.optimizers)}")
            optimizer = self.optimizers[0]
            if isinstance(optimizer, _MockOptimizer):  # configure_optimizers gave none
                optimizer = None  # then the config's optimizer block builds it
            schedulers = list(self.lr_scheduler_configs)
        else:
            # Nothing is trained: a stateless optimizer lets the engine shard and load weights
            # (from a checkpoint too, which an engine without an optimizer cannot).
            for key in ("optimizer", "scheduler", "gradient_clipping"):
                config.pop(key, None)
            params = [p for p in module.parameters() if p.requires_grad]
            optimizer = torch.optim.SGD(params, lr=0.0) if params else None
        engine, zero_optimizer, _, config_scheduler = zeroshard.initialize(
            model=module, optimizer=optimizer, config=config)
        if config_scheduler is not None:
            engine.lr_scheduler = None  # Lightning steps it, once per optimizer step
            schedulers.append(LRSchedulerConfig(config_scheduler, interval="step"))
        self.engine, self._trains = engine, fitting
        self.optimizers = [zero_optimizer] if fitting else []
        self.lr_scheduler_configs = schedulers

    @contextlib.contextmanager
    def model_sharded_context(self):
        """Lightning builds `configure_model()`'s modules in here: under zeroshard.Init at stage 3,
        so they are partitioned as they are built (a Hugging Face model loaded with
        `zeroshard.integrations.hf.from_pretrained` streams its weights slice by slice)."""
        stage = self.config.get("zero_optimization", {}).get("stage", 0)
        with zeroshard.Init(config={"zero_optimization": {"stage": stage}}):
            yield

    def teardown(self) -> None:
        """End a stage: the engine, its optimizer and the sharded model stay where they are."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the engine, so after `setup`."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The engine restores its own (sharded) optimizer state."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the weights go into the engine's sharded files, not Lightning's dict."""
        return {}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Empty: the optimizer state goes into the engine's sharded files."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        """Write the directory `filepath` (each rank its shards), Lightning's dict inside."""
        if storage_options is not None:
            raise TypeError("ZeroShardStrategy.save_checkpoint takes no storage_options")
        if self.engine is None:
            raise RuntimeError("no zeroshard engine yet: save during or after Trainer.fit")
        filepath = self.broadcast(os.fspath(filepath))
        client_state = {k: v for k, v in checkpoint.items()
                        if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=self.tag, client_state=client_state)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        """Load the engine's weights (and optimizer state when fitting); return Lightning's dict."""
        assert self.engine is not None and self.lightning_module is not None
        path = self.broadcast(os.fspath(checkpoint_path))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} is not a checkpoint directory written by "
                                    "ZeroShardStrategy (trainer.save_checkpoint / ModelCheckpoint)")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.engine.load_checkpoint(
            path, load_optimizer_states=fitting and self._trains, load_lr_scheduler_states=False)
        if client_state is None:
            raise FileNotFoundError(f"{path} holds no zeroshard checkpoint (no 'latest' file)")
        return client_state

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Nothing to do: `load_checkpoint` already put the weights into the engine."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Nothing to do: `load_checkpoint` already restored the optimizer state."""


class _EnginePrecision(Precision):
    """Routes Lightning's backward, optimizer step, clipping and batch casting to the engine."""

    def __init__(self, strategy: ZeroShardStrategy) -> None:
        super().__init__()
        self.strategy = strategy

    @property
    def _engine(self) -> zeroshard.Engine:
        assert self.strategy.engine is not None
        return self.strategy.engine

    def convert_input(self, data: Any) -> Any:
        """Cast floating tensors of the batch to the compute dtype (bf16 / fp16 configs)."""
        dtype = self._engine.compute_dtype
        if dtype is None:
            return data
        return apply_to_collection(data, torch.Tensor,
                                   lambda t: t.to(dtype) if t.is_floating_point() else t)

    def backward(self, tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        """`engine.backward(loss)`: fp16 loss scaling and this rank's share of the reduction."""
        if is_overridden("backward", model):
            rank_zero_warn("LightningModule.backward is overridden but ignored: the zeroshard "
                           "engine runs backward")
        self._engine.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        """Run the closure (training_step + backward), the pre-step hooks, then `engine.step()`."""
        result = closure()
        self._after_closure(model, optimizer)
        if result is None and model.automatic_optimization:
            return None  # training_step returned None: this batch is skipped, as in Lightning
        self._engine.step()
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        """No-op: the engine clips at its step by the global norm (config `gradient_clipping`)."""
        if clip_val and clip_val != self._engine.optimizer.clip_norm:
            raise ValueError(f"clip_gradients({clip_val}) differs from the engine's "
                             f"gradient_clipping={self._engine.optimizer.clip_norm}; zeroshard "
                             "clips in the engine, by the config or Trainer(gradient_clip_val=)")


def _pop_accumulation(config: dict, world_size: int) -> int:
    """Remove the batch-size keys (the DataLoader sets the batch) and return the accumulation."""
    total = config.pop("train_batch_size", None)
    steps = config.pop("gradient_accumulation_steps", None)
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = 1
    if isinstance(steps, int):
        accumulation = steps
    elif isinstance(total, int) and isinstance(micro, int):
        if total % (micro * world_size):
            raise ValueError(f"train_batch_size={total} is not a multiple of "
                             f"train_micro_batch_size_per_gpu={micro} x {world_size} ranks")
        accumulation = total // (micro * world_size)
    if not isinstance(micro, int):
        config["train_micro_batch_size_per_gpu"] = 1  # no notice: the DataLoader sets the batch
    return accumulation
