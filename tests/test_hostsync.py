"""Host syncs in the step (dist/hostsync.py): one training step (forward, backward, step) at stages
0-3 reads exactly one value on the host, the overflow / non-finite flag, read after the whole step
is queued; the gradient norm stays a tensor until asked for.

On CPU no read stalls anything, so the test counts instead: every `Tensor.item`, `bool(tensor)`,
`float(tensor)`, `int(tensor)` and `tolist` call during the step (the ways Python code turns a
device value into a host value) must be one of the counted points of `HostSyncs`.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice

MICRO = 2
READS = ("item", "__bool__", "__float__", "__int__", "tolist")


@contextlib.contextmanager
def _count_host_reads(calls: Counter):
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)
        return counted

    for name, original in saved.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def _steps(rank, world, stage, extra, optimizer=None):
    batches = make_batches(3, MICRO * world)
    model = make_model()
    # The desync watchdog stays on (its default): it adds no host read in steady state.
    stage3 = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    opt = (optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-3)))(model.parameters())
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=opt,
        config={"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, **stage3},
                **extra})
    per_step = []
    for batch in batches:
        tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
        engine.optimizer.syncs.reset()
        calls = Counter()
        with _count_host_reads(calls):
            engine.backward(lm_loss(engine(tokens), targets))
            engine.step()
        per_step.append((dict(engine.optimizer.syncs.counts), sum(calls.values())))
    norm_is_tensor = torch.is_tensor(engine.optimizer.grad_norm)
    engine.optimizer.syncs.reset()
    norm = engine.get_global_grad_norm()
    asked = dict(engine.optimizer.syncs.counts)
    engine.destroy()
    return {"per_step": per_step, "norm_is_tensor": norm_is_tensor, "norm": norm, "asked": asked}


def _skipped_first_step(rank, world, bad_first):
    """fused SGD with momentum; optionally a nan loss at the very first step (caught)."""
    batches = make_batches(2, MICRO * world)
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        config={"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}})
    if bad_first:
        tokens, targets = micro_slice(batches[0], 0, rank, world, MICRO)
        engine.backward(lm_loss(engine(tokens), targets) * float("nan"))
        with contextlib.suppress(zeroshard.NonFiniteGradientError):
            engine.step()
    state_after_skip = len(engine.optimizer.state)
    for batch in batches:
        tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return params, state_after_skip


def _all(rank, world):
    out = {}
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16", "fp16"):
            extra = {precision: {"enabled": True}} if precision != "fp32" else {}
            out[(stage, precision)] = _steps(rank, world, stage, extra)
    out["skip-first"] = (_skipped_first_step(rank, world, True),
                         _skipped_first_step(rank, world, False))
    out["non-fused"] = _steps(rank, world, 2, {},
                              lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))
    out["offload"] = _steps(rank, world, 2, {"zero_optimization": {
        "stage": 2, "reduce_bucket_size": 200, "offload_optimizer": {"device": "cpu"}}})
    return out


@pytest.fixture(scope="module")
def results():
    """Counts of every case on both ranks of a world of 2."""
    return run_world(2, _all)


@pytest.mark.parametrize("precision", ("fp32", "bf16", "fp16"))
@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_one_host_read_per_step(results, stage, precision):
    for got in results:
        case = got[(stage, precision)]
        for counted, reads in case["per_step"]:
            assert counted == {"non-finite check (after the step is queued)": 1}, counted
            assert reads == 1, (counted, reads)  # nothing else reads a tensor on the host
        assert case["norm_is_tensor"] and case["norm"] > 0
        assert case["asked"] == {"grad norm asked for": 1}


def test_non_fused_optimizer_reads_the_flag_before_stepping(results):
    for got in results:
        for counted, reads in got["non-fused"]["per_step"]:
            # torch's own non-fused (foreach) AdamW reads each `step` counter on the host: not ours.
            assert counted == {"non-finite check (non-fused optimizer)": 1}, counted


def test_cpu_offload_brings_factor_and_flag_to_the_host_once(results):
    for got in results:
        for counted, reads in got["offload"]["per_step"]:
            assert counted == {"offload: clip factor / overflow flag": 1,
                               "non-finite check (after the step is queued)": 1}, counted
            assert reads == 1  # the copy to host memory is a copy, not a read


def test_a_skipped_first_step_leaves_no_state(results):
    """The fused kernels skip an inf/nan step on the device; a first step skipped that way must
    not leave state behind (fused SGD's first momentum buffer would be uninitialised memory)."""
    for got in results:
        (skipped, state_left), (clean, _) = got["skip-first"]
        assert state_left == 0
        assert all(torch.equal(skipped[n], clean[n]) for n in clean)
