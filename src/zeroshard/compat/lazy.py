"""Names of a compat package imported on first use (PEP 562), so that importing the package does
not import transformers or accelerate."""

from __future__ import annotations

import importlib


def lazy_names(package: str, table: dict[str, str], namespace: dict):
    """A module `__getattr__` for `package` that imports `table[name]` (a submodule relative to
    `package`) when `name` is first asked for, and keeps it in `namespace`."""

    def __getattr__(name):
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
