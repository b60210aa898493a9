"""The accelerator code paths of the step (side streams and events: gradient landings, stage-3
gathers, read-ahead copies of offloaded shards, the early CPU step) run on CPU under recording
streams (tests/stream_check.py), and every cross-stream access is ordered by a wait.

Each case trains a few steps at 2 ranks with the recording streams and again with the real
(inactive, CPU) ones: the parameters agree bitwise, the side streams carried work, and the
checker found no race. Two broken orderings (a wait dropped, a side stream not ordered after the
compute stream) must be caught, so the checker can fail.
"""

from __future__ import annotations

import contextlib
import tempfile

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model
from tests.stream_check import OrderChecker, checked_streams

WORLD = 2
STEPS = 3

CASES = {
    "stage2": {"stage": 2},
    "stage2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "stage2-offload-early": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "zeroshard_step_in_backward": True}},
    "stage3": {"stage": 3, "stage3_param_persistence_threshold": 0},
    # No gather prefetch, so the shards' read-ahead copies (h2d) run instead.
    "stage3-offload-param": {"stage": 3, "stage3_param_persistence_threshold": 0,
                             "stage3_prefetch_bucket_size": 0, "offload_param": {"device": "cpu"}},
    "stage3-qwz-hpz": {"stage": 3, "stage3_param_persistence_threshold": 0,
                       "zero_quantized_weights": True, "zero_hpz_partition_size": 2},
}
# Which side streams each case must have used.
USES = {"stage2": {"reduce"}, "stage2-offload": {"reduce"}, "stage2-offload-early": {"reduce"},
        "stage3": {"reduce", "gather"}, "stage3-offload-param": {"reduce", "gather", "h2d"},
        "stage3-qwz-hpz": {"reduce", "gather"}}


def _train(zero: dict, rank: int, gas: int = 2) -> dict[str, torch.Tensor]:
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
                "zero_optimization": {**zero, "reduce_bucket_size": 200}})
    for tokens, targets in make_batches(STEPS * gas, 2 * WORLD)[:STEPS * gas]:
        mine = slice(rank * 2, rank * 2 + 2)
        engine.backward(lm_loss(engine(tokens[mine]), targets[mine]))
        engine.step()
    with zeroshard.GatheredParameters(list(model.parameters())):
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return out


def _checked(zero: dict, rank: int, breakage=None):
    """(parameters, races, side streams used, `keep_until_used` calls) of a run under recording
    streams."""
    checker = OrderChecker()
    with contextlib.ExitStack() as stack:
        stack.enter_context(checked_streams(checker))
        if breakage is not None:
            stack.enter_context(breakage(checker))
        params = _train(zero, rank)
    used = {s for s, n in checker.ops.items() if n and s not in ("compute", "comm")}
    return params, checker.races, used, checker.kept


@contextlib.contextmanager
def _drop_reduce_waits(checker):
    """Broken: nobody waits for events recorded on the "reduce" stream."""
    from zeroshard import build

    streams_cls = build.Streams
    original = streams_cls.wait

    def wait(self, event, stream=None):
        if event is not None and event.stream == "reduce":
            return
        original(self, event, stream)

    streams_cls.wait = wait
    try:
        yield
    finally:
        streams_cls.wait = original


@contextlib.contextmanager
def _side_stream_not_ordered(checker):
    """Broken: work moved to a side stream does not wait for what the compute stream queued."""
    from zeroshard import build

    streams_cls = build.Streams

    @contextlib.contextmanager
    def on(self, name):
        outer = checker.current
        checker.current = name
        try:
            yield
        finally:
            checker.current = outer

    original, streams_cls.on = streams_cls.on, on
    try:
        yield
    finally:
        streams_cls.on = original


def _all(rank, world):
    out = {}
    for name, zero in CASES.items():
        want = _train(zero, rank)
        got, races, used, kept = _checked(zero, rank)
        out[name] = {"equal": all(torch.equal(want[n], got[n]) for n in want),
                     "races": races[:5], "used": used, "kept": kept}
    _, races, _, _ = _checked(CASES["stage2"], rank, _drop_reduce_waits)
    out["broken: reduce waits dropped"] = races[:5]
    _, races, _, _ = _checked(CASES["stage3"], rank, _side_stream_not_ordered)
    out["broken: side stream not ordered"] = races[:5]
    return out


@pytest.fixture(scope="module")
def results():
    """Every case at 2 ranks, in one world."""
    return run_world(WORLD, _all)


@pytest.mark.parametrize("case", list(CASES))
def test_side_stream_paths_equal_the_cpu_paths(results, case):
    for rank, got in enumerate(results):
        assert got[case]["equal"], f"rank {rank}: {case} differs under recording streams"


@pytest.mark.parametrize("case", list(CASES))
def test_side_streams_carry_work_in_order(results, case):
    for rank, got in enumerate(results):
        assert USES[case] <= got[case]["used"], (rank, case, got[case]["used"])
        assert not got[case]["races"], f"rank {rank}, {case}: {got[case]['races']}"


def test_qwz_decodes_tell_the_streams_what_they_read_from_another_stream(results):
    """qwZ's packed rows, gathered from the "gather" side stream and decoded on the compute
    stream, go through `Streams.keep_until_used` (no `record_stream` behind the streams' back),
    each one written by a collective and read on the compute stream; nothing else needs it."""
    for rank, got in enumerate(results):
        kept = got["stage3-qwz-hpz"]["kept"]
        assert kept, f"rank {rank}: qwZ's decodes never went through the streams"
        assert all(writer is not None and writer.startswith("comm#") and reader == "compute"
                   for writer, reader in kept), (rank, kept[:5])
        assert not any(got[case]["kept"] for case in CASES if "qwz" not in case), rank


@pytest.mark.parametrize("broken", ["broken: reduce waits dropped",
                                    "broken: side stream not ordered"])
def test_a_missing_wait_is_caught(results, broken):
    for rank, got in enumerate(results):
        assert got[broken], f"rank {rank}: {broken} went unnoticed"
