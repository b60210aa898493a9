"""What the ranks of an `Accelerator` do together: gather (for metrics), reduce, pad, barriers,
rank-ordered blocks and printing once. Every collective goes through the Comm of the `World`
current when the Accelerator was made (`dist/world.py`); `prepare()` builds its engine a World of
its own after that, so metric traffic never shows in the engine's comm ledger."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["RankMixin"]


class RankMixin:
    """Accelerate's cross-rank helpers; the class using it has `comm`, `device`, the rank
    properties and `end_of_dataloader_now` / `_active` (the running prepared loaders)."""

    # -- collectives -------------------------------------------------------------------------------
    def gather(self, tensor):
        """Every rank's tensors concatenated along dim 0 (nested structures too); all ranks call."""
        return _apply(tensor, self._gather_one)

    def _gather_one(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().to(self.device)
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        shapes = self.comm.all_gather_object(tuple(tensor.shape))
        if len(set(shapes)) > 1:
            listed = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(shapes))
            raise ValueError(f"gather: the ranks' tensors differ in shape ({listed}); pad them to "
                             "one shape first (accelerator.pad_across_processes)")
        out = torch.empty((self.num_processes * tensor.shape[0], *tensor.shape[1:]),
                          dtype=tensor.dtype, device=tensor.device)
        self.comm.all_gather(out, tensor)
        return out

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """`gather`, without the samples repeated to complete the last round of a prepared loader."""
        tensors_only = _all_tensors(input_data)
        if use_gather_object or not tensors_only:
            data = [x for part in self.comm.all_gather_object(input_data)
                    for x in (part if isinstance(part, (list, tuple)) else [part])]
        else:
            data = self.gather(input_data)
        if self.end_of_dataloader_now:
            remainder = self._active[-1].remainder()
            if remainder:
                return _apply(data, lambda t: t[:remainder]) if tensors_only and not \
                    use_gather_object else data[:remainder]
        return data

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """Sum (or mean / max / min) of every rank's tensors, on every rank."""
        ops = {"sum": torch.distributed.ReduceOp.SUM, "mean": torch.distributed.ReduceOp.SUM,
               "max": torch.distributed.ReduceOp.MAX, "min": torch.distributed.ReduceOp.MIN}
        if reduction == "none":
            return tensor
        if reduction not in ops:
            raise ValueError(f"reduce(reduction={reduction!r}): choose sum, mean, max, min or none")

        def one(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().to(self.device).clone()
            self.comm.all_reduce(t, op=ops[reduction])
            return (t / self.num_processes if reduction == "mean" else t) * scale
        return _apply(tensor, one)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
        """Pad each rank's tensors along `dim` to the largest size any rank has."""
        def one(t: torch.Tensor) -> torch.Tensor:
            size = max(s[dim] for s in self.comm.all_gather_object(tuple(t.shape)))
            if t.shape[dim] == size:
                return t
            shape = list(t.shape)
            shape[dim] = size
            out = t.new_full(shape, pad_index)
            index = [slice(None)] * t.dim()
            index[dim] = slice(size - t.shape[dim], size) if pad_first else slice(0, t.shape[dim])
            out[tuple(index)] = t
            return out
        return _apply(tensor, one)

    def wait_for_everyone(self) -> None:
        """A barrier across all ranks."""
        self.comm.barrier()

    @contextlib.contextmanager
    def main_process_first(self):
        """Run the block on rank 0 first, then on the others."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def local_main_process_first(self):
        """Run the block on each node's first process first, then on the others."""
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    def print(self, *args, **kwargs) -> None:
        """print(), once per node (on the local main process)."""
        if self.is_local_main_process:
            print(*args, **kwargs)


def _all_tensors(data) -> bool:
    if torch.is_tensor(data):
        return True
    if isinstance(data, dict):
        return all(_all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(v) for v in data)
    return False


def _apply(data, fn):
    if torch.is_tensor(data):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({k: _apply(v, fn) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(_apply(v, fn) for v in data)
    return data

