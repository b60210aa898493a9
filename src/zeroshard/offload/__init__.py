"""Placements below the device: where fp32 masters and optimizer state live (`optimizer.py`: device,
CPU memory, NVMe), where stage-3 parameter shards live between gathers (`param.py`), and the NVMe
swap files with their asynchronous I/O (`nvme.py`). Offload changes placement, never the layout."""

from .nvme import NvmeError  # noqa: F401
