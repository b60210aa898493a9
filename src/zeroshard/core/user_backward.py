"""`loss.backward()` on a loss computed from the engine's outputs (DeepSpeed 0.18.3+), doing what
`engine.backward(loss)` does, and `engine.scale(loss)` for fp16.

DeepSpeed's mechanism: its forward puts backward hooks on the tensors it returns; the first one
to run in a backward does what `engine.backward` does around `loss.backward()` (here: tell the
stage whether this backward ends the accumulation window, count it) and each divides the
gradient arriving at its tensor by `gradient_accumulation_steps`. fp16 loss scaling is not done
by the hooks: the script calls `engine.scale(loss).backward()`, and a plain `loss.backward()`
under dynamic loss scaling is refused (`RuntimeError: Loss scaling is required ...`).

Here the engine's forward passes the tensors it returns through one autograd node (`_Outputs`),
an identity in forward (a detached alias, as DeepSpeed's stage-3 module hooks make) whose
backward is that hook. Every path from a loss into the model crosses exactly one such node, so
a model that returns its loss together with the logits it computed it from has its gradient
divided once; DeepSpeed's hooks on both tensors divide it twice at stages 1-2 (measured on
DeepSpeed 0.19.8, CPU, 2 ranks; its stage 3 wraps module outputs and divides once, as here).
The fp16 refusal comes from that node, before any gradient reached the model, so nothing is
half-accumulated. Stage 0 works too (DeepSpeed refuses `tensor.backward()` at stage 0).

Graphs that `engine.backward` runs pass through the node unchanged (their loss was scaled
already): `engine.backward` records its graph task id, for every engine, since one loss may
combine several engines' outputs (a policy and a reference model).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

# The autograd graph tasks `engine.backward` runs now, by any engine: shared across engines
# because one backward may cross several engines' outputs (autograd may run hooks on its own
# threads, hence the lock).
_ENGINE_GRAPHS: set[int] = set()
_LOCK = threading.Lock()


def _graph_id() -> int:
    return torch._C._current_graph_task_id()


class _Outputs(torch.autograd.Function):
    """Identity over the engine's output tensors; backward: `UserBackward.arrived`."""

    @staticmethod
    def forward(ctx, hooks, *tensors):
        ctx.hooks = hooks
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.hooks.arrived(grads))


class UserBackward:
    """The engine's side of a plain `loss.backward()` (one per engine)."""

    def __init__(self, engine):
        self.engine = engine
        #: `engine.scale(loss)` was called: the coming backward is loss-scaled.
        self.scaled = False
        self._graph = -1  # the graph task whose prologue ran last

    def wrap(self, output):
        """`output` with each tensor that carries a gradient passed through `_Outputs`."""
        if not torch.is_grad_enabled():
            return output
        leaves, spec = tree_flatten(output)
        picked = [i for i, leaf in enumerate(leaves)
                  if torch.is_tensor(leaf) and leaf.grad_fn is not None]
        if not picked:
            return output
        wrapped = _Outputs.apply(self, *[leaves[i] for i in picked])
        for i, tensor in zip(picked, wrapped):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    @contextlib.contextmanager
    def engine_backward(self, loss: torch.Tensor):
        """Around `engine.backward`'s own `backward()`: its graph passes `_Outputs` unchanged."""
        graph = []

        def record(grad):
            graph.append(_graph_id())
            with _LOCK:
                _ENGINE_GRAPHS.add(graph[-1])
            return grad

        handle = loss.register_hook(record) if loss.requires_grad else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
            with _LOCK:
                _ENGINE_GRAPHS.difference_update(graph)

    def arrived(self, grads):
        """The gradients of the engine's outputs in a backward: divided by the accumulation
        steps unless `engine.backward` runs it; the first arrival of a backward runs the
        prologue."""
        graph = _graph_id()
        with _LOCK:
            if graph in _ENGINE_GRAPHS:
                return grads
        if graph != self._graph:
            self._graph = graph
            self._prologue()
        gas = self.engine.gradient_accumulation_steps()
        if gas == 1:
            return grads
        return tuple(None if g is None else g / gas for g in grads)

    def _prologue(self) -> None:
        """What `engine.backward` does before its `backward()`, once per backward."""
        engine = self.engine
        scaled, self.scaled = self.scaled, False
        if engine.scaler.enabled and engine.scaler.scale != 1.0 and not scaled:
            raise RuntimeError(
                "loss.backward() under fp16 loss scaling: the loss must be scaled first. Call "
                "engine.backward(loss), or engine.scale(loss).backward() (as with DeepSpeed)")
        engine._count_backward()
        engine.optimizer.policy.expect_boundary(engine.is_gradient_accumulation_boundary())
        engine.optimizer.policy.note_loss(None)  # its loss is the script's: not seen here

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale (1 without loss scaling), for `.backward()`."""
        if not torch.is_tensor(loss) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError("engine.scale expects a scalar loss tensor with a grad_fn (computed "
                             "from the engine's outputs); for a non-scalar tensor call "
                             "tensor.backward(grad) instead")
        self.scaled = True
        scale = self.engine.scaler.scale
        return loss * scale if self.engine.scaler.enabled and scale != 1.0 else loss
