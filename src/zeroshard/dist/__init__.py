"""Collectives and process groups, the bottom layer: `world.py` (`World`: the world's Comm, its
subgroups, one ledger, the step counter, the watchdog's deadline), `comm.py` (`Comm`, the one
collective wrapper: ring-model byte ledger, desync-watchdog hooks, gloo's composed all-gather /
reduce-scatter), `ledger.py`, `groups.py` (subgroups), `watchdog.py` (the desync watchdog),
`steps.py` (the step counter), `topology.py` (which host each rank is on), `hostpolicy.py`
(strict host mode), `process_group.py` (starting and ending the default group from torchrun's or
Slurm's environment), and what the step's device code shares: `streams.py` (the side streams'
one owner), `hostmem.py` (host memory), `hostsync.py` (counted host syncs). Nothing here imports
from above (core/ and up)."""

from .comm import Comm, default_device, wait_all
from .hostpolicy import HOST_ATTR, HostMemoryError, call_site, is_host, strict_host
from .process_group import init_distributed
from .topology import HostLayout

__all__ = ["Comm", "HOST_ATTR", "HostLayout", "HostMemoryError", "call_site", "default_device",
           "init_distributed", "is_host", "strict_host", "wait_all"]
