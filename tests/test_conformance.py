"""zeroshard trains every case of the conformance matrix as DeepSpeed 0.19.8 did.

bench/conformance/run.py runs each case (bench/conformance/cases.py) through real DeepSpeed and
zeroshard side by side and records DeepSpeed's per-step loss, gradient norm, lr, loss scale and
skipped steps plus final-weight summaries in tests/fixtures/conformance_deepspeed.json. Here
zeroshard runs the same cases in one spawned world per world size and is judged against those
records with the same tolerances (bench/conformance/compare.py); DeepSpeed itself is not needed.
Cases DeepSpeed could not run on CPU are skipped with DeepSpeed's error.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.harness import run_world

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "bench", "conformance"))

import cases  # noqa: E402
from compare import compare  # noqa: E402

with open(os.path.join(HERE, "fixtures", "conformance_deepspeed.json"), encoding="utf-8") as _fh:
    RECORDED = json.load(_fh)

NAMES = [n for n in cases.CASES if n in RECORDED]


def _run_all(rank, world):
    import zeroshard

    out = {}
    for name in NAMES:
        size, config = cases.CASES[name]
        if size != world or "error" in RECORDED[name]:
            continue
        try:
            out[name] = cases.train(zeroshard, config, rank, world)
        except Exception as err:  # noqa: BLE001 - reported per case
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    return out


@pytest.fixture(scope="module")
def ours():
    """zeroshard's results of every recorded case, by name (rank 0's)."""
    results = {}
    for world in sorted({cases.CASES[n][0] for n in NAMES}):
        results.update(run_world(world, _run_all)[0])
    return results


def test_every_case_is_recorded():
    assert set(cases.CASES) == set(NAMES), set(cases.CASES) - set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_case_equals_deepspeed(ours, name):
    # Where DeepSpeed disagrees with itself, zeroshard is held to the case named (cases.py says why).
    theirs = RECORDED[cases.JUDGED_AGAINST.get(name, (name,))[0]]
    if "error" in theirs:
        pytest.skip(f"DeepSpeed 0.19.8 could not run it here: {theirs['error']}")
    got = ours[name]
    assert "error" not in got, got["error"]
    row = compare(got, theirs, cases.TOLERANCE[cases.precision(cases.CASES[name][1])],
                  summarized=True, not_judged=cases.NOT_JUDGED.get(name))
    assert row["verdict"] == "equal", row
