"""Sharded checkpoints: save and load at any world size, stage and placement (`sharded.py`; the
save itself, all or nothing on every rank: `save.py`; the directory's lock, temporary names and
failure messages: `directory.py`), the checks that make a load all or nothing (`verify.py`), a checkpoint consolidated into safetensors
(`consolidate.py`) and the safetensors writer it shares with `save_16bit_model`
(`safetensors_file.py`). DeepSpeed's checkpoints are read (`deepspeed_read.py`, installed by
`portable_load.py` when `load_checkpoint` finds DeepSpeed's files and not zeroshard's), written
(`deepspeed_write.py`) and converted (`convert.py`); `recovery.py` is the `zero_to_fp32.py` every
save writes (`recovery_script.py`). Save and load take what the engine hands them
(`names.Parts`), never the engine: what each rank saves of the model and optimizer, and how a load
installs it, is its `ShardedState` (`core/state.py`; this package never touches its units, stage
policy or placement), and the run's counters, loss scaler, LR scheduler, sampler and RNG are its
`TrainState` (`train_state.py`)."""

from .sharded import load_checkpoint, save_checkpoint  # noqa: F401
from .verify import CheckpointError, CheckpointTagError  # noqa: F401

__all__ = ["CheckpointError", "CheckpointTagError", "load_checkpoint", "save_checkpoint"]
