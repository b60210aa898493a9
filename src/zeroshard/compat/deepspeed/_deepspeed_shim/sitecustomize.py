"""Run at interpreter start in `zeroshard run`'s workers (this directory is first on their
PYTHONPATH): zeroshard's worker hooks (compat/accelerate/worker_hooks.py), then the
sitecustomize this file shadows, if the environment has one. Imports neither torch nor
zeroshard's package body."""

import importlib.util as _util
import os as _os
import sys as _sys


def _chain() -> None:
    """Run the next `sitecustomize` on sys.path, the one Python would have run without us."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    for entry in _sys.path:
        if not entry or _os.path.abspath(entry) == here:
            continue
        path = _os.path.join(entry, "sitecustomize.py")
        if _os.path.isfile(path):
            spec = _util.spec_from_file_location("_zeroshard_shadowed_sitecustomize", path)
            module = _util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


def _hooks() -> None:
    compat = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    path = _os.path.join(compat, "accelerate", "worker_hooks.py")
    spec = _util.spec_from_file_location("zeroshard_worker_hooks", path)
    module = _util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.install()


if _os.environ.get("ZEROSHARD_WORKER_HOOKS") == "1":
    _hooks()
_chain()
