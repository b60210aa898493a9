"""Stage 3's module hooks: each unit module's units gathered around its forward and its backward.

The stage-3 policy (`stage3.py`) registers these on every module of its layout that needs units
(`partition.py`: the blocks, and the modules holding parameters outside them) and on the root:
  forward      the pre-hook counts the module's units as in use and gathers them, prefetching the
               next ones in the recorded order (`schedule.py`); the post-hook frees them unless
               they are needed again soon, and registers the backward hooks below on its outputs
               (and, for units it only borrows, on its inputs)
  backward     the first gradient of a call's outputs gathers its units again (and prefetches in
               the recorded backward order); once its backward reaches the inputs, units it only
               borrowed (a tied weight) are freed
  root         the root's forward starts and ends the policy's FORWARD state and the recorded
               step; a root forward no backward follows (evaluation) frees everything it gathered
A forward while the policy's state is BACKWARD is an activation-checkpoint recompute: it gathers
what it needs and changes nothing else. While `hold_all` runs (generate) the hooks do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from .param_gatherer import ParamGatherer
from .partition import Stage3Layout
from .policy import eager_hook
from .stage3_reads import ParameterReads
from .training_state import StepState, hook_outputs


@dataclass
class _ModuleCall:
    """One forward call of a unit module, as its backward hooks see it."""

    needs: list  # unit indices it gathers
    borrowed: list  # of those, units it only borrows (a tied weight), freed after its backward
    regathered: bool = False  # its backward's first output gradient gathered the units again
    released: bool = False  # its backward reached its inputs and let the borrowed units go


class ModuleHooks:
    """The forward and backward hooks of stage 3's unit modules, over its parameter gatherer."""

    def __init__(self, params: ParamGatherer, state: StepState, layout: Stage3Layout,
                 root: torch.nn.Module, keeps_gradients: bool, hooks: list):
        """Register the hooks on `layout.modules` (handles appended to `hooks`); `keeps_gradients`:
        False for an engine without an optimizer (it keeps nothing gathered for backward)."""
        self.params, self.state, self.layout = params, state, layout
        self.keeps_gradients = keeps_gradients
        # Parameters used outside the modules that gather them are found as they are used.
        self.reads = ParameterReads(params, root, lambda: state.in_backward)
        for module in layout.modules:  # needs are looked up at each call: reads add some
            is_root = module is root
            hooks.append(module.register_forward_pre_hook(
                lambda mod, args, r=is_root: self._pre_forward(mod, r)))
            hooks.append(module.register_forward_hook(
                lambda mod, args, kwargs, out, r=is_root:
                self._post_forward(mod, out, (args, kwargs), r), with_kwargs=True))

    def close(self) -> None:
        """Give watched modules their plain parameter dicts back (`stage3_reads.py`)."""
        self.reads.close()

    # -- forward ---------------------------------------------------------------------------------
    @eager_hook
    def _pre_forward(self, module: torch.nn.Module, is_root: bool) -> None:
        params = self.params
        if params.holding_all:
            return  # every unit is gathered and stays so until hold_all ends
        self.reads.push(module, is_root)
        needs = self.layout.needs.get(id(module), ())
        recompute = self.state.in_backward  # an activation-checkpoint recompute
        if is_root and not recompute:
            self.state.begin_forward()
            params.schedule.start_step()
            params.active.clear()
            self.reads.adopt(module)  # modules attached after initialize()
        if not needs:  # a module that only marks the forward stack (stage3_reads.py)
            return
        for index in needs:
            params.active[index] = params.active.get(index, 0) + 1
        if not recompute:
            params.schedule.demand(needs)
        params.unshard(needs)
        if not recompute:
            params.prefetch()

    @eager_hook
    def _post_forward(self, module: torch.nn.Module, output, inputs, is_root: bool) -> None:
        params = self.params
        if params.holding_all:
            return
        # Read before a returned parameter moves to the caller: this call counted these down.
        needs = self.layout.needs.get(id(module), ())
        leaves = tree_leaves(output)
        self.reads.pop(module)
        self.reads.returned(module, leaves)
        borrowed = self.layout.borrowed.get(id(module), ())
        for index in needs:
            params.active[index] = max(0, params.active.get(index, 0) - 1)
        if self.state.in_backward:
            return  # activation-checkpoint recompute: the unit's backward follows at once
        if is_root:
            self.state.end_forward()
        if not needs and not is_root:
            return
        grad_outputs = [t for t in leaves if torch.is_tensor(t) and t.requires_grad] \
            if torch.is_grad_enabled() else []
        backward_follows = bool(grad_outputs)
        call = _ModuleCall(list(needs), list(borrowed))
        for leaf in grad_outputs:  # one regather per call, whichever output's gradient is first
            leaf.register_hook(lambda grad, c=call: self._pre_backward(c))
        if borrowed and backward_follows:
            # A borrowed unit (a tied weight: the head using the embedding's) gets its gradient
            # only when its owner's backward is done too; free it once this module's backward
            # has reached the inputs instead of holding it through the whole backward.
            hook_outputs(inputs, lambda grad, c=call: self._post_backward(c))
        for index in needs:
            if params.active.get(index):
                continue  # an enclosing module (e.g. one sharing a tied weight) still runs
            if backward_follows and params.keeps_soon(index):
                continue
            # An engine without an optimizer never steps: it keeps nothing for backward.
            params.release_after_forward(index, self.keeps_gradients and backward_follows)
        if is_root and not backward_follows:
            # No backward follows this forward (evaluation, generation): nothing it gathered or
            # prefetched stays beyond the persistent units and what GatheredParameters pins.
            params.reshard_all()

    # -- backward ----------------------------------------------------------------------------------
    @eager_hook
    def _pre_backward(self, call: _ModuleCall) -> None:
        self.state.begin_backward()
        if call.regathered:
            return
        call.regathered = True
        self.params.schedule.demand(call.needs)
        self.params.unshard(call.needs)
        self.params.prefetch()

    @eager_hook
    def _post_backward(self, call: _ModuleCall) -> None:
        """A module's backward reached its inputs: free the units it only borrowed (their
        gradients are accumulated later, after their owner's pre-backward gathers them again)
        unless they are needed again soon."""
        if call.released:
            return
        call.released = True
        for index in call.borrowed:
            if not self.params.keeps_soon(index):
                self.params.reshard(index)
