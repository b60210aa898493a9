"""Collectives and process groups, the bottom layer: `comm.py` (`Comm`, the one collective wrapper:
ring-model byte ledger, desync-watchdog hooks, gloo's composed all-gather / reduce-scatter),
`topology.py` (which host each rank is on), `hostpolicy.py` (strict host mode), `process_group.py`
(starting and ending the default group from torchrun's or Slurm's environment)."""

from .comm import Comm, default_device, wait_all
from .hostpolicy import HOST_ATTR, HostMemoryError, call_site, is_host, strict_host
from .process_group import init_distributed
from .topology import HostLayout

__all__ = ["Comm", "HOST_ATTR", "HostLayout", "HostMemoryError", "call_site", "default_device",
           "init_distributed", "is_host", "strict_host", "wait_all"]
