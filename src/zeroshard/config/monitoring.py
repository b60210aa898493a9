"""The DeepSpeed config sections for watching a run and for activation checkpointing.

`tensorboard`, `csv_monitor`, `wandb`, `comet` (the monitors, written by rank 0 only),
`flops_profiler`, `comms_logger` and `activation_checkpointing`, with DeepSpeed's keys and
defaults. What they do is in `zeroshard.monitor` and `zeroshard.activations`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from .fields import AnyInt, Bool, NonNegFloat, NonNegInt, PosInt, Str

#: DeepSpeed's default job name: the folder under output_path that tensorboard/csv write into.
DEFAULT_JOB_NAME = "DeepSpeedJobName"


def _check_str_list(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of strings")
    return v


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TensorBoardConfig(_Section):
    """TensorBoard event files under output_path/job_name (needs the `tensorboard` package)."""
    enabled: Bool = False
    output_path: Str = ""
    """Folder for the logs; "" means the current working directory (as in DeepSpeed)."""
    job_name: Str = DEFAULT_JOB_NAME
    """Sub-folder of output_path for this run."""


class CSVMonitorConfig(_Section):
    """One CSV file per event under output_path/job_name (Python's csv module)."""
    enabled: Bool = False
    output_path: Str = ""
    """Folder for the files; "" means the current working directory (as in DeepSpeed)."""
    job_name: Str = DEFAULT_JOB_NAME
    """Sub-folder of output_path for this run."""


class WandbConfig(_Section):
    """Weights & Biases logging (needs the `wandb` package)."""
    enabled: Bool = False
    group: Str | None = None
    """wandb.init's group."""
    team: Str | None = None
    """wandb.init's entity."""
    project: Str = "deepspeed"
    """wandb.init's project."""


class CometConfig(_Section):
    """Comet logging (needs the `comet_ml` package); each event at most every samples_log_interval."""
    enabled: Bool = False
    samples_log_interval: PosInt = 100
    """Samples between two logged values of the same event."""
    project: Str | None = None
    workspace: Str | None = None
    api_key: Str | None = None
    experiment_name: Str | None = None
    experiment_key: Str | None = None
    online: Bool | None = None
    mode: Str | None = None
    """comet_ml.start's mode: "get", "create" or "get_or_create"."""


class FlopsProfilerConfig(_Section):
    """A per-module FLOP count (torch's FlopCounterMode) of the step `profile_step`."""
    enabled: Bool = False
    recompute_fwd_factor: NonNegFloat = 0.0
    """Accepted for DeepSpeed; the FLOP counter measures recomputed forwards itself."""
    profile_step: NonNegInt = 1
    """The global step (engine.global_steps when it starts) whose forward and backward are counted."""
    module_depth: AnyInt = -1
    """Deepest module level shown; -1 shows every level."""
    top_modules: PosInt = 1
    """Accepted for DeepSpeed (its aggregated view); every module at the shown depths is listed."""
    detailed: Bool = True
    """Whether to list the modules (false prints the totals only)."""
    output_file: Str | None = None
    """Write the profile to this file instead of printing it."""


class CommsLoggerConfig(_Section):
    """Per-step communication summary from zeroshard's comm ledger, printed at steps_per_print."""
    enabled: Bool = False
    verbose: Bool = False
    prof_all: Bool = True
    prof_ops: Annotated[list[str], BeforeValidator(_check_str_list)] = []
    debug: Bool = False


class ActivationCheckpointingConfig(_Section):
    """deepspeed.checkpointing's settings (read by its configure(), and by initialize())."""
    partition_activations: Bool = False
    """Keep 1/M of each checkpointed input per rank of the model-parallel group (M ranks)."""
    contiguous_memory_optimization: Bool = False
    """Accepted; torch's allocator places the (partitioned) inputs."""
    cpu_checkpointing: Bool = False
    """Keep the checkpointed inputs in host memory until the backward needs them."""
    number_checkpoints: PosInt | None = None
    synchronize_checkpoint_boundary: Bool = False
    """Synchronize the device before and after each checkpointed forward."""
    profile: Bool = False
    """Print each checkpointed forward's time."""


#: Top-level key -> model, for the schema.
SECTIONS: dict[str, type[BaseModel]] = {
    "tensorboard": TensorBoardConfig, "csv_monitor": CSVMonitorConfig, "wandb": WandbConfig,
    "comet": CometConfig, "flops_profiler": FlopsProfilerConfig,
    "comms_logger": CommsLoggerConfig, "activation_checkpointing": ActivationCheckpointingConfig,
}
