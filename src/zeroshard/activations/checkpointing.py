"""`deepspeed.checkpointing`: activation checkpointing for Megatron-style scripts, on torch's tools.

`checkpoint(function, *args)` is `torch.utils.checkpoint.checkpoint` in its reentrant form (the
form DeepSpeed's is: the function runs without autograd, only its inputs are saved, and it is run
again in the backward), with the `activation_checkpointing` settings applied to those saved inputs
through `torch.autograd.graph.saved_tensors_hooks`:

* `cpu_checkpointing`: each saved floating-point input is copied to host memory when saved and
  back to its device when the backward needs it;
* `partition_activations`: each rank of the model-parallel group (from `configure(mpu_)`) keeps
  1/M of each saved floating-point input (M = that group's size) and the whole is all-gathered
  in the backward. Without model parallelism (no mpu, or M = 1) there is nothing to partition:
  each rank keeps its whole inputs, exactly as DeepSpeed does, and the setting changes nothing.

Settings come from `configure()` (DeepSpeed's signature; the config's section, then its keyword
overrides). Until `configure()` is called, `initialize()`'s config supplies them (zeroshard's
addition: a script that calls `checkpoint` without `configure` still gets its config's section),
and `is_configured()` stays False, as Megatron expects. DeepSpeed's API is module-level state by
design, so this module keeps one `_State` object.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from ..config.monitoring import ActivationCheckpointingConfig


class _State:
    """The settings `configure()` made (or initialize()'s defaults) and the model-parallel group."""

    def __init__(self):
        self.configured = False
        self.settings = ActivationCheckpointingConfig()
        self.engine_settings: ActivationCheckpointingConfig | None = None
        self.mp_group = None
        self.mp_rank = 0
        self.mp_size = 1
        self.held: "weakref.WeakSet[_Held]" = weakref.WeakSet()

    def active(self) -> ActivationCheckpointingConfig:
        """What `checkpoint` applies now."""
        if not self.configured and self.engine_settings is not None:
            return self.engine_settings
        return self.settings


_STATE = _State()


# -- configuration ----------------------------------------------------------------------------------
def _section_of(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    """The `activation_checkpointing` section of a config (dict, JSON path or base64), validated."""
    from ..config.schema import load_config, read_raw

    raw = read_raw(deepspeed_config)
    section = raw.get("activation_checkpointing", {})
    # Validate the section alone, with the config loader's messages (key paths, suggestions).
    return load_config({"train_batch_size": 1, "activation_checkpointing": section}) \
        .activation_checkpointing


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Set activation checkpointing up (DeepSpeed's signature): the config's section, then the
    keyword overrides; `mpu_` gives the model-parallel group that `partition_activations` splits
    over (None: no model parallelism)."""
    settings = _section_of(deepspeed_config) if deepspeed_config is not None else \
        ActivationCheckpointingConfig()
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing,
                 "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    settings = settings.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    if settings.contiguous_memory_optimization and not settings.partition_activations:
        raise ValueError("activation_checkpointing.contiguous_memory_optimization "
                         "(contiguous_checkpointing=) needs partition_activations=true, as in "
                         "DeepSpeed; enable partition_activations or drop it")
    if settings.contiguous_memory_optimization and settings.number_checkpoints is None:
        raise ValueError("activation_checkpointing.contiguous_memory_optimization needs "
                         "number_checkpoints (num_checkpoints=): the number of checkpointed layers")
    if mpu_ is not None:
        _STATE.mp_group, _STATE.mp_rank, _STATE.mp_size = _model_parallel(mpu_)
    _STATE.settings = settings
    _STATE.configured = True


def _model_parallel(mpu) -> tuple[Any, int, int]:
    """(group, rank, size) of the tensor/model-parallel group of a Megatron-style mpu."""
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return (mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank(),
                mpu.get_tensor_model_parallel_world_size())
    return mpu.get_model_parallel_group(), mpu.get_model_parallel_rank(), \
        mpu.get_model_parallel_world_size()


def use_engine_config(section: ActivationCheckpointingConfig, written: bool) -> None:
    """initialize()'s config section, used by `checkpoint` until `configure()` is called."""
    _STATE.engine_settings = section if written else None


def is_configured() -> bool:
    """True once `configure()` has been called (DeepSpeed's meaning)."""
    return _STATE.configured


def reset() -> None:
    """Drop what checkpointed forwards without a backward (evaluation) left held."""
    for held in list(_STATE.held):
        held.data = None
    _STATE.held = weakref.WeakSet()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn `partition_activations` on or off."""
    _STATE.settings = _STATE.settings.model_copy(
        update={"partition_activations": bool(partition_activation)})


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's `number_checkpoints` (only sizes its contiguous buffers)."""
    _STATE.settings = _STATE.settings.model_copy(update={"number_checkpoints": nlayers})


def held_bytes() -> dict[str, int]:
    """zeroshard only: bytes of checkpointed inputs held for backward now, by device type."""
    out: dict[str, int] = {}
    for held in list(_STATE.held):
        if held.data is not None:
            out[held.data.device.type] = out.get(held.data.device.type, 0) + \
                held.data.numel() * held.data.element_size()
    return out


# -- saved inputs -----------------------------------------------------------------------------------
class _Held:
    """A saved input as kept: (part of) its data, possibly in host memory, and how to rebuild it."""

    def __init__(self, data: torch.Tensor, shape: torch.Size, device: torch.device,
                 partitioned: bool):
        self.data = data
        self.shape = shape
        self.device = device
        self.partitioned = partitioned


def _hooks(settings: ActivationCheckpointingConfig):
    """Pack/unpack functions for the saved inputs, or None when inputs are kept as they are."""
    partition = settings.partition_activations and _STATE.mp_size > 1
    to_host = settings.cpu_checkpointing
    if not partition and not to_host:
        return None
    group, rank, size = _STATE.mp_group, _STATE.mp_rank, _STATE.mp_size

    def pack(tensor: torch.Tensor):
        if not tensor.is_floating_point():
            return tensor
        data = tensor.detach()
        split = partition and data.numel() >= size and data.numel() % size == 0
        if split:
            part = data.numel() // size
            data = data.reshape(-1).narrow(0, rank * part, part).clone()
        if to_host and data.device.type != "cpu":
            data = data.to("cpu")
        held = _Held(data, tensor.shape, tensor.device, split)
        _STATE.held.add(held)
        return held

    def unpack(held):
        if torch.is_tensor(held):
            return held
        if held.data is None:
            raise RuntimeError("a checkpointed activation was released by "
                               "deepspeed.checkpointing.reset() before its backward; call reset() "
                               "only after evaluation forwards, not between forward and backward")
        data = held.data.to(held.device, non_blocking=True)
        if held.partitioned:
            parts = [torch.empty_like(data) for _ in range(size)]
            dist.all_gather(parts, data, group=group)
            data = torch.cat(parts)
        return data.view(held.shape)

    return pack, unpack


# -- checkpoint --------------------------------------------------------------------------------------
def checkpoint(function: Callable, *args, **kwargs):
    """Run `function(*args, **kwargs)` keeping only its inputs for backward, where it is run again
    (DeepSpeed's `deepspeed.checkpointing.checkpoint`)."""
    settings = _STATE.active()
    if kwargs:  # the reentrant form takes positional inputs only
        keys, count, inner = tuple(kwargs), len(args), function

        def function(*all_args):  # noqa: F811 - the same function, keywords folded in
            return inner(*all_args[:count], **dict(zip(keys, all_args[count:])))

        args = args + tuple(kwargs.values())
    run = _tracked(function)
    hooks = _hooks(settings)
    context = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext()
    device = next((a.device for a in args if torch.is_tensor(a)), torch.device("cpu"))
    if settings.synchronize_checkpoint_boundary:
        _sync(device)
    start = time.perf_counter()
    with context:
        out = torch_checkpoint.checkpoint(run, *args, use_reentrant=True)
    if settings.synchronize_checkpoint_boundary:
        _sync(device)
    if settings.profile and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"[zeroshard] checkpointed forward: {(time.perf_counter() - start) * 1e3:.2f} ms",
              flush=True)
    return out


def non_reentrant_checkpoint(function: Callable, *args):
    """`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` (DeepSpeed's name): inputs
    need not require grad; `cpu_checkpointing` and `partition_activations` do not apply here."""
    return torch_checkpoint.checkpoint(_tracked(function), *args, use_reentrant=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tracked(function: Callable) -> Callable:
    """`function`, run again with the model-parallel RNG tracker's states of its first run."""
    tracker = get_cuda_rng_tracker()
    if not tracker.states:
        return function
    first = tracker.get_states()
    calls = []

    def run(*args):
        if not calls:
            calls.append(True)
            return function(*args)
        current = tracker.get_states()
        tracker.set_states(first)
        try:
            return function(*args)
        finally:
            tracker.set_states(current)

    return run


# -- model-parallel RNG --------------------------------------------------------------------------------
class CudaRNGStatesTracker:
    """Named RNG states (Megatron's tensor-parallel dropout); `fork(name)` runs a block on one."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every state."""
        self.states, self.seeds = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the states by name."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the states (as `get_states` returned them)."""
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new state `name` seeded with `seed` (each name and seed once)."""
        if seed in self.seeds:
            raise ValueError(f"RNG seed {seed} already used by another tracked state")
        if name in self.states:
            raise ValueError(f"RNG state '{name}' already exists")
        self.seeds.add(seed)
        generator = torch.Generator(device=_rng_device())
        generator.manual_seed(seed)
        self.states[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        """Run the block with the device RNG on state `name`, which advances; then restore."""
        if name not in self.states:
            raise ValueError(f"RNG state '{name}' was not added (call add(name, seed) first)")
        device = _rng_device()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                   device_type=device.type):
            _set_rng_state(device, self.states[name])
            try:
                yield
            finally:
                self.states[name] = _get_rng_state(device)


def _rng_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _get_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's model-parallel RNG tracker."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: the default RNG gets `seed`, the tracker's model-parallel state
    `seed + 2718 + model-parallel rank`."""
    _TRACKER.reset()
    device = _rng_device()
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.add("model-parallel-rng", seed + 2718 + _STATE.mp_rank)
