"""The `flops_profiler` section: one training step counted by torch's FLOP counter, per module.

`FlopsProfile` wraps the forwards and backwards of the step `profile_step` (engine.global_steps
at its start) in `torch.utils.flop_counter.FlopCounterMode` on rank 0, times them, and renders
one line per module (down to `module_depth`): FLOPs (forward and backward, recomputation
included), share of the total, parameters; then the totals and the achieved TFLOPS. The text
is printed, or written to `output_file`.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..core.layout import full_numel


def whole_numel(param: nn.Parameter) -> int:
    """A parameter's real size, also while stage 3 holds only its shard (`ds_numel`)."""
    return getattr(param, "ds_numel", full_numel(param))


def _human(value: float, unit: str = "") -> str:
    """`1.23 G` style: three significant digits and an SI prefix."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def module_params(model: nn.Module) -> dict[str, int]:
    """Parameters (whole, even when partitioned at stage 3) of every module, by FlopCounterMode's
    name for it: the root's class name, then the dotted path."""
    root = type(model).__name__
    out = {}
    for name, module in model.named_modules():
        seen = {id(p): whole_numel(p) for p in module.parameters()}
        out[f"{root}.{name}" if name else root] = sum(seen.values())
    return out


class FlopsProfile:
    """Counts the FLOPs of one step's forwards and backwards; `report()` renders them."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.counter = FlopCounterMode(display=False)
        self.seconds = 0.0
        self._entered_at: float | None = None

    def start(self) -> None:
        """Begin (or resume, for the next micro-step) counting and timing."""
        if self._entered_at is None:
            self.counter.__enter__()
            self._entered_at = time.perf_counter()

    def pause(self) -> None:
        """Stop counting and timing until the next `start()`."""
        if self._entered_at is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - self._entered_at
            self._entered_at = None
            self.counter.__exit__(None, None, None)

    @property
    def total_flops(self) -> int:
        """FLOPs counted so far."""
        return int(self.counter.get_total_flops())

    def report(self, step: int, module_depth: int = -1, detailed: bool = True) -> str:
        """The profile as text: a line per module down to `module_depth` (-1: all), then totals."""
        self.pause()
        total = self.total_flops
        params = module_params(self.model)
        lines = [f"[zeroshard] flops profile of step {step} (forward + backward, rank 0):"]
        if detailed:
            lines.append(f"  {'module':<48} {'FLOPs':>12} {'share':>7} {'params':>10}")
            root = type(self.model).__name__
            counts = self.counter.get_flop_counts()
            # The model's modules in their own order; the counter also names the wrappers it ran
            # in (the engine), and the root's line is the whole count, since the counter may have
            # started inside the root's forward.
            for path, _ in self.model.named_modules():
                name = f"{root}.{path}" if path else root
                depth = path.count(".") + 1 if path else 0
                flops = total if not path else sum(counts.get(name, {}).values())
                if (module_depth >= 0 and depth > module_depth) or (path and not flops):
                    continue
                share = flops / total if total else 0.0
                label = "  " * depth + (path or root)
                lines.append(f"  {label:<48} {_human(flops):>12} {share:>6.1%} "
                             f"{_human(params.get(name, 0)):>10}")
        achieved = total / self.seconds if self.seconds > 0 else 0.0
        lines.append(f"  total: {total:,} FLOPs ({_human(total)}) in {self.seconds * 1e3:.1f} ms of forward "
                     f"and backward = {achieved / 1e12:.4g} TFLOPS; parameters "
                     f"{_human(params.get(type(self.model).__name__, 0))}")
        return "\n".join(lines)
