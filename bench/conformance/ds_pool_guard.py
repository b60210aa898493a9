"""A pytest plugin for DeepSpeed's unit tests: a test that fails in a pool worker reports the
failure instead of stalling the whole run.

DeepSpeed's `DistributedTest` runs each rank's test body in a `multiprocessing.Pool` worker and
re-raises whatever the body raised. pytest's own outcomes (`pytest.fail`, `pytest.raises`' "DID
NOT RAISE", both `Failed`) are `BaseException`s, not `Exception`s, and a pool worker catches only
`Exception`: the worker dies with the task, the pool never completes it, and after
`DS_UNITTEST_TIMEOUT` the harness's `pool.join()` waits forever (measured: test_tag_validation's
unknown-tag test, whose expected error zeroshard did not raise, stalled the run). Real DeepSpeed
stalls the same way on such a failure; it is only rarer there.

Loaded with `-p ds_pool_guard` (this folder on PYTHONPATH) by run_deepspeed_unit_tests.py for
both engines, it replaces `DistributedExec._dist_run` in the pytest process with a descriptor that
hands the pool a picklable wrapper: in the worker the wrapper runs the original `_dist_run` and
turns a `BaseException` other than `Exception` into a `RuntimeError` naming it, so the test fails
with its message and the pool stays whole. Skips are untouched (`_dist_run` returns them).
"""

from __future__ import annotations

import inspect


class GuardedRun:
    """Picklable stand-in for a bound `_dist_run`: runs it, re-raising pytest outcomes as errors."""

    def __init__(self, test):
        self.test = test

    def __call__(self, *args):
        """Run the test's original `_dist_run(*args)` in this (worker) process."""
        run = inspect.getattr_static(type(self.test), "_dist_run")
        if isinstance(run, Guard):  # a fork of the patched process: use what it replaced
            run = run.original
        try:
            return run(self.test, *args)
        except Exception:
            raise
        except BaseException as err:  # noqa: BLE001 - a pool worker would die of it
            raise RuntimeError(f"{type(err).__name__} in a test worker: {err}") from None


class Guard:
    """Class attribute standing in for `_dist_run`: instance lookups answer a `GuardedRun`."""

    def __init__(self, original):
        self.original = original

    def __get__(self, test, owner=None):
        if test is None:
            return self.original
        return GuardedRun(test)


def pytest_configure(config):
    """Patch DeepSpeed's harness, if this run has one (`unit.common` importable from the cwd)."""
    try:
        from unit.common import DistributedExec
    except ImportError:
        return
    current = inspect.getattr_static(DistributedExec, "_dist_run")
    if not isinstance(current, Guard):
        DistributedExec._dist_run = Guard(current)
