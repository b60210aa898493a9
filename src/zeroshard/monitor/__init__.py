"""Watching a run: monitor writers (TensorBoard, CSV, W&B, Comet), the training log line with
throughput and MFU, wall-clock breakdown timers and the flops profile.

`writers.py` (where events go, `MonitorMaster` = `engine.monitor`), `throughput.py` (tokens,
peak FLOPs, MFU), `timers.py` (forward / backward / step times), `flops.py` (torch's FLOP counter
per module), `training.py` (`TrainingWatch`, the engine's hook object that ties them together).
"""

from .throughput import PEAK_TFLOPS, mfu, model_flops_per_token, peak_flops
from .training import TrainingWatch
from .writers import (CometWriter, CsvWriter, MissingPackageError, MonitorMaster, TensorBoardWriter,
                      WandbWriter)

__all__ = ["MonitorMaster", "TrainingWatch", "TensorBoardWriter", "CsvWriter", "WandbWriter",
           "CometWriter", "MissingPackageError", "PEAK_TFLOPS", "peak_flops", "mfu",
           "model_flops_per_token"]
