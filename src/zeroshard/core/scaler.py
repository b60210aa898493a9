"""fp16 loss scaling with DeepSpeed's semantics: dynamic (loss_scale 0) or static.

Dynamic: start at 2**initial_scale_power. An overflowing step is skipped; the scale is halved only
once `hysteresis` overflows have been seen since the last reset (it never goes below
min_loss_scale; overflowing again at the minimum is an error). A clean step doubles the scale when
a positive multiple of `loss_scale_window` clean steps came before it since the last overflow (so
the first doubling is on clean step window + 1, as in DeepSpeed, checked against DeepSpeed 0.19.8
by bench/conformance). With `consecutive_hysteresis` every clean step restores the hysteresis
budget; otherwise only a doubling does.
"""

from __future__ import annotations


class LossScaleError(RuntimeError):
    """The dynamic loss scale hit its floor and still overflows."""


class LossScaler:
    """Holds the current loss scale and updates it after each optimizer step."""

    def __init__(self, enabled: bool, loss_scale: float = 0.0, initial_scale_power: int = 16,
                 loss_scale_window: int = 1000, hysteresis: int = 2, min_loss_scale: float = 1.0,
                 consecutive_hysteresis: bool = False):
        self.enabled = enabled
        self.dynamic = enabled and loss_scale == 0
        self.scale = float(2 ** initial_scale_power) if self.dynamic else float(loss_scale or 1.0)
        if not enabled:
            self.scale = 1.0
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_scale = min_loss_scale
        self.consecutive_hysteresis = consecutive_hysteresis
        self.hysteresis_left = hysteresis
        self.clean_steps = 0
        self.overflows = 0

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        """Build from the `fp16` block of a ZeroConfig."""
        return cls(enabled=fp16.enabled, loss_scale=fp16.loss_scale,
                   initial_scale_power=fp16.initial_scale_power,
                   loss_scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                   min_loss_scale=fp16.min_loss_scale,
                   consecutive_hysteresis=fp16.consecutive_hysteresis)

    def update(self, overflow: bool, step: int) -> None:
        """Account for one optimizer step; `overflow` means it was skipped."""
        if not self.dynamic:
            return
        if overflow:
            self.overflows += 1
            self.clean_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
                return
            if self.scale <= self.min_scale:
                raise LossScaleError(
                    f"fp16 loss scale is already at its minimum ({self.min_scale:g}) and step "
                    f"{step} overflowed again: the gradients are inf/nan at every scale. Check the "
                    "loss for nan, lower the learning rate, or train in bf16 (\"bf16\": "
                    "{\"enabled\": true}); fp16.min_loss_scale sets the floor.")
            self.scale = max(self.scale / 2, self.min_scale)
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps and self.clean_steps % self.window == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2
        self.clean_steps += 1

    def state_dict(self) -> dict:
        """Everything needed to resume the scale schedule."""
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left,
                "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()`."""
        self.scale = state["scale"]
        self.hysteresis_left = state["hysteresis_left"]
        self.clean_steps = state["clean_steps"]
        self.overflows = state.get("overflows", 0)
