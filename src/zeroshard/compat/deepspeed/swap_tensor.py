"""DeepSpeed's `deepspeed.runtime.swap_tensor` constants that scripts and DeepSpeed's own tests
read: `MIN_SWAPPABLE_BYTES`, the size (1 MiB in DeepSpeed 0.19.8) below which DeepSpeed keeps an
optimizer-state tensor in memory rather than in an NVMe swap file. zeroshard swaps whole units
(offload/nvme_optimizer.py) and has no such threshold; the value is DeepSpeed's, for sizing."""

#: DeepSpeed's threshold in bytes (its `MIN_AIO_BYTES`).
MIN_SWAPPABLE_BYTES = 1024 ** 2

__all__ = ["MIN_SWAPPABLE_BYTES"]
