"""DeepSpeed-compatible learning-rate schedulers operating on ``optimizer.param_groups``.

Five schedules are provided, each built as ``Cls(optimizer, **params)`` with the parameter
names and defaults of DeepSpeed's ``"scheduler"`` config block (reference: DeepSpeed 0.19.8,
``deepspeed/runtime/lr_schedules.py``): :class:`WarmupLR`, :class:`WarmupDecayLR`,
:class:`WarmupCosineLR`, :class:`OneCycle` and :class:`LRRangeTest`.  ``optimizer`` may be any
object exposing a ``param_groups`` list of dicts; tensor-valued ``"lr"`` entries are updated in place.

Stepping convention (identical to DeepSpeed):

* ``last_batch_iteration`` (``t``) starts at ``-1``.  When constructed with ``-1`` the scheduler
  immediately writes its start value into every group: ``warmup_min_lr`` (WarmupLR/DecayLR),
  ``0.0`` (WarmupCosineLR), ``cycle_min_lr`` plus ``betas=(cycle_min_mom, 0.99)`` (OneCycle),
  ``lr_range_test_min_lr`` (LRRangeTest).  A resumed scheduler (``t >= 0``) leaves groups alone.
* Every ``step()`` does ``t += 1`` (or ``t = last_batch_iteration`` when given) and then writes
  ``lr(t)``.  So the k-th call to ``step()`` (k = 1, 2, ...) applies the formula at ``t = k - 1``;
  the engine calls ``step()`` once after each (non-overflowing) optimizer step.
* Warmup schedules use ``W = max(2, warmup_num_steps)``; the warmup fraction is ``ln(t+1)/ln(W)``
  ("log") or ``t/W`` ("linear") for ``t < W``, so the peak is first reached at ``t = W - 1`` (log)
  or ``t = W`` (linear).  WarmupDecayLR then decays linearly, reaching 0 at ``t = total_num_steps``.
  WarmupCosineLR multiplies each group's lr *at construction* by a ratio whose cosine phase has
  progress ``min(1, (t - W + 1) / max(1, total_num_steps - W))``, i.e. it is held at
  ``cos_min_ratio`` from ``t = total_num_steps - 1`` on.
* OneCycle and LRRangeTest evaluate their shape at ``b = t + 1``.  OneCycle's stair counts quantise
  each half-cycle into that many flat steps; its post-cycle decay uses ``d = t - (first + second) + 1``
  and, like DeepSpeed, *multiplies* momentum by ``1 + decay_mom_rate * d / decay_step_size``.
* ``state_dict()`` is ``{"last_batch_iteration": t}`` (checkpoint-compatible with DeepSpeed);
  ``load_state_dict`` restores ``t`` only, the next ``step()`` applies ``lr(t + 1)``.

Deliberate differences: settings DeepSpeed merely warns about (unknown ``warmup_type``,
``total_num_steps < warmup_num_steps``) or rejects with a TypeError (misspelt names) raise
``ValueError`` naming the scheduler and parameter; OneCycle also cycles SGD-style ``"momentum"``
when the groups have no ``"betas"`` (DeepSpeed disables momentum cycling there).
"""
from __future__ import annotations

import difflib
import inspect
import logging
import math
from typing import Any, Dict, List, Optional

import torch

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
           "SCHEDULERS", "VALID_LR_SCHEDULES", "build_scheduler"]

logger = logging.getLogger(__name__)

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
ONECYCLE_BETA2 = 0.99  # DeepSpeed pins the second Adam beta to this while cycling momentum


def _bad(sched: str, param: str, msg: str) -> ValueError:
    return ValueError(f"{sched}: invalid parameter '{param}': {msg}")


def _per_group(sched: str, param: str, value: Any, n: int) -> List[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise _bad(sched, param, f"expected {n} values (one per param group), got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * n


def _positive_int(sched: str, param: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _bad(sched, param, f"must be a positive integer, got {value!r}")
    return value


def _count(sched: str, param: str, value: Any) -> int:
    """A step count that may be 0 (HF's default warmup is 0 steps; DeepSpeed accepts it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(sched, param, f"must be a whole number >= 0, got {value!r}")
    return value


def _check_total(sched: str, total_num_steps: Any, warmup_num_steps: int) -> None:
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, (int, float)) \
            or total_num_steps < warmup_num_steps:
        raise _bad(sched, "total_num_steps",
                   f"must be >= warmup_num_steps ({warmup_num_steps}), got {total_num_steps!r}")


def _check_warmup_type(sched: str, warmup_type: Any) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        raise _bad(sched, "warmup_type", f"must be 'log' or 'linear', got {warmup_type!r}")
    return warmup_type


def _warmup_fraction(t: int, w: int, warmup_type: str, inv_log_w: float) -> float:
    if warmup_type == WARMUP_LOG_RATE:
        return inv_log_w * math.log(t + 1)
    return t / w


class _Scheduler:
    """Common stepping, bookkeeping and (de)serialisation for every schedule."""

    def __init__(self, optimizer: Any, last_batch_iteration: int, unknown: Dict[str, Any]):
        name = type(self).__name__
        if unknown:
            allowed = type(self).param_names()
            key = sorted(unknown)[0]
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f"; valid parameters: {', '.join(allowed)}"
            raise ValueError(f"{name}: unknown parameter '{key}'{hint}")
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"{name}: optimizer must expose 'param_groups', got {type(optimizer).__name__}")
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) \
                or last_batch_iteration < -1:
            raise _bad(name, "last_batch_iteration", f"must be an int >= -1, got {last_batch_iteration!r}")
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: Optional[List[float]] = None

    @classmethod
    def param_names(cls) -> List[str]:
        """Names of the config parameters this scheduler accepts."""
        sig = inspect.signature(cls.__init__)
        return [p.name for p in sig.parameters.values()
                if p.name not in ("self", "optimizer") and p.kind is p.POSITIONAL_OR_KEYWORD]

    @property
    def _groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def _start(self) -> None:
        if self.last_batch_iteration == -1:
            self._apply(self.get_lr())
        else:
            self._last_lr = [g["lr"] for g in self._groups]

    def _apply(self, lrs: List[Any]) -> None:
        for group, lr in zip(self._groups, lrs):
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
            else:
                group["lr"] = lr
        self._last_lr = [g["lr"] for g in self._groups]

    def get_lr(self) -> List[float]:
        """Per-group learning rates for the current ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> List[float]:
        """Learning rates most recently written into the param groups."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}: no learning rate computed yet; call step() first")
        return list(self._last_lr)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance to ``last_batch_iteration`` (default: previous + 1) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def state_dict(self) -> Dict[str, Any]:
        """Resumable state (DeepSpeed-compatible): the last batch iteration."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore the iteration counter; the next ``step()`` continues the sequence."""
        self.last_batch_iteration = sd["last_batch_iteration"]


class WarmupLR(_Scheduler):
    """Warm lr up from warmup_min_lr to warmup_max_lr (default: each group's lr), then hold it."""

    def __init__(self, optimizer: Any, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1, **unknown: Any):
        super().__init__(optimizer, last_batch_iteration, unknown)
        name, n = type(self).__name__, len(self._groups)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in self._groups]
        self.min_lrs = _per_group(name, "warmup_min_lr", warmup_min_lr, n)
        self.max_lrs = _per_group(name, "warmup_max_lr", warmup_max_lr, n)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _count(name, "warmup_num_steps", warmup_num_steps))
        self.warmup_type = _check_warmup_type(name, warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._validate(warmup_num_steps)
        self._start()

    def _validate(self, warmup_num_steps: int) -> None:
        pass

    def _get_gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type, self.inverse_log_warm_up)
        return 1.0

    def get_lr(self) -> List[float]:
        """Per-group lr: min + (max - min) * gamma(t); min before the first step."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR followed by linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1, **unknown: Any):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration, **unknown)

    def _validate(self, warmup_num_steps: int) -> None:
        _check_total(type(self).__name__, self.total_num_steps, warmup_num_steps)

    def _get_gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type, self.inverse_log_warm_up)
        span = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - t) / span)


class WarmupCosineLR(_Scheduler):
    """Scale each group's initial lr by a warmup ratio, then cosine-decay it to cos_min_ratio."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1, **unknown: Any):
        super().__init__(optimizer, last_batch_iteration, unknown)
        name = type(self).__name__
        self.warmup_num_steps = max(2, _count(name, "warmup_num_steps", warmup_num_steps))
        self.warmup_type = _check_warmup_type(name, warmup_type)
        _check_total(name, total_num_steps, warmup_num_steps)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self._groups]
        self._start()

    def get_lr_ratio(self) -> float:
        """Multiplier applied to the initial lrs at the current iteration."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            frac = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type, self.inverse_log_warm_up)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        k = t - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        cos_part = (1.0 + math.cos(math.pi * min(1.0, k / span))) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cos_part)

    def get_lr(self) -> List[float]:
        """Per-group lr: initial lr * ratio(t); 0.0 before the first step."""
        if self.last_batch_iteration < 0:
            return [0.0] * len(self.org_lrs)
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Scheduler):
    """1Cycle policy: lr up then down between cycle_min_lr/cycle_max_lr (momentum inversely), then decay."""

    def __init__(self, optimizer: Any, cycle_min_lr: Any, cycle_max_lr: Any, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: Optional[int] = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: Optional[int] = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1, **unknown: Any):
        super().__init__(optimizer, last_batch_iteration, unknown)
        name, n = type(self).__name__, len(self._groups)
        if cycle_first_step_size is None or cycle_first_step_size <= 0:
            raise _bad(name, "cycle_first_step_size", f"must be > 0, got {cycle_first_step_size!r}")
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if second < 0:
            raise _bad(name, "cycle_second_step_size", f"must be >= 0, got {cycle_second_step_size!r}")
        if decay_step_size is None or decay_step_size < 0:
            raise _bad(name, "decay_step_size", f"must be >= 0, got {decay_step_size!r}")
        if cycle_second_stair_count is None:
            cycle_second_stair_count = cycle_first_stair_count
        for param, count in (("cycle_first_stair_count", cycle_first_stair_count),
                             ("cycle_second_stair_count", cycle_second_stair_count)):
            if isinstance(count, bool) or not isinstance(count, int):
                raise _bad(name, param, f"must be an integer (<= 0 disables stairs), got {count!r}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(name, "cycle_min_lr", cycle_min_lr, n)
        self.max_lrs = _per_group(name, "cycle_max_lr", cycle_max_lr, n)
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        self.min_moms = _per_group(name, "cycle_min_mom", cycle_min_mom, n)
        self.max_moms = _per_group(name, "cycle_max_mom", cycle_max_mom, n)
        self.momentum_key = self._momentum_key() if cycle_momentum else None
        self.cycle_momentum = self.momentum_key is not None
        if self.last_batch_iteration == -1:
            self._apply(list(self.min_lrs))
            self._apply_mom(list(self.min_moms))
        else:
            self._last_lr = [g["lr"] for g in self._groups]

    def _momentum_key(self) -> Optional[str]:
        groups = self._groups
        defaults = getattr(self.optimizer, "defaults", None) or {}
        if "betas" in defaults or (groups and all("betas" in g for g in groups)):
            return "betas"
        if groups and all("momentum" in g for g in groups):
            return "momentum"
        logger.warning("OneCycle: cycle_momentum disabled; param groups have neither 'betas' nor 'momentum'")
        return None

    def _apply_mom(self, moms: Optional[List[float]]) -> None:
        if moms is None or self.momentum_key is None:
            return
        for group, mom in zip(self._groups, moms):
            group[self.momentum_key] = (mom, ONECYCLE_BETA2) if self.momentum_key == "betas" else mom

    def _scale_factor(self) -> float:
        b = self.last_batch_iteration + 1
        cycle = math.floor(1 + b / self.total_size)
        x = 1.0 + b / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # quantise from the integer offset inside the cycle, not from the float scale
            pos = b % self.total_size
            if pos <= self.first_step_size:
                position = pos * stairs / self.first_step_size
            else:
                position = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> List[float]:
        """Per-group lr: cyclic for t < cycle length, then min_lr / (1 + rate * d / decay_step_size)."""
        t = self.last_batch_iteration
        if t < self.total_size:
            s = self._scale_factor()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((t - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> Optional[List[float]]:
        """Per-group momentum (first beta) for the current iteration, or None if not cycling."""
        if not self.cycle_momentum:
            return None
        t = self.last_batch_iteration
        if t < self.total_size:
            s = self._scale_factor()
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((t - self.total_size + 1) / self.decay_step_size)
        return [hi * factor for hi in self.max_moms]

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance one iteration, writing lr and (if cycling) momentum into the groups."""
        super().step(last_batch_iteration)
        self._apply_mom(self.get_mom())


class LRRangeTest(_Scheduler):
    """LR range test: lr = min_lr * (1 + step_rate * (t + 1) / step_size), optionally floored."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: Any = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1, **unknown: Any):
        super().__init__(optimizer, last_batch_iteration, unknown)
        name = type(self).__name__
        self.step_size = _positive_int(name, "lr_range_test_step_size", lr_range_test_step_size)
        self.min_lr = _per_group(name, "lr_range_test_min_lr", lr_range_test_min_lr, len(self._groups))
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if self.last_batch_iteration == -1:
            self._apply(list(self.min_lr))
        else:
            self._last_lr = [g["lr"] for g in self._groups]

    def get_lr(self) -> List[float]:
        """Per-group lr for the current iteration."""
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lo * (1 + self.step_rate * interval) for lo in self.min_lr]


SCHEDULERS = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
#: DeepSpeed's list of its scheduler names (accelerate checks a scheduler's class name against it).
VALID_LR_SCHEDULES = list(SCHEDULERS)
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def build_scheduler(spec: Dict[str, Any], optimizer: Any) -> _Scheduler:
    """Build a scheduler from a DeepSpeed-style ``{"type": name, "params": {...}}`` dict."""
    if not isinstance(spec, dict) or "type" not in spec:
        raise ValueError(f"scheduler spec must be a dict with a 'type' key, got {spec!r}")
    name = str(spec["type"])
    lookup = {k.lower(): cls for k, cls in SCHEDULERS.items()}
    cls = lookup.get(name.lower())
    if cls is None:
        close = difflib.get_close_matches(name.lower(), list(lookup), n=1, cutoff=0.5)
        hint = f" (did you mean '{lookup[close[0]].__name__}'?)" if close else ""
        raise ValueError(f"unknown scheduler type '{name}'{hint}; valid types: {', '.join(SCHEDULERS)}")
    params = spec.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{cls.__name__}: 'params' must be a dict, got {type(params).__name__}")
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty \
                and p.name not in ("self", "optimizer") and p.name not in params:
            raise ValueError(f"{cls.__name__}: missing required parameter '{p.name}'")
    return cls(optimizer, **params)
