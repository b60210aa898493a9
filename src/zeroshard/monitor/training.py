"""What the engine reports as it trains: the `steps_per_print` line, the monitor events, the
`wall_clock_breakdown` times and the `flops_profiler` step.

`TrainingWatch` is the engine's one hook object: `forward(args, kwargs)`, `backward(loss)` and
`step()` are context managers around those phases, and `after_step()` runs once the optimizer
step is counted. Losses stay on the device until a line is printed or an event written, so a
run with neither pays no host sync for them.

Events (rank 0, at every optimizer step, step = global samples, DeepSpeed's names):
`Train/Samples/train_loss` (mean over the window's micro-steps, this rank's loss),
`Train/Samples/lr` (first param group), `Train/Samples/loss_scale` (fp16 only),
`Train/Samples/samples_per_sec` and, when token ids are seen, `Train/Samples/tokens_per_sec`
(all ranks, over the last step), and with `wall_clock_breakdown` (or the flops profiler)
`Train/Samples/elapsed_time_ms_{forward,backward,step}`.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from .flops import FlopsProfile, whole_numel
from .throughput import count_tokens, mfu, model_flops_per_token, peak_flops
from .timers import WallClock


def _verbose() -> bool:
    return os.environ.get("ZEROSHARD_QUIET", "0") != "1"


class TrainingWatch:
    """Measures an engine's training phases and reports them (see the module docstring)."""

    def __init__(self, engine, monitor):
        cfg = engine._config
        self.engine = engine
        self.monitor = monitor
        self.period = cfg.steps_per_print
        self.breakdown = cfg.wall_clock_breakdown
        self.profiler_cfg = cfg.flops_profiler
        self.comms = cfg.comms_logger.enabled
        self.clock = WallClock(engine.device, self.breakdown)
        self.rank0 = engine.rank == 0
        self._losses: list[torch.Tensor] = []
        self._window_tokens = 0
        self._tokens_seen = False
        self._window_start: float | None = None
        self._last_step_end: float | None = None
        self._last_step_seconds = 0.0
        self._print_since: float | None = None
        self._print_tokens = 0
        self._print_steps = 0
        self._flops_per_token: float | None = None
        self._profile: FlopsProfile | None = None
        self._profiled = False
        self._comm_at_print = engine.comm_report().get("total", 0) if self.comms else 0

    # -- phases -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self, args: tuple, kwargs: dict):
        """Around a forward: count its tokens (training forwards only), time it, profile it."""
        training = torch.is_grad_enabled() and self.engine.module.training
        if training:
            now = time.perf_counter()
            if self._window_start is None:
                self._window_start = self._last_step_end or now
            if self._print_since is None:
                self._print_since = now
            _, tokens = count_tokens(args, kwargs)
            if tokens is not None:
                self._tokens_seen = True
                self._window_tokens += tokens
            self._profile_start()
        with self.clock.time("forward"):
            yield

    @contextlib.contextmanager
    def backward(self, loss: torch.Tensor):
        """Around a backward: keep the (unscaled) loss, time it, profile it."""
        self._losses.append(loss.detach())
        self._profile_start()
        with self.clock.time("backward"):
            yield

    @contextlib.contextmanager
    def step(self):
        """Around the optimizer step (at the accumulation boundary)."""
        if self._profile is not None:
            self._profile.pause()
        with self.clock.time("step"):
            yield

    def after_step(self) -> None:
        """After an optimizer step is counted: events, the printed line, the flops profile."""
        engine = self.engine
        now = time.perf_counter()
        start = self._window_start if self._window_start is not None else now
        self._last_step_seconds = now - start
        self._last_step_end = now
        self._window_start = None
        tokens = self._window_tokens * engine.world_size
        self._window_tokens = 0
        self._print_tokens += tokens
        self._print_steps += 1
        losses, self._losses = self._losses, []
        times = self.clock.take()
        printing = bool(self.period) and engine.global_steps % self.period == 0 and self.rank0 \
            and _verbose()
        writing = self.monitor.enabled and self.rank0
        # The window's mean loss, formed on the device only when something reports it.
        loss = torch.stack(losses).float().mean() if losses and (writing or printing) else None
        if writing:
            self.monitor.write_events(self._events(loss, tokens, times))
        if printing:
            self._print(loss, times, now)
        if self._profile is not None:
            self._finish_profile()

    # -- reporting --------------------------------------------------------------------------------
    def _events(self, loss, tokens: int, times: dict) -> list:
        engine = self.engine
        samples = engine.global_samples
        events = []
        if loss is not None:
            events.append(("Train/Samples/train_loss", loss.item(), samples))
        events.append(("Train/Samples/lr", engine.get_lr()[0], samples))
        if engine.fp16_enabled():
            events.append(("Train/Samples/loss_scale", engine.get_loss_scale(), samples))
        if self._last_step_seconds > 0:
            events.append(("Train/Samples/samples_per_sec",
                           engine.train_batch_size() / self._last_step_seconds, samples))
            if self._tokens_seen:
                events.append(("Train/Samples/tokens_per_sec", tokens / self._last_step_seconds,
                               samples))
        if self.breakdown or self.profiler_cfg.enabled:
            events += [(f"Train/Samples/elapsed_time_ms_{phase}", ms, samples)
                       for phase, ms in times.items()]
        return events

    def flops_per_token(self) -> float:
        """Model training FLOPs per token: 6 x the model's (whole) parameter count."""
        if self._flops_per_token is None:
            seen = {id(p): whole_numel(p) for p in self.engine.module.parameters()}
            self._flops_per_token = model_flops_per_token(sum(seen.values()))
        return self._flops_per_token

    def _print(self, loss, times: dict, now: float) -> None:
        engine = self.engine
        elapsed = now - (self._print_since or now)
        steps, tokens = self._print_steps, self._print_tokens
        self._print_since, self._print_steps, self._print_tokens = now, 0, 0
        parts = [f"step {engine.global_steps}"]
        if loss is not None:
            parts.append(f"loss {loss.item():.4f}")
        lrs = engine.get_lr()
        parts.append("lr " + ",".join(f"{lr:.3g}" for lr in lrs))
        parts.append(f"loss_scale {engine.get_loss_scale():g}")
        if steps and elapsed > 0:
            parts.append(f"{elapsed / steps * 1e3:.1f} ms/step")
            if self._tokens_seen:
                rate = tokens / elapsed
                parts.append(f"{rate:,.0f} tokens/s")
                per_device = rate / engine.world_size * self.flops_per_token()
                parts.append(f"{per_device / 1e12:.3g} TFLOPS/device")
                util = mfu(rate / engine.world_size, self.flops_per_token(),
                           peak_flops(engine.device, engine.compute_dtype))
                if util is not None:
                    parts.append(f"MFU {util:.1%}")
            else:
                parts.append(f"{engine.train_batch_size() * steps / elapsed:,.1f} samples/s")
        print("[zeroshard] " + " | ".join(parts), flush=True)
        if self.breakdown:
            print("[zeroshard] " + WallClock.line(times), flush=True)
        if self.comms:
            print("[zeroshard] " + self._comm_line(steps), flush=True)

    def _comm_line(self, steps: int) -> str:
        report = self.engine.comm_report()
        moved = report.get("total", 0) - self._comm_at_print
        self._comm_at_print = report.get("total", 0)
        kinds = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(report.items())
                          if k not in ("total", "intra_host", "inter_host") and v)
        return (f"comm this rank: {moved / max(steps, 1) / 2**20:.2f} MiB/step over the last "
                f"{steps} step(s); since start: {kinds or 'nothing'}")

    # -- flops profiler ---------------------------------------------------------------------------
    def _profile_start(self) -> None:
        cfg = self.profiler_cfg
        if not cfg.enabled or self._profiled or not self.rank0 or not torch.is_grad_enabled():
            return
        if self.engine.global_steps != cfg.profile_step:
            return
        if self._profile is None:
            self._profile = FlopsProfile(self.engine.module)
        self._profile.start()

    def _finish_profile(self) -> None:
        cfg = self.profiler_cfg
        profile, self._profile, self._profiled = self._profile, None, True
        text = profile.report(cfg.profile_step, cfg.module_depth, cfg.detailed)
        if cfg.output_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.output_file)), exist_ok=True)
            with open(cfg.output_file, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Stop a profile still running and close the monitors."""
        if self._profile is not None:
            self._profile.pause()
            self._profile = None
        self.monitor.close()
