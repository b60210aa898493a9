"""Extras that the layers above core add to what core builds, without core importing them.

Core holds ZeRO's mechanics. What imitates another library on top of them (DeepSpeed's `ds_*`
parameter attributes and `parameter_offload`, the save guards, Hugging Face's `generate` at stage
3: compat/) is installed at the moments core announces here:

* `install(view)`: a stage-3 policy attached its hooks; `view` is its read-only
  `policy_view.Stage3View`. Returns a callable that undoes the install (the policy calls it at
  `close`), or None.
* `unit_status(unit, status)`: a stage-3 or construction-time unit was gathered
  (`ZeroParamStatus.AVAILABLE`), released (`NOT_AVAILABLE`) or its gather issued (`INFLIGHT`).
* `construction_slice(param, shard)`: `zeroshard.Init` partitioned `param` and `shard` is this
  rank's slice of it; `shard` None: the parameter left its construction unit.
* `optimizer_attribute(optimizer, name)`: an attribute the `ZeroOptimizer` itself does not have
  (raise AttributeError when the extension has none by that name either).

An extension is any object (a module, typically) with some of these functions. `register(find)`
takes a callable without arguments that returns it, or None while it is not available yet; it is
called when first needed, so registering imports nothing (zeroshard/__init__.py registers compat/'s,
as it registers the Hugging Face init walk with core.init).
"""

from __future__ import annotations

import contextlib
from typing import Callable

_KINDS = ("install", "unit_status", "construction_slice", "optimizer_attribute")

_finders: list[Callable[[], object]] = []
_found: list[object] = []
#: Each kind's functions, in the order the extensions were found.
_hooks: dict[str, list[Callable]] = {kind: [] for kind in _KINDS}


def register(find: Callable[[], object]) -> None:
    """Add an extension, found by `find()` when first needed (None: ask again next time)."""
    if find not in _finders:
        _finders.append(find)


def _functions(kind: str) -> list[Callable]:
    """The found extensions' functions of `kind`, asking the finders that have not answered yet."""
    if _finders:
        for find in list(_finders):
            extension = find()
            if extension is None:
                continue
            _finders.remove(find)
            if extension in _found:
                continue
            _found.append(extension)
            for name in _KINDS:
                function = getattr(extension, name, None)
                if function is not None:
                    _hooks[name].append(function)
    return _hooks[kind]


def install(view) -> "Installed":
    """Run every extension's `install(view)`; the result undoes them all (`remove()`). One that
    fails undoes those before it, then raises."""
    done = Installed([])
    try:
        for step in _functions("install"):
            undo = step(view)
            if undo is not None:
                done.undo.append(undo)
    except BaseException:
        with contextlib.suppress(Exception):  # the install's own error is the one to report
            done.remove()
        raise
    return done


class Installed:
    """What a stage-3 policy's installs left: `remove()` undoes them, latest first, once."""

    def __init__(self, undo: list[Callable[[], None]]):
        self.undo = undo

    def remove(self) -> None:
        """Undo every install (an error in one does not stop the others; the first is raised)."""
        first = None
        while self.undo:
            try:
                self.undo.pop()()
            except Exception as err:  # noqa: BLE001 - re-raised below, after the rest ran
                first = first or err
        if first is not None:
            raise first


def unit_status(unit, status) -> None:
    """Tell the extensions that `unit`'s parameters are now `status`."""
    for note in _functions("unit_status"):
        note(unit, status)


def construction_slice(param, shard) -> None:
    """Tell the extensions that `param` is partitioned at construction with this rank's slice
    `shard` (None: it left its construction unit)."""
    for note in _functions("construction_slice"):
        note(param, shard)


def optimizer_attribute(optimizer, name: str):
    """`name` of `optimizer` as the first extension that has it answers; AttributeError if none."""
    for answer in _functions("optimizer_attribute"):
        try:
            return answer(optimizer, name)
        except AttributeError:
            continue
    raise AttributeError(f"{type(optimizer).__name__!r} object has no attribute {name!r}")
