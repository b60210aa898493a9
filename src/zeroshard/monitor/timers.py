"""Wall-clock timers for `wall_clock_breakdown`: forward, backward and optimizer step.

Each phase is timed with `time.perf_counter()` between two device synchronizations (on an
accelerator the host runs ahead of the kernels; a sync makes the interval the device's work),
so turning the breakdown on costs a few syncs per micro-step, as DeepSpeed's timers do. Times
add up over an accumulation window and are taken (and reset) at the optimizer step.

`ThroughputTimer` is DeepSpeed's `engine.tput_timer` (DeepSpeed-Chat calls `update_epoch_count()`
after each epoch and reads samples per second), counting from the engine's own counters.
"""

from __future__ import annotations

import contextlib
import time

import torch

#: DeepSpeed's timer names, as printed in its "time (ms)" line.
PHASES = {"forward": "fwd", "backward": "bwd", "step": "step"}


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (nothing to wait for on the CPU)."""
    if device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


class WallClock:
    """Milliseconds spent in each phase since the last `take()`."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.enabled = enabled
        self.ms = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def time(self, phase: str):
        """Add the time spent inside to `phase` (nothing when the breakdown is off)."""
        if not self.enabled:
            yield
            return
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.ms[phase] += (time.perf_counter() - start) * 1e3

    def take(self) -> dict[str, float]:
        """The times of the window that just ended, by phase; the clock starts again at zero."""
        out, self.ms = self.ms, dict.fromkeys(PHASES, 0.0)
        return out

    @staticmethod
    def line(ms: dict[str, float]) -> str:
        """DeepSpeed's form: `time (ms) | fwd: 12.34 | bwd: 23.45 | step: 3.21`."""
        return "time (ms) | " + " | ".join(f"{PHASES[p]}: {ms[p]:.2f}" for p in PHASES)


class ThroughputTimer:
    """DeepSpeed's `engine.tput_timer`, over the engine's counters."""

    #: DeepSpeed's: global steps before its timer starts measuring.
    start_step = 2

    def __init__(self, engine):
        self._engine = engine
        self.epoch_count = 0
        self._started = time.perf_counter()
        self._first_samples = engine.global_samples

    @property
    def batch_size(self) -> int:
        """Samples per optimizer step over all ranks (DeepSpeed gives it `train_batch_size()`)."""
        return self._engine.train_batch_size()

    @property
    def steps_per_output(self) -> int | None:
        """The config's steps_per_print (None: never)."""
        return self._engine._config.steps_per_print

    @property
    def global_step_count(self) -> int:
        """Optimizer steps taken."""
        return self._engine.global_steps

    @property
    def micro_step_count(self) -> int:
        """Micro-steps (forward/backward passes) taken."""
        return self._engine.micro_steps

    def update_epoch_count(self) -> None:
        """Count one finished epoch."""
        self.epoch_count += 1

    def start(self) -> None:
        """Restart the clock the rate is measured from."""
        self._started = time.perf_counter()
        self._first_samples = self._engine.global_samples

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """Accepted for DeepSpeed's callers; the counters live in the engine."""

    def avg_samples_per_sec(self) -> float:
        """Samples (over all ranks) per second since the clock started."""
        elapsed = time.perf_counter() - self._started
        done = self._engine.global_samples - self._first_samples
        return done / elapsed if elapsed > 0 else 0.0
