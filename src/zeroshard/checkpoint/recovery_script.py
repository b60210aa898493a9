"""The `zero_to_fp32.py` zeroshard writes beside its checkpoints (`recovery.py` runs it):
`SCRIPT`, and `write_script` (a leaf module: the save path imports it)."""

from __future__ import annotations

import os
import stat
import warnings

__all__ = ["NAME", "SCRIPT", "write_script"]

SCRIPT = '''#!/usr/bin/env python
"""Written by zeroshard beside its checkpoints (as DeepSpeed writes its zero_to_fp32.py): the whole
model in fp32 from a zeroshard or DeepSpeed ZeRO checkpoint of any stage and world size.

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
                           [--max_shard_size 5GB] [--exclude_frozen_parameters]

Needs zeroshard installed (pip install zeroshard); see zeroshard's docs/guides/checkpoints.md."""
import sys

if __name__ == "__main__":
    from zeroshard.checkpoint.recovery import main

    sys.exit(main())
'''

NAME = "zero_to_fp32.py"


def write_script(save_dir: str) -> None:
    """Write `SCRIPT` as `save_dir/zero_to_fp32.py` (atomically, executable); a warning, never an
    error, if it cannot be written: the checkpoint itself is complete without it."""
    path = os.path.join(save_dir, NAME)
    try:
        with open(path) as fh:
            if fh.read() == SCRIPT:
                return
    except OSError:
        pass
    tmp = os.path.join(save_dir, f".{NAME}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(SCRIPT)
        os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"zeroshard: could not write {path} ({err}); the checkpoint is complete, "
                      "`zeroshard consolidate` reads it", stacklevel=2)
        try:
            os.remove(tmp)
        except OSError:
            pass
