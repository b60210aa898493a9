"""Stage 3: parameters a module uses outside the module that gathers them, found as they are used.

A unit is gathered around the forward of the modules that need it (`partition.py`). Two patterns
use a parameter elsewhere, and DeepSpeed handles both without `register_external_parameter`:

* *read*: a module's forward reads another module's parameter by attribute
  (`F.linear(x, self.linear1.weight)` in the parent); a leaf module's children read their own.
* *returned*: a forward returns one of its parameters (a bias handed to the caller, which adds
  it later).

Each module holding sharded parameters gets a `_parameters` dict (`WatchedParameters`) that tells
`ParameterReads` when one is read while a forward runs. The stack of hooked modules running
forward says who reads it: the innermost one. If no module on the stack needs the parameter's
unit, the unit is gathered now and recorded as an external parameter of that module
(`register_external_parameter`'s attribute): from then on its pre-forward gathers the unit with
its own and keeps it gathered until it returns, its backward gathers it again (autograd's saved
views see the data once the storage is refilled), and it is released after that module's backward
as any borrowed unit is. A parameter in a module's output is recorded the same way on the module
that called it (the one now innermost), and dropped from the returning module's externals: the
caller covers it from then on. Recording happens at the same point of the same forward on every
rank, so the extra gathers line up across ranks as every other gather does.
"""

from __future__ import annotations

import torch
from torch import nn

from .partition import EXTERNAL_ATTR, register_external_parameter


class WatchedParameters(dict):
    """A module's `_parameters` that reports reads during a stage-3 forward to its watcher."""

    __slots__ = ("watcher",)

    def __getitem__(self, name):
        param = dict.__getitem__(self, name)
        # Traced by torch.compile, a read is a plain dict read: compiled code runs between the
        # (eager) hooks on whole units, and tracing the watcher would put engine state in the
        # graph's guards.
        if torch.compiler.is_compiling():
            return param
        watcher = self.watcher
        if watcher.stack:  # no forward running: a plain dict read
            watcher.read(param)
        return param

    def __reduce_ex__(self, protocol):
        # copy.deepcopy(model) and pickling see a plain dict, never the engine behind the watcher.
        return dict, (dict(self),)


class ParameterReads:
    """The forward stack of a stage-3 model and the external parameters found on it."""

    def __init__(self, stage, model: nn.Module, in_backward):
        """`stage`: stage 3's parameter gatherer (`param_gatherer.py`: its layout, `active`
        counts, `unshard`, `schedule`); `in_backward()`: whether the policy's backward runs."""
        self.stage = stage
        self.in_backward = in_backward
        self.unit_of = {id(p): index for index in stage.sharded
                        for p in stage.by_index[index].params()}
        #: Hooked modules whose forward is running, innermost last.
        self.stack: list[nn.Module] = []
        self.watched: list[nn.Module] = []
        self.adopt(model)

    def adopt(self, model: nn.Module) -> None:
        """Watch every module of `model` holding sharded parameters, and give each module
        `_external_params` (what callers read to see what a module uses from outside it).
        Run again at each step's start: a module attached after `initialize()` that holds one
        (a new head tied to the embedding) is watched from its first forward on."""
        for module in model.modules():
            own = module.__dict__.get("_parameters")
            if type(own) is dict and any(p is not None and id(p) in self.unit_of
                                         for p in own.values()):
                watched = WatchedParameters(own)
                watched.watcher = self
                module._parameters = watched
                self.watched.append(module)
            if EXTERNAL_ATTR not in module.__dict__:
                module.__dict__[EXTERNAL_ATTR] = {}

    def close(self) -> None:
        """Give every watched module a plain `_parameters` dict again."""
        for module in self.watched:
            if isinstance(module._parameters, WatchedParameters):
                module._parameters = dict(module._parameters)
        self.watched.clear()
        self.stack.clear()

    # -- the forward stack -------------------------------------------------------------------------
    def push(self, module: nn.Module, is_root: bool) -> None:
        """`module`'s forward starts (the root's, outside backward, starts a new stack)."""
        if is_root and not self.in_backward():
            self.stack.clear()  # a forward that raised left its modules behind
        self.stack.append(module)

    def pop(self, module: nn.Module) -> None:
        """`module`'s forward returned."""
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        elif module in self.stack:  # an inner forward raised and was caught: drop it too
            del self.stack[len(self.stack) - 1 - self.stack[::-1].index(module):]

    def _covered(self, index: int) -> bool:
        needs = self.stage.layout.needs
        return any(index in needs.get(id(m), ()) for m in self.stack)

    # -- found uses ------------------------------------------------------------------------------
    def read(self, param) -> None:
        """A parameter was read by attribute while a forward runs."""
        index = self.unit_of.get(id(param))
        if index is None or self.stage.holding_all or self._covered(index):
            return
        self._record(self.stack[-1], index, param)

    def returned(self, module: nn.Module, leaves) -> None:
        """`module`'s forward (already popped) returned `leaves`: its sharded parameters among
        them are now used by the caller."""
        for leaf in leaves:
            index = self.unit_of.get(id(leaf)) if isinstance(leaf, nn.Parameter) else None
            if index is None or not self.stack or self._covered(index):
                continue
            self._record(self.stack[-1], index, leaf)
            self._forget(module, index, leaf)

    def _record(self, module: nn.Module, index: int, param) -> None:
        """`module` uses unit `index` from now on: gathered now and at each of its forwards."""
        stage, layout = self.stage, self.stage.layout
        register_external_parameter(module, param)
        layout.needs[id(module)] = [*layout.needs.get(id(module), ()), index]
        layout.borrowed[id(module)] = [*layout.borrowed.get(id(module), ()), index]
        # Running now: held until this module's post-forward (which counts it down).
        stage.active[index] = stage.active.get(index, 0) + 1
        if not self.in_backward():
            stage.schedule.demand([index])
        stage.unshard([index])

    def _forget(self, module: nn.Module, index: int, param) -> None:
        """Drop `param` from `module`'s externals (its caller now covers it); its own units stay."""
        layout = self.stage.layout
        external = module.__dict__.get(EXTERNAL_ATTR, {})
        if external.pop(id(param), None) is None:
            return
        if not any(self.unit_of.get(key) == index for key in external):
            # New lists: the post-forward running now still counts down the ones it read.
            layout.needs[id(module)] = [i for i in layout.needs.get(id(module), ()) if i != index]
            layout.borrowed[id(module)] = [i for i in layout.borrowed.get(id(module), ())
                                           if i != index]
