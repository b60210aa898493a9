"""Per-rank CPU binding for `zeroshard run --bind_cores_to_rank` (DeepSpeed's launcher flag).

torchrun starts each worker as `python bind.py <cores> <local rank> -- <the worker's command>`
(torchrun fills in the local rank); this file binds the process to that rank's cores, sets
OMP_NUM_THREADS to their number, as DeepSpeed's launcher does through numactl, and replaces
itself with the real command (`os.execvp`: same process, so torchrun's agent watches the worker
itself). It is run by path and imports nothing but the standard library, so it costs no torch
import. `<cores>` is one list per local rank, separated by ';': "0-3;4-7".
"""

from __future__ import annotations

import os
import sys


def parse_cores(text: str) -> list[int]:
    """"0,2-4,6" -> [0, 2, 3, 4, 6] (DeepSpeed's --bind_core_list syntax)."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"bad core range {part!r}: the end is below the start")
        cores.extend(range(lo, hi + 1))
    return cores


def main(argv: list[str]) -> None:
    """Bind this process to its rank's cores, then exec the worker command."""
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: bind.py '<cores of rank 0>;<cores of rank 1>;...' <local rank> -- command")
    per_rank, local_rank, command = argv[0].split(";"), int(argv[1]), argv[3:]
    cores = parse_cores(per_rank[local_rank])
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
