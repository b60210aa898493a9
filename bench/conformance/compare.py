"""Judging a zeroshard run of a conformance case against DeepSpeed's run of it.

`compare()` returns one row of the conformance table: per quantity the largest difference over
the steps (relative for loss, gradient norm, lr and loss scale; absolute for weights) and whether
it is within the case's tolerance (cases.TOLERANCE). Skipped-step counts and the steps whose
gradient norm is absent (a skipped step) must agree exactly. `summary()` shrinks final weights to
what the suite's fixture keeps (per parameter: sum, L2 norm, first values).
"""

from __future__ import annotations

import math

KEEP = 4  # first values of each parameter kept by summary()
COUNT, SUM, NORM = 0, 1, 2  # the positions of summary()'s aggregates


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _series(ours: list, theirs: list, key: str) -> tuple[float, str | None]:
    """Largest relative difference of `key` over the steps, or why the two cannot be compared.
    Where DeepSpeed reports nothing at all for a quantity (None on every step: its stage-0 fp32
    engine keeps no gradient norm), zeroshard's values are not judged."""
    if all(b[key] is None for b in theirs):
        return 0.0, None
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, theirs)):
        x, y = a[key], b[key]
        if (x is None) != (y is None):
            return math.inf, f"step {step + 1}: {key} {x} vs DeepSpeed {y}"
        if x is not None:
            worst = max(worst, _rel(x, y))
    return worst, None


def summary(weights: dict[str, list | None]) -> dict[str, list | None]:
    """Per parameter [count, sum, l2 norm, first KEEP values] (None where it is absent)."""
    out = {}
    for name, values in weights.items():
        if values is None:
            out[name] = None
            continue
        out[name] = [len(values), sum(values), math.sqrt(sum(v * v for v in values)),
                     *values[:KEEP]]
    return out


def _weights(ours: dict, theirs: dict, summarized: bool) -> tuple[float, str | None]:
    """Largest absolute difference per element (for summaries: the sum and norm divided by
    what n independent differences of that size would add up to, and the first values).
    A parameter DeepSpeed has no value for (no fp32 master at stage 0) is not judged."""
    worst = 0.0
    for name, want in theirs.items():
        got = ours.get(name)
        if want is None:
            continue
        if got is None:
            return math.inf, f"{name}: absent here"
        if len(got) != len(want):
            return math.inf, f"{name}: {len(got)} values vs DeepSpeed's {len(want)}"
        if summarized:
            n = max(want[COUNT], 1)
            diffs = [abs(got[SUM] - want[SUM]) / n, abs(got[NORM] - want[NORM]) / math.sqrt(n),
                     *(abs(x - y) for x, y in zip(got[NORM + 1:], want[NORM + 1:]))]
        else:
            diffs = [abs(x - y) for x, y in zip(got, want)]
        worst = max(worst, max(diffs, default=0.0))
    return worst, None


def compare(ours: dict, theirs: dict, tolerance: tuple[float, float],
            summarized: bool = False, not_judged: dict[str, str] | None = None) -> dict:
    """One table row: differences per quantity and the verdict ('equal' or what differs);
    `not_judged`: quantity -> why DeepSpeed's value of it is not the reference."""
    not_judged = not_judged or {}
    if "error" in theirs or "error" in ours:
        return {"verdict": "error", "deepspeed": theirs.get("error"), "zeroshard": ours.get("error")}
    rel, atol = tolerance
    row: dict = {}
    problems = []
    a, b = ours["records"], theirs["records"]
    if len(a) != len(b):
        problems.append(f"{len(a)} steps vs DeepSpeed's {len(b)}")
    for key in ("loss", "grad_norm", "lr", "loss_scale"):
        worst, why = _series(a, b, key)
        row[key] = worst
        if key in not_judged:
            continue
        if why:
            problems.append(why)
        elif worst > rel:
            problems.append(f"{key} differs by {worst:.2e} (rel)")
    skipped = [r["skipped"] for r in a], [r["skipped"] for r in b]
    row["skipped"] = f"{skipped[0][-1]} / {skipped[1][-1]}"
    if skipped[0] != skipped[1]:
        problems.append(f"skipped steps {skipped[0]} vs DeepSpeed {skipped[1]}")
    for kind in ("module", "master"):
        got = ours["weights"][kind]
        got = summary(got) if summarized else got
        worst, why = _weights(got, theirs["weights"][kind], summarized)
        row[kind] = worst
        if why:
            problems.append(f"{kind} weights: {why}")
        elif worst > atol:
            problems.append(f"{kind} weights differ by {worst:.2e} (abs)")
    row["verdict"] = "equal" if not problems else "; ".join(problems)
    return row
