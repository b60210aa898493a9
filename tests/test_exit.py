"""A training script that just ends leaves cleanly: zeroshard destroys the process groups (joining
gloo's worker threads) at exit, before Python finalizes, so no worker thread can abort the process
while the interpreter shuts down; after an uncaught exception it leaves them alone and the rank dies
at once. `bench/exit_loop.py` repeats two-rank launches to show the abort is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# The probe is registered first, so it runs last among the exit hooks (they run in reverse).
SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch.distributed as dist

    def probe():
        threads = len(os.listdir("/proc/self/task"))
        print(f"at exit: initialized={dist.is_initialized()} threads={threads}", flush=True)

    atexit.register(probe)
    import torch
    import zeroshard

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    if sys.argv[1] == "raise":
        raise RuntimeError("the user's script failed")
""")


def _run(tmp_path, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, str(script), how], capture_output=True, text=True,
                          timeout=120, env=dict(env, ZEROSHARD_QUIET="1", OMP_NUM_THREADS="1"))


def test_a_script_that_just_ends_destroys_the_groups_before_python_finalizes(tmp_path):
    res = _run(tmp_path, "end")
    assert res.returncode == 0, res.stderr[-2000:]
    # Every process group (the default one and the stage-3 side group) is gone and its threads
    # joined: only the main thread is left when the interpreter starts finalizing.
    assert "at exit: initialized=False threads=1" in res.stdout, res.stdout


@pytest.mark.parametrize("how", ["raise"])
def test_an_uncaught_exception_leaves_the_groups_alone(tmp_path, how):
    res = _run(tmp_path, how)
    assert res.returncode == 1 and "the user's script failed" in res.stderr
    assert "at exit: initialized=True" in res.stdout, res.stdout


PREEMPTED = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]

    def saved(signum, frame):
        open(os.path.join(out, "saved"), "w").close()  # a checkpoint would be written here
        sys.exit(0)

    signal.signal(signal.SIGTERM, saved)
    open(os.path.join(out, "ready"), "w").close()
    time.sleep(120)
""")


UNHANDLED = textwrap.dedent("""
    import os, sys, time
    open(os.path.join(sys.argv[1], "ready"), "w").close()
    time.sleep(120)
""")


def _preempt(tmp_path, source: str):
    """Run `source` under `zeroshard run`, SIGTERM the launcher once it is ready: (code, stderr)."""
    import signal
    import time

    script = tmp_path / "preempted.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    proc = subprocess.Popen([sys.executable, "-m", "zeroshard.cli", "run", "--nproc-per-node", "1",
                             str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_sigterm_to_the_launcher_exits_0_when_every_worker_saved_and_exited_0(tmp_path):
    """A scheduler's SIGTERM reaches the workers (which save and exit 0): the launcher exits 0 with
    one line, not 1 with a traceback."""
    code, err = _preempt(tmp_path, PREEMPTED)
    assert code == 0, err[-2000:]
    assert "stopped by SIGTERM" in err and "exited 0" in err and "Traceback" not in err
    assert (tmp_path / "saved").exists()


def test_sigterm_to_the_launcher_exits_143_when_a_worker_was_stopped_by_it(tmp_path):
    """A worker without a handler dies of the SIGTERM: the launcher exits 143 (as a process stopped
    by SIGTERM), so preemption is told apart from a crash (1)."""
    code, err = _preempt(tmp_path, UNHANDLED)
    assert code == 143, err[-2000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err


def test_the_preemption_example_saves_at_one_step_exits_0_and_resumes(tmp_path):
    """examples/train_preemptible.py at 2 ranks: SIGTERM to the launcher -> every rank saves the
    same step, the launcher exits 0; started again, it resumes from that step."""
    import re
    import signal
    import time

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "train_preemptible.py")
    ckpt, ready = tmp_path / "ckpt", tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"),
               ZEROSHARD_QUIET="1")
    base = [sys.executable, "-m", "zeroshard.cli", "run", "--nproc-per-node", "2", example,
            "--ckpt", str(ckpt)]
    proc = subprocess.Popen(base + ["--ready", str(ready)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    saved = int(re.search(r"preempted: saved step (\d+)", out).group(1))
    again = subprocess.run(base + ["--steps", str(saved + 2)], capture_output=True, text=True,
                           timeout=120, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed at step {saved}" in again.stdout, again.stdout


# One rank skips engine.step() once; the script ends as many do, with destroy_process_group(),
# called through torch.distributed or through a name bound before zeroshard was imported.
SKIPPER = textwrap.dedent("""
    import hashlib, sys
    import torch, torch.distributed as dist
    from torch.distributed import destroy_process_group
    import zeroshard

    stage, skip_at, bound = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "bound"
    zeroshard.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "zeroshard_desync_timeout": 5}}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    data = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(rank))
    for step in range(4):
        engine.backward(engine(data[step]).square().mean())
        if not (rank == 1 and step == skip_at):
            engine.step()
        print(f"rank {rank} finished step {step}", flush=True)
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    print(f"rank {rank} digest {hashlib.sha256(weights).hexdigest()[:12]}", flush=True)
    (destroy_process_group if bound else dist.destroy_process_group)()
""")


@pytest.mark.parametrize("stage,skip_at,name", [(0, 1, "dist"), (1, 1, "dist"), (0, 3, "dist"),
                                                (0, 3, "bound")])
def test_a_skipped_step_fails_the_job_even_when_the_script_destroys_the_group(tmp_path, stage,
                                                                              skip_at, name):
    """Two ranks under `zeroshard run`, rank 1 skips engine.step() at iteration `skip_at`, the
    script ends with destroy_process_group() (`name`: torch.distributed's, or the name the script
    bound before importing zeroshard): the job fails with DesyncError. Mid-run the step after the
    skip raises, from the counts in the gradient all-reduce (stage 0) or in the norm's all-reduce
    (stage 1 on gloo too: its reduce-scatter's tags do not depend on the counts, so the exchanges
    pair up and the counts meet; not the watchdog's timeout); after the last step,
    destroy_process_group() under either name."""
    script = tmp_path / "skipper.py"
    script.write_text(SKIPPER)
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"),
               ZEROSHARD_QUIET="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "zeroshard.cli", "run", "--nproc-per-node", "2",
                          str(script), str(stage), str(skip_at), name], capture_output=True,
                         text=True, timeout=300, env=env)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert "DesyncError" in out, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} finished step 0" in out, out[-3000:]
    if skip_at == 3:  # the replicas differ, as the digests show, and destroy says so
        digests = {line.split()[-1] for line in out.splitlines() if " digest " in line}
        assert len(digests) == 2, out[-3000:]
        assert "at destroy_process_group()" in out, out[-3000:]
        assert "rank 1: 3 optimizer steps after 4 backward passes" in out, out[-3000:]
    else:  # within one step of the skip, on both ranks, by the counts (no watchdog timeout)
        assert "finished step 2" not in out and " digest " not in out, out[-3000:]
        assert "this step was not applied" in out, out[-3000:]
        assert "no collective completed within" not in out, out[-3000:]
    if stage == 1:
        assert "rank 0: 2 optimizer steps after 2 backward passes" in out, out[-3000:]
        assert "rank 1: 2 optimizer steps after 3 backward passes" in out, out[-3000:]


def test_deepspeed_timeout_bounds_the_group_s_collectives(monkeypatch):
    """DEEPSPEED_TIMEOUT (minutes) reaches init_process_group when the caller names no timeout,
    as in DeepSpeed, so a rank waiting on a failed peer gives up; a bad value names the variable.
    In-process: torch's init_process_group is replaced by a recorder."""
    import datetime

    import torch.distributed as dist

    from zeroshard.dist import process_group

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(process_group, "leave_cleanly_at_exit", lambda: None)
    monkeypatch.setattr(process_group, "_load_dynamo_first", lambda: None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0" if name != "WORLD_SIZE" else "1")
    explicit = {"init_method": "file:///nonexistent", "rank": 0, "world_size": 1,
                "backend": "gloo"}
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "3")
    process_group.init_distributed(**explicit)
    process_group.init_distributed(timeout=datetime.timedelta(seconds=7), **explicit)
    monkeypatch.delenv("DEEPSPEED_TIMEOUT")
    process_group.init_distributed(**explicit)
    assert [c.get("timeout") for c in calls] == [datetime.timedelta(minutes=3),
                                                 datetime.timedelta(seconds=7), None]
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="DEEPSPEED_TIMEOUT='ten': expected a whole number"):
        process_group.init_distributed(**explicit)
