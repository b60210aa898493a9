"""The run's own state beside the model and the optimizer's shards: `TrainState`, which the engine
owns and checkpoints save and load (a DCP `Stateful`: `state_dict()` / `load_state_dict()`).

It keeps the engine's counters (the engine's `global_steps`, `global_samples`, `micro_steps`,
`skipped_steps` read and write them here), the LR scheduler and the training DataLoader, and
reaches the optimizer's step count, its fp16 loss scaler, the DataLoader's sampler and this
process's RNGs. A checkpoint records `state_dict()`'s counters, scaler, scheduler and sampler
epoch in rank 0's `zeroshard.json` and its RNG states in each rank's `rng-rank<r>.pt`
(`checkpoint/save.py`). `load_state_dict()` puts back each part it is given: a caller leaves out
what it does not load (the LR scheduler, the RNG a smaller world did not save; a DeepSpeed
checkpoint has no micro-step or optimizer-step count, which follow from its global steps).

Nothing here imports torch.distributed.checkpoint: the engine makes a TrainState at every build,
and checkpoints are the only users of the conversions in `checkpoint/run_state.py`.
"""

from __future__ import annotations

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


class TrainState:
    """Counters, LR scheduler, DataLoader (sampler), loss scaler and RNG of one training run.

    `optimizer`: the ZeroOptimizer (its `steps` and `scaler`); `accumulation_steps`: micro-steps
    per optimizer step, for checkpoints that record no micro-step count."""

    def __init__(self, optimizer, lr_scheduler=None, accumulation_steps: int = 1):
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        #: The DataLoader initialize() built, if any: its sampler's epoch is saved.
        self.dataloader = None
        self.accumulation_steps = accumulation_steps
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0

    @property
    def scaler(self):
        """The optimizer's fp16 loss scaler (core/scaler.py)."""
        return self.optimizer.scaler

    @property
    def sampler(self):
        """The DataLoader's sampler if it has epochs (a DistributedSampler), else None."""
        sampler = getattr(self.dataloader, "sampler", None)
        return sampler if hasattr(sampler, "set_epoch") else None

    def counters(self) -> dict[str, int]:
        """The engine's counters and the optimizer's step count, as a checkpoint records them."""
        out = {name: getattr(self, name) for name in COUNTERS}
        out["optimizer_steps"] = self.optimizer.steps
        return out

    def state_dict(self) -> dict:
        """`counters`, `scaler`, `lr_scheduler` (JSON, or None), `sampler_epoch` (or None) and
        this process's `rng` states."""
        from .checkpoint.run_state import rng_state, scheduler_state  # noqa: PLC0415

        return {"counters": self.counters(), "scaler": self.scaler.state_dict(),
                "lr_scheduler": scheduler_state(self.lr_scheduler),
                "sampler_epoch": getattr(self.sampler, "epoch", None), "rng": rng_state()}

    def load_state_dict(self, state: dict) -> None:
        """Put back `state` (the form `state_dict()` gives): the counters always, the scaler,
        LR scheduler, sampler epoch and RNG where given and not None."""
        counters = state["counters"]
        for name in ("global_steps", "global_samples", "skipped_steps"):
            setattr(self, name, counters[name])
        steps = counters["global_steps"]
        self.micro_steps = counters.get("micro_steps", steps * self.accumulation_steps)
        self.optimizer.steps = counters.get("optimizer_steps", steps)
        if state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        if state.get("lr_scheduler") is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        sampler = self.sampler
        if sampler is not None and state.get("sampler_epoch") is not None:
            sampler.set_epoch(state["sampler_epoch"])  # the epoch's shuffle order, as when saved
        if state.get("rng") is not None:
            from .checkpoint.run_state import set_rng_state  # noqa: PLC0415

            set_rng_state(state["rng"])
