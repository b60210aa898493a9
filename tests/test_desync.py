"""The desync watchdog: a stuck or failed collective becomes a DesyncError naming every rank's
operation, on every live rank, within the timeout; in steady state it adds no collective.

One world of 2 ranks runs every case (after each desync the ranks start a fresh default group
over the same rendezvous store, since the old one is left unusable on purpose). A second world,
started alongside, has a rank that really exits before its peer's next collective. Cases: rank 0 catches an exception and calls
save_checkpoint while rank 1 is in backward (stages 2 and 3); rank 1 skips a block in one forward;
rank 1 steps without its micro-step; rank 1 is busy outside any collective; rank 1 skips a step or
a backward, caught by the step counts that ride in the next collective (stage 0's gradient
all-reduce, the norm's all-reduce at stage 1), by the watchdog (stages 2-3, whose next
collectives differ in kind) or, after the last one, by destroy_process_group(); and
the number of torch.distributed collectives per micro-step with the watchdog on and off.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zeroshard
from tests.harness import _free_port, run_world
from tests.models import TinyLM, lm_loss, make_batches, micro_slice

TIMEOUT = 3  # zeroshard_desync_timeout of the desync cases (seconds)
COLLECTIVES = ("broadcast", "all_reduce", "batch_isend_irecv", "barrier", "all_to_all_single",
               "all_gather_object", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter_tensor", "reduce_scatter_single", "send", "recv")


class SkippingLM(TinyLM):
    """TinyLM whose block2 is skipped when `skip` is set (data-dependent control flow)."""

    skip = False

    def forward(self, tokens=None, *, batch=None):
        h = self.embed(tokens)
        h = h + self.block1(h)
        if not self.skip:
            h = h + self.block2(h)
        return self.head(h)


def _engine(stage: int, timeout: float = TIMEOUT):
    torch.manual_seed(0)
    model = SkippingLM()
    zero = {"stage": stage, "zeroshard_desync_timeout": timeout}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    return engine, model


def _outcome(run) -> dict:
    """{"error": DesyncError text or None, "seconds": time until it was raised}."""
    start = time.monotonic()
    try:
        run()
    except zeroshard.DesyncError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _emergency_save(rank, world, stage, save_dir):
    engine, _ = _engine(stage)
    batches = make_batches(2, 2 * world)

    def run():
        for step, batch in enumerate(batches):
            tokens, targets = micro_slice(batch, 0, rank, world, 2)
            if step == 1 and rank == 0:
                try:
                    engine(tokens)
                    raise ValueError("a bad batch on rank 0 only")
                except ValueError:
                    engine.save_checkpoint(save_dir, tag="emergency")
                    return
            engine.backward(lm_loss(engine(tokens), targets))
            engine.step()

    return _outcome(run)


def _diverge(rank, world, kind):
    engine, model = _engine(3)
    batches = make_batches(3, 2 * world)

    def run():
        for step, batch in enumerate(batches):
            tokens, targets = micro_slice(batch, 0, rank, world, 2)
            diverge = step == 1 and rank == 1
            if kind == "skip_block":
                model.skip = diverge
            elif kind == "step_only" and diverge:
                engine.step()
                continue
            elif kind == "busy" and diverge:
                time.sleep(2 * TIMEOUT + 1)  # nothing collective; rank 0 must give up on it
                return
            engine.backward(lm_loss(engine(tokens), targets))
            engine.step()

    return _outcome(run)


def _skip_step(rank, world, stage, at=1, what="step", native=False):
    """Rank 1 skips engine.step() (or, `what="backward"`, its forward and backward) once, at
    iteration `at` of 4; `native`: the optimizer's collectives run as on NCCL (torch's own
    reduce-scatter, no point-to-point tags that would keep mismatched steps apart). Records the
    iteration the DesyncError came in, and, when none came, what destroy_process_group() says."""
    engine, _ = _engine(stage)
    if native:
        for comm in {id(c): c for c in (engine.comm, engine.optimizer.comm,
                                         engine.optimizer.policy.comm)}.values():
            comm.composed = False
    batches = make_batches(4, 2 * world)
    reached = {"step": None}

    def run():
        for step, batch in enumerate(batches):
            reached["step"] = step
            tokens, targets = micro_slice(batch, 0, rank, world, 2)
            skip = step == at and rank == 1
            if not (skip and what == "backward"):
                engine.backward(lm_loss(engine(tokens), targets))
            if not (skip and what == "step"):
                engine.step()

    out = _outcome(run)
    out["at_step"] = reached["step"]
    if out["error"] is None:  # no collective after the skip: the group's destroy tells
        try:
            dist.destroy_process_group()
            out["at_destroy"] = None
        except zeroshard.DesyncError as err:
            out["at_destroy"] = str(err)
        out["destroyed"] = not dist.is_initialized()
    return out


def _count_collectives(rank, world, stage, timeout):
    """torch.distributed calls in one micro-step (forward + backward) and in one step()."""
    engine, _ = _engine(stage, timeout)
    tokens, targets = micro_slice(make_batches(1, 2 * world)[0], 0, rank, world, 2)
    calls = {"n": 0}
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(fn):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)
        return wrapper

    import zeroshard.dist.comm as comm_module

    saved = (comm_module._ALL_GATHER, comm_module._REDUCE_SCATTER)
    for name, fn in originals.items():
        setattr(dist, name, counting(fn))
    comm_module._ALL_GATHER, comm_module._REDUCE_SCATTER = (counting(f) for f in saved)
    try:
        engine.backward(lm_loss(engine(tokens), targets))  # warm-up: records the schedule
        engine.step()
        calls["n"] = 0
        engine.backward(lm_loss(engine(tokens), targets))
        micro = calls["n"]
        calls["n"] = 0
        engine.step()
        step = calls["n"]
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        comm_module._ALL_GATHER, comm_module._REDUCE_SCATTER = saved
    return {"micro": micro, "step": step, "watched": engine.comm.watch is not None}


_STORE = {}


def _fresh_group(rank, world, name):
    """A new default group over the same store (the old one is left unusable after a desync)."""
    from zeroshard.dist.steps import PROCESS_STEPS

    # The ranks' step counts start over with the new group, as in a new job (cleared first: the
    # destroy below compares them, and this case made them differ).
    PROCESS_STEPS.clear()
    if dist.is_initialized():  # (a case may have destroyed it already)
        _STORE.setdefault("root", dist.distributed_c10d._get_default_store())
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            store=dist.PrefixStore(name, _STORE["root"]),
                            timeout=datetime.timedelta(seconds=120))


def _all(rank, world, save_dir):
    out = {}
    for stage in (2, 3):
        for timeout in (0, 300):
            out[f"count{stage}_{timeout}"] = _count_collectives(rank, world, stage, timeout)
    for stage in (2, 3):
        where = os.path.join(save_dir, str(stage))
        out[f"save{stage}"] = _emergency_save(rank, world, stage, where)
        _fresh_group(rank, world, f"save{stage}")
    for stage in (0, 1, 2, 3):
        out[f"skip_step{stage}"] = _skip_step(rank, world, stage)
        _fresh_group(rank, world, f"skip_step{stage}")
    cases = {"skip_backward0": dict(stage=0, what="backward"),
             "skip_step1_native": dict(stage=1, native=True),
             "skip_last_step0": dict(stage=0, at=3)}
    for name, case in cases.items():
        out[name] = _skip_step(rank, world, **case)
        _fresh_group(rank, world, name)
    for kind in ("skip_block", "step_only", "busy"):
        out[kind] = _diverge(rank, world, kind)
        _fresh_group(rank, world, kind)
    return out


# -- a world whose rank 1 exits ------------------------------------------------------------------

def _wait_until_ended(pid: int, limit_s: float = 60.0) -> None:
    """Return once process `pid` has exited (gone, or a zombie its parent has not reaped)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)


def _exit_entry(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), ZEROSHARD_QUIET="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    tokens, targets = micro_slice(make_batches(1, 2 * world)[0], 0, rank, world, 2)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())

    def run():
        # A long timeout: a known-dead peer must not cost the 30 s wait for its report.
        engine, _ = _engine(2, timeout=300)
        if rank == 1:
            os._exit(3)  # a crash: no exception, no report, connections closed by the kernel
        # The survivor reaches its next collective after the crash, so gloo refuses to post it
        # ("Connection closed by peer") rather than failing it in the wait: both are named.
        _wait_until_ended(pids[1])
        time.sleep(1.0)  # and gloo's I/O thread has seen its connection close
        engine.backward(lm_loss(engine(tokens), targets))

    result = _outcome(run)
    with open(os.path.join(out_dir, "rank0.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    # Then leave the ordinary way (atexit, interpreter finalization) with the failed group still
    # there: this must neither hang nor abort.


@pytest.fixture(scope="module")
def results():
    """Per-rank outcome of each case, and rank 0's outcome when its peer exits."""
    with tempfile.TemporaryDirectory() as tmp:
        exit_world = mp.start_processes(_exit_entry, args=(2, _free_port(), tmp), nprocs=2,
                                         join=False, start_method="forkserver")
        start = time.monotonic()
        out = run_world(2, _all, tmp)
        elapsed = time.monotonic() - start
        # The main world may finish first on a loaded machine: give the exit world its time.
        deadline = time.monotonic() + 180  # rank 1 exits with code 3 on purpose: no join()
        while any(p.is_alive() for p in exit_world.processes) and time.monotonic() < deadline:
            time.sleep(0.5)
        killed = [proc.is_alive() for proc in exit_world.processes]
        for proc in exit_world.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        path = os.path.join(tmp, "rank0.pkl")
        exited = pickle.load(open(path, "rb")) if os.path.exists(path) else None
        if exited is not None:
            exited["exitcode"] = exit_world.processes[0].exitcode
        # What the exit world's ranks did, for the failure message when rank 0 wrote nothing.
        how = [f"rank {r}: " + ("still running after 180 s, killed" if dead else
                                f"exit code {proc.exitcode}")
               for r, (proc, dead) in enumerate(zip(exit_world.processes, killed))]
    return out, elapsed, exited, "; ".join(how)


@pytest.mark.parametrize("stage", [2, 3])
def test_watchdog_adds_no_collective(results, stage):
    for got in results[0]:
        off, on = got[f"count{stage}_0"], got[f"count{stage}_300"]
        assert on["watched"] and not off["watched"]
        assert on["micro"] == off["micro"] > 0
        assert on["step"] == off["step"]


@pytest.mark.parametrize("stage", [2, 3])
def test_emergency_save_names_both_ranks_operations(results, stage):
    for rank, got in enumerate(results[0]):
        message = got[f"save{stage}"]["error"]
        assert message is not None, f"rank {rank} did not detect the desync at stage {stage}"
        assert "desynchronised" in message
        # Rank 0 is in save_checkpoint, rank 1 in backward (its gradients' reduce-scatter).
        zero, one = message.split("rank 0: ", 1)[1].split("; rank 1: ", 1)
        assert "in save_checkpoint" in zero and "all-gather of objects" in zero, message
        assert "reduce-scatter" in one and "in backward" in one, message
        # Detected by the watchdog, not by torch's process-group timeout (120 s here).
        assert got[f"save{stage}"]["seconds"] < 2 * TIMEOUT + 10


def test_true_waiting_time_is_reported(results):
    message = results[0][0]["save2"]["error"]
    waited = float(message.split("rank 0: waiting ", 1)[1].split("s for", 1)[0])
    # About the timeout: the peer's own timeout (started a moment earlier) can end this rank's
    # wait with a connection error a fraction of a second before its own deadline.
    assert TIMEOUT - 0.5 <= waited < TIMEOUT + 5


@pytest.mark.parametrize("kind", ["skip_block", "step_only"])
def test_diverging_paths_give_a_readable_error(results, kind):
    for rank, got in enumerate(results[0]):
        message = got[kind]["error"]
        assert message is not None, f"rank {rank} did not detect the desync"
        assert "desynchronised" in message and "rank 0: " in message and "rank 1: " in message
    if kind == "step_only":
        assert "in optimizer step" in results[0][0][kind]["error"].split("rank 1: ", 1)[1]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_skipped_step_is_a_desync_naming_the_steps(results, stage):
    for rank, got in enumerate(results[0]):
        message = got[f"skip_step{stage}"]["error"]
        assert message is not None, f"rank {rank} trained on after a skipped step at stage {stage}"
        assert "The ranks are at different steps: rank 0 after " in message, message
        assert "a rank skipped engine.step()" in message
        assert got[f"skip_step{stage}"]["seconds"] < 2 * TIMEOUT + 10


@pytest.mark.parametrize("case,counts", [
    # The counts ride in the last gradient all-reduce (stage 0) or in the norm's all-reduce
    # (stage 1, on gloo, whose point-to-point tags do not depend on the step counts, and on NCCL,
    # simulated: no tags): the step after the skip raises on both ranks.
    ("skip_step0", ("rank 0: 2 optimizer steps after 3 backward passes",
                    "rank 1: 1 optimizer steps after 3 backward passes")),
    ("skip_backward0", ("rank 0: 1 optimizer steps after 2 backward passes",
                        "rank 1: 2 optimizer steps after 1 backward passes")),
    ("skip_step1", ("rank 0: 2 optimizer steps after 2 backward passes",
                    "rank 1: 2 optimizer steps after 3 backward passes")),
    ("skip_step1_native", ("rank 0: 2 optimizer steps after 2 backward passes",
                           "rank 1: 2 optimizer steps after 3 backward passes"))])
def test_a_skipped_step_is_caught_by_the_counts_in_the_next_collective(results, case, counts):
    for rank, got in enumerate(results[0]):
        message = got[case]["error"]
        assert message is not None, f"rank {rank} trained on after a skipped step ({case})"
        assert "ranks are desynchronised" in message and "this step was not applied" in message
        assert all(text in message for text in counts), message
        # Rank 1 skipped at iteration 1: both ranks fail in iteration 1 or 2 (within one step),
        # at once, with no timeout involved.
        assert got[case]["at_step"] in (1, 2), (case, got[case]["at_step"])
        assert got[case]["seconds"] < TIMEOUT, got[case]["seconds"]


def test_a_last_step_skipped_fails_at_destroy_process_group(results):
    """Stage 0, rank 1 skips the last step: no collective follows (a stage-0 step has none; at
    stage 1 its peer's step would wait for it, and the watchdog tells), so the script's own
    destroy_process_group() compares the counts, destroys the group and raises DesyncError on
    every rank."""
    for got in results[0]:
        out = got["skip_last_step0"]
        assert out["error"] is None and out["at_step"] == 3
        message = out["at_destroy"]
        assert message is not None, "the ranks' differing step counts passed destroy"
        assert message.startswith("at destroy_process_group(): ")
        assert "rank 0: 4 optimizer steps after 4 backward passes" in message, message
        assert "rank 1: 3 optimizer steps after 4 backward passes" in message, message
        assert out["destroyed"]


def test_a_busy_peer_is_named_not_responding(results):
    message = results[0][0]["busy"]["error"]
    assert message is not None and "no collective completed within" in message
    assert "rank 1: not responding" in message
    assert "rank 0: waiting" in message


def test_a_peer_that_exits_is_named(results):
    exited = results[2]
    assert exited is not None, f"rank 0 of the exit world wrote no result ({results[3]})"
    message = exited["error"]
    assert message is not None and "rank 1: dead (its process " in message, message
    assert "on this host has ended)" in message
    # The collective failed as soon as the peer's connection closed: the true time is reported.
    waited = float(message.split("collective failed after ", 1)[1].split("s:", 1)[0])
    assert waited < TIMEOUT
    # ... and the dead peer's report was not waited for (30.1 s before; measured 0.04 s).
    assert exited["seconds"] < 10, exited["seconds"]
    assert "reported" not in message.split("rank 0: ", 1)[1].split("; rank 1: ", 1)[0]
    assert exited["exitcode"] == 0  # the rank then left normally, without hanging or aborting



class _StuckWork:
    """A work object that never completes (an NCCL kernel whose peer never arrives)."""

    def is_completed(self):
        return False

    def wait(self):
        raise RuntimeError("aborted")


def _watchdog(timeout_s: float, polled: bool):
    """A watchdog for rank 0 of two, without a process group."""
    from zeroshard.dist.steps import StepCounter
    from zeroshard.dist.watchdog import Watchdog

    return Watchdog(None, timeout_s, StepCounter(), ranks=[0, 1], rank=0, polled=polled)


def test_device_backend_poller_reports_without_blocking_the_host():
    """The NCCL path's logic on one process: the poller thread diagnoses the stuck collective
    (no rendezvous store here: the report says so), and the next call on the host raises."""
    watch = _watchdog(0.4, polled=True)
    assert watch.polled
    ticket = watch.issued("all-gather", "unit 7 (blocks.3)")
    watch.started([_StuckWork()], ticket)
    deadline = time.monotonic() + 30
    while watch.verdict is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.verdict is not None
    assert "rank 0: waiting" in watch.verdict
    assert "all-gather #1 of unit 7 (blocks.3)" in watch.verdict
    assert "rank 1: not responding" in watch.verdict and "rendezvous store" in watch.verdict
    with pytest.raises(zeroshard.DesyncError):
        watch.issued("reduce-scatter")
    with pytest.raises(zeroshard.DesyncError):
        watch.wait([_StuckWork()], ticket)


class _ClosedWork:
    """A gloo work object whose peer's connection closed while it waited."""

    def wait(self, timeout=None):
        raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer")


def test_a_closed_connection_fails_the_collective_at_posting_or_in_the_wait():
    """Both places a dead peer shows up on gloo become the DesyncError that reports it: the wait
    (the peer died while the collective was in flight) and the posting (it died before the
    survivor's next collective: gloo's isend raises "Connection closed by peer")."""
    from types import SimpleNamespace

    from zeroshard.dist.comm import Comm

    watch = _watchdog(300, polled=False)
    assert not watch.polled
    ticket = watch.issued("reduce-scatter", "unit 2 (block1)")
    start = time.monotonic()
    with pytest.raises(zeroshard.DesyncError, match="collective failed after .*Connection reset"):
        watch.wait([_ClosedWork()], ticket)
    assert time.monotonic() - start < 30  # not the 300 s timeout

    def closed():
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")

    comm = SimpleNamespace(watch=_watchdog(300, polled=False))
    ticket = comm.watch.issued("reduce-scatter", "unit 2 (block1)")
    with pytest.raises(zeroshard.DesyncError, match="reduce-scatter.*Connection closed by peer"):
        Comm._post(comm, ticket, closed)
    with pytest.raises(RuntimeError, match="Connection closed") as raw:  # no watchdog: as is
        Comm._post(SimpleNamespace(watch=None), None, closed)
    assert not isinstance(raw.value, zeroshard.DesyncError)
