"""How many backward passes and optimizer steps this process has run: the step counter.

Every rank must run as many of both. A `StepCounter` counts the engine phases entered through a
`Comm` (`Comm.phase`): the counts label desync reports (`watchdog.py`), travel in the step's
gradient-norm all-reduce (`core/step_check.py`) and in a checkpoint's agreement round, and are
compared when the default group ends (`process_group.steps_agree`). A `World` (`world.py`) hands
the process's one counter, `PROCESS_STEPS`, to every Comm it makes; nothing below reads it from
anywhere else.
"""

from __future__ import annotations

import collections

#: The phases whose counts must agree across ranks (a forward may run on one rank alone, e.g. an
#: evaluation on rank 0 below stage 3).
COUNTED = ("optimizer step", "backward")


class StepCounter:
    """Engine phases entered so far, by name ("backward", "optimizer step", "save_checkpoint")."""

    def __init__(self):
        self.phases: collections.Counter = collections.Counter()

    def enter(self, phase: str) -> None:
        """Count one more `phase`."""
        self.phases[phase] += 1

    def counts(self) -> tuple[int, int]:
        """(optimizer steps, backward passes) run so far."""
        return self.phases[COUNTED[0]], self.phases[COUNTED[1]]

    def clear(self) -> None:
        """Start over (a new default group in the same process, e.g. a test's fresh world)."""
        self.phases.clear()


#: This process's counter: every engine's phases, compared across ranks when the group ends.
PROCESS_STEPS = StepCounter()


def describe_step_counts(counts: list[tuple[int, int]]) -> str:
    """"the ranks ran different numbers of steps (rank 0: 8 ...; rank 1: 7 ...)" and the advice."""
    groups: dict[tuple, list[int]] = {}
    for rank, count in enumerate(counts):
        groups.setdefault(tuple(count), []).append(rank)
    each = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {c[0]} "
                     f"optimizer steps after {c[1]} backward passes" for c, r in groups.items())
    return (f"the ranks ran different numbers of optimizer steps or backward passes ({each}), so "
            "their replicas differ: a rank skipped engine.step() or engine.backward() (or ran an "
            "extra one). Every rank must call both the same number of times; this run's weights "
            "are not to be trusted")


class DesyncError(RuntimeError):
    """Ranks disagreed: about the next collective (a hang, or a failure, caught by the watchdog),
    or about how many optimizer steps and backward passes they ran."""
