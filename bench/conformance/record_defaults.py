"""Record DeepSpeed's own defaults for every config section zeroshard models, as a data file.

Run with DeepSpeed installed (e.g. a separate venv: ``DS_ACCELERATOR=cpu <venv>/bin/python
bench/conformance/record_defaults.py``). It builds DeepSpeed's config object from a config with
only a batch size and writes what DeepSpeed chose for each key to
``tests/fixtures/deepspeed_defaults.json``, keyed by the section paths of zeroshard's schema.
tests/test_deepspeed_defaults.py compares zeroshard's defaults with that file; the file is facts
about DeepSpeed, so it is regenerated here, never edited by hand.
"""

import json
import os
import sys

import deepspeed
from deepspeed.comm.config import CommsLoggerConfig
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                   DeepSpeedZeroOffloadParamConfig)

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures",
                   "deepspeed_defaults.json")


def _dump(model) -> dict:
    """A pydantic model's values under the names a JSON config uses (DeepSpeed's aliases)."""
    return json.loads(model.model_dump_json(by_alias=True))


def record() -> dict:
    """DeepSpeed's defaults, section path -> key -> value."""
    cfg = DeepSpeedConfig({"train_batch_size": 1})
    zero = _dump(cfg.zero_config)  # offload_optimizer / offload_param: None when absent
    top = {key: getattr(cfg, key) for key in (
        "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "prescale_gradients",
        "gradient_predivide_factor", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "managed_gradient_accumulation", "memory_breakdown",
        "dump_state", "dataloader_drop_last", "disable_allgather")}
    top["communication_data_type"] = None if cfg.communication_data_type is None else \
        str(cfg.communication_data_type).removeprefix("torch.")
    top["gradient_allreduce_op"] = str(cfg.gradient_allreduce_op)
    monitor = cfg.monitor_config
    act = cfg.activation_checkpointing_config
    return {
        "_about": f"DeepSpeed {deepspeed.__version__} defaults, recorded by "
                  "bench/conformance/record_defaults.py (do not edit by hand)",
        "": top,
        "fp16": _dump(cfg.float16_config),
        "bf16": _dump(cfg.bfloat16_config),
        "torch_autocast": {"enabled": cfg.torch_autocast_enabled,
                           "dtype": str(cfg.torch_autocast_dtype).removeprefix("torch.")
                           if cfg.torch_autocast_dtype is not None else None,
                           "lower_precision_safe_modules":
                               cfg.torch_autocast_lower_precision_safe_modules},
        "zero_optimization": zero,
        "zero_optimization.offload_optimizer": _dump(DeepSpeedZeroOffloadOptimizerConfig()),
        "zero_optimization.offload_param": _dump(DeepSpeedZeroOffloadParamConfig()),
        "zero_optimization.leaf_module": zero["leaf_module"],  # DeepSpeed 0.18+
        "aio": dict(cfg.aio_config),
        "tensorboard": _dump(monitor.tensorboard),
        "csv_monitor": _dump(monitor.csv_monitor),
        "wandb": _dump(monitor.wandb),
        "comet": _dump(monitor.comet),
        "flops_profiler": dict(vars(cfg.flops_profiler_config)),
        "comms_logger": _dump(CommsLoggerConfig()),
        "activation_checkpointing": {k: v for k, v in vars(act).items()},
        # DeepSpeed keeps the mode as two flags; named as zeroshard's schema spells it (DeepSpeed
        # reads the value in any case).
        "checkpoint": {"tag_validation": "fail" if cfg.checkpoint_tag_validation_fail else
                       "warn" if cfg.checkpoint_tag_validation_enabled else "ignore"},
    }


if __name__ == "__main__":
    data = record()
    path = sys.argv[1] if len(sys.argv) > 1 else OUT
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True, default=str)
        fh.write("\n")
    print(f"wrote {os.path.normpath(path)}")
