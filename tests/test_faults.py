"""Faults that must never pass silently or half-way (issue 29).

Saves: a failure writing any one file on one rank (DCP data, RNG, client state, zeroshard.json,
`latest`; injected ENOSPC, and a really full tmpfs) is one CheckpointError on every rank naming
the rank, the file and the full disk; nothing of the failed save is left and `latest` still names
the previous checkpoint. Leftovers of dead saves are cleared. Two jobs on one directory: the
second is refused with a clear error and the first goes on. A SIGKILLed `zeroshard run` leaves no
worker behind.

One world of 2 ranks runs the save cases; the two-job and launcher cases are subprocesses.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

import zeroshard
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.directory import release_directory
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice

#: (rank that fails, the file it fails on) for the injected cases; "data": DCP's write.
INJECTED = [(1, "data"), (1, "rng-rank1.pt"), (0, "client_state.pt"), (0, "zeroshard.json"),
            (0, "latest")]


def _engine():
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    return engine


def _listing(root: str) -> list[str]:
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def _enospc(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _inject(rank, fails_rank, what):
    """Make this rank's write of `what` raise ENOSPC; returns an undo function."""
    import torch.distributed.checkpoint.filesystem as fs
    from zeroshard.checkpoint import save as saving

    if rank != fails_rank:
        return lambda: None
    if what == "data":
        original = fs.FileSystemWriter.write_data

        def write_data(self, plan, planner):
            raise _enospc(os.path.join(str(self.path), f"__{rank}_0.distcp"))

        fs.FileSystemWriter.write_data = write_data
        return lambda: setattr(fs.FileSystemWriter, "write_data", original)
    original_write = saving.write_file

    def write_file(path, data):
        if os.path.basename(path) == what or (what == "latest" and ".latest." in path):
            raise _enospc(path)
        return original_write(path, data)

    saving.write_file = write_file
    return lambda: setattr(saving, "write_file", original_write)


def _attempt(engine, root, tag):
    try:
        engine.save_checkpoint(root, tag=tag)
        return None
    except CheckpointError as err:
        return str(err)


class _Net(torch.nn.Module):
    """Two Linear layers; rank-dependent variants for the agreement cases."""

    def __init__(self, first=(6, 4), extra=False, dtype=torch.float32):
        super().__init__()
        self.a = torch.nn.Linear(*first, dtype=dtype)
        self.b = torch.nn.Linear(first[1] if first[1] != 6 else 4, 3)
        if extra:
            self.c = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.b(self.a(x))


#: case -> what rank 1 builds differently (rank 0 builds _Net() with the base config).
DISAGREE = {"transposed": {"first": (4, 6)}, "extra_layer": {"extra": True},
            "dtype": {"dtype": torch.float64}, "config": {}, "same": {}}


def _agreement(rank):
    from zeroshard.core.agreement import RankMismatchError

    out = {}
    for case, change in DISAGREE.items():
        model = _Net(**(change if rank == 1 else {}))
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": 1}}
        if case == "config" and rank == 1:
            config["gradient_clipping"] = 0.5
        try:
            engine, _, _, _ = zeroshard.initialize(
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
            engine.destroy()
            out[case] = None
        except RankMismatchError as err:
            out[case] = str(err)
    return out


def _saves(rank, world, tmp):
    out = {"agreement": _agreement(rank)}
    engine = _engine()
    tokens, targets = micro_slice(make_batches(1, 2 * world)[0], 0, rank, world, 2)
    engine.backward(lm_loss(engine(tokens), targets))
    engine.step()
    root = os.path.join(tmp, "injected")
    # Leftovers of saves that died before (a legacy name, another host's, a dead local pid):
    # under the directory's lock they are all removed by the next save.
    if rank == 0:
        for name in (".global_step7.partial", ".global_step9.otherhost.4242.partial",
                     ".latest.otherhost.4242.tmp"):
            os.makedirs(root, exist_ok=True)
            path = os.path.join(root, name)
            os.makedirs(path) if name.endswith(".partial") else open(path, "w").close()
            if name.endswith(".partial"):
                with open(os.path.join(path, "__0_0.distcp"), "wb") as fh:
                    fh.write(b"x" * 1000)
    engine.comm.barrier()
    for empty in (None, ""):  # DeepSpeed's ValueError, and nothing written in the working dir
        listing = sorted(os.listdir("."))
        try:
            engine.save_checkpoint(empty)
            out[f"empty_{empty!r}"] = None
        except ValueError as err:
            out[f"empty_{empty!r}"] = str(err)
        out[f"empty_{empty!r}_wrote"] = sorted(set(os.listdir(".")) - set(listing))
    out["good"] = _attempt(engine, root, "good")
    out["after_good"] = _listing(root)
    engine.comm.barrier()  # every rank has looked before the next save starts
    # A client_state that cannot be stored, on rank 1 only: an error on both ranks, and rank 0's
    # partial directory (made before the ranks compared notes) is gone.
    try:
        engine.save_checkpoint(root, tag="bad_client",
                               client_state={"hook": (lambda: 0) if rank == 1 else 0})
        out["bad_client"] = None
    except ValueError as err:
        out["bad_client"] = str(err)
    engine.comm.barrier()  # rank 0 has cleaned up
    out["bad_client_listing"] = _listing(root)
    engine.comm.barrier()
    for i, (fails_rank, what) in enumerate(INJECTED):
        undo = _inject(rank, fails_rank, what)
        try:
            out[f"inject_{i}"] = _attempt(engine, root, f"bad{i}")
        finally:
            undo()
        engine.comm.barrier()
        out[f"inject_{i}_listing"] = _listing(root)
        out[f"inject_{i}_latest"] = open(os.path.join(root, "latest")).read()
        engine.comm.barrier()
    # The same tag as the existing checkpoint, failing at zeroshard.json: the old one stays whole.
    undo = _inject(rank, 0, "zeroshard.json")
    try:
        out["same_tag"] = _attempt(engine, root, "good")
    finally:
        undo()
    out["same_tag_loads"] = engine.load_checkpoint(root)[0]
    # The name `latest` is written through: this writer's own temporary file.
    replaced = []
    original_replace = os.replace

    def recording_replace(src, dst):
        replaced.append((os.path.basename(src), os.path.basename(dst)))
        return original_replace(src, dst)

    os.replace = recording_replace
    try:
        engine.save_checkpoint(root, tag="named")
    finally:
        os.replace = original_replace
    out["replaced"] = replaced
    # A read that fails during DCP's load (after the checks passed) on one rank: our error, on
    # every rank, not torch's CheckpointException (a BaseException).
    from zeroshard.checkpoint.verify import SafeReader

    original_read = SafeReader.read_data

    def failing_read(self, plan, planner):
        raise OSError(errno.EIO, os.strerror(errno.EIO), os.path.join(root, "named", "x.distcp"))

    if rank == 1:
        SafeReader.read_data = failing_read
    try:
        engine.load_checkpoint(root)
        out["load_failure"] = None
    except CheckpointError as err:
        out["load_failure"] = str(err)
    finally:
        SafeReader.read_data = original_read
    out["writer"] = (__import__("socket").gethostname().split(".")[0], os.getpid())
    out["full"] = _full_disk(engine, rank, tmp)
    engine.destroy()
    return out


def _full_disk(engine, rank, tmp):
    """A real tmpfs with room for one checkpoint and not two (skipped unless mount works)."""
    root = os.path.join(tmp, "tmpfs")
    mounted = None
    if rank == 0:
        os.makedirs(root)
        probe = os.path.join(tmp, "probe")
        engine.save_checkpoint(probe, tag="probe")
        used = sum(-(-os.path.getsize(os.path.join(d, f)) // 4096) * 4096
                   for d, _, fs in os.walk(probe) for f in fs)
        size = used + used // 2
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", root],
                              capture_output=True, text=True)
        mounted = done.returncode == 0
    else:
        engine.save_checkpoint(os.path.join(tmp, "probe"), tag="probe")
    mounted = engine.comm.all_gather_object(mounted)[0]
    if not mounted:
        return None
    try:
        first = _attempt(engine, root, "first")
        free_before = os.statvfs(root).f_bavail
        second = _attempt(engine, root, "second")
        engine.comm.barrier()
        result = {"first": first, "second": second, "listing": _listing(root),
                  "latest": open(os.path.join(root, "latest")).read(),
                  "free_restored": os.statvfs(root).f_bavail == free_before}
        engine.comm.barrier()
        return result
    finally:
        engine.comm.barrier()
        if rank == 0:
            assert release_directory(root)  # the lock's descriptor keeps the mount busy
            if subprocess.run(["umount", root]).returncode != 0:
                subprocess.run(["umount", "-l", root], check=False)


@pytest.fixture(scope="module")
def saves():
    with tempfile.TemporaryDirectory() as tmp:
        return run_world(2, _saves, tmp)


@pytest.mark.parametrize("case,expected", [
    ("transposed", ["parameter a.weight", "rank 0: parameter a.weight shape (4, 6) float32",
                    "rank 1: parameter a.weight shape (6, 4) float32"]),
    ("extra_layer", ["parameter c.weight", "rank 0: nothing", "6 parameters and buffers"]),
    ("dtype", ["rank 0: parameter a.weight shape (4, 6) float32",
               "rank 1: parameter a.weight shape (4, 6) float64"]),
    ("config", ["different configs", "gradient_clipping = rank 0: 1.0; rank 1: 0.5"])])
def test_ranks_that_built_different_models_are_refused(saves, case, expected):
    messages = [got["agreement"][case] for got in saves]
    assert messages[0] is not None and messages[0] == messages[1], messages
    for part in expected:
        assert part in messages[0], messages[0]
    assert saves[0]["agreement"]["same"] is None


class _Views:
    """A comm whose all-gather hands back views made up for the test (one process)."""

    rank, world_size = 0, 2

    def __init__(self, counts):
        self.counts = counts

    def all_gather_object(self, mine):
        return [(*mine[:6], count) for count in self.counts]


def test_a_save_from_ranks_at_different_steps_is_refused():
    """What NCCL sees (no tags there): the save's first exchange compares the step counts."""
    from zeroshard.checkpoint.save import _agree_on_target

    with pytest.raises(CheckpointError, match=r"rank 0: 8 optimizer steps after 8 backward "
                       r"passes; rank 1: 7 optimizer steps after 8 backward passes\).*nothing "
                       r"was written"):
        _agree_on_target(_Views([(8, 8), (7, 8)]), "ckpt", "tag", None)
    assert _agree_on_target(_Views([(8, 8), (8, 8)]), "ckpt", "tag", None)


def test_an_empty_save_dir_is_refused_and_nothing_is_written(saves):
    for got in saves:
        for empty in (None, ""):
            message = got[f"empty_{empty!r}"]
            assert message is not None and f"save_dir is {empty!r}" in message, message
            assert got[f"empty_{empty!r}_wrote"] == []


def test_leftovers_of_dead_saves_are_removed(saves):
    for got in saves:
        assert got["good"] is None
        assert got["after_good"] == ["good", "latest", "zero_to_fp32.py"]


def test_a_client_state_one_rank_cannot_store_fails_every_rank_and_leaves_nothing(saves):
    for got in saves:
        assert got["bad_client"] is not None and "rank 1: client_state can only hold" in \
            got["bad_client"], got["bad_client"]
        assert got["bad_client_listing"] == ["good", "latest", "zero_to_fp32.py"]


@pytest.mark.parametrize("case", range(len(INJECTED)))
def test_a_failed_write_on_one_rank_fails_the_save_everywhere(saves, case):
    fails_rank, what = INJECTED[case]
    for rank, got in enumerate(saves):
        message = got[f"inject_{case}"]
        assert message is not None, f"rank {rank} saw no error when rank {fails_rank} failed"
        assert f"rank {fails_rank}: could not write" in message, message
        named = f"__{fails_rank}_0.distcp" if what == "data" else \
            ".latest." if what == "latest" else what
        assert named in message, message
        assert "No space left on device" in message and "disk full" in message, message
        assert "unexpected pos" not in message and "CheckpointException" not in message
        assert "'latest' still names the previous checkpoint" in message
        # Nothing of the failed save is left; `latest` still names the good one.
        assert got[f"inject_{case}_listing"] == ["good", "latest", "zero_to_fp32.py"], \
            got[f"inject_{case}_listing"]
        assert got[f"inject_{case}_latest"] == "good"


def test_a_failed_save_of_an_existing_tag_keeps_the_old_one(saves):
    for got in saves:
        assert "zeroshard.json" in got["same_tag"]
        assert got["same_tag_loads"].endswith(os.sep + "good")


def test_a_failed_read_during_load_is_our_error_on_every_rank(saves):
    for got in saves:
        message = got["load_failure"]
        assert message is not None and message.startswith("could not load "), message
        assert "x.distcp: Input/output error" in message, message
        assert "CheckpointException" not in message


def test_latest_is_written_through_a_temporary_name_of_this_writer(saves):
    host, pid = saves[0]["writer"]
    assert saves[0]["replaced"] == [(f".latest.{host}.{pid}.tmp", "latest")]
    assert saves[1]["replaced"] == []  # only rank 0 writes it


def test_a_full_disk_fails_the_save_everywhere_and_frees_its_space(saves):
    full = saves[0]["full"]
    if full is None:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    for got in saves:
        full = got["full"]
        assert full["first"] is None
        message = full["second"]
        assert message is not None and "No space left on device" in message, message
        assert "disk full" in message and "bytes free there" in message, message
        assert "CheckpointException" not in message and "unexpected pos" not in message
        assert full["listing"] == ["first", "latest", "zero_to_fp32.py"]
        assert full["latest"] == "first"
        assert full["free_restored"]


# -- the launcher dies: no orphan ----------------------------------------------------------------

LOOPING = textwrap.dedent("""
    import os, sys, time
    out = sys.argv[1]
    with open(os.path.join(out, f"worker{os.environ['LOCAL_RANK']}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    while True:  # a training loop that would go on saving
        time.sleep(0.05)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_workers_die_when_the_launcher_is_killed(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOPING)
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    proc = subprocess.Popen([sys.executable, "-m", "zeroshard.cli", "run", "--nproc-per-node", "2",
                             str(script), str(tmp_path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = [int(p.read_text()) for p in tmp_path.glob("worker*.pid") if p.read_text()]
        assert len(pids) == 2, "the workers did not start"
        assert all(_alive(pid) for pid in pids)
        proc.kill()  # SIGKILL: no handler runs, nothing is forwarded
        proc.wait(10)
        killed = time.monotonic()
        while any(_alive(pid) for pid in pids) and time.monotonic() < killed + 5:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), \
            f"workers {[p for p in pids if _alive(p)]} outlived the launcher by 5 s"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- two jobs, one directory ----------------------------------------------------------------------

FIRST_JOB = textwrap.dedent("""
    import os, sys, torch, zeroshard
    from tests.models import make_model
    root, out = sys.argv[1], sys.argv[2]
    model = make_model()
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1), config=config)
    engine.save_checkpoint(root, tag="shared")
    open(os.path.join(out, "saved"), "w").close()
    sys.stdin.readline()  # the other job tries now
    engine.save_checkpoint(root, tag="shared")  # the same tag again: this job goes on
    engine.save_checkpoint(root, tag="mine")
    print("first job done", flush=True)
""")


def _second_job(rank, world, root):
    engine = _engine()
    try:
        engine.save_checkpoint(root, tag="shared")
        return None
    except CheckpointError as err:
        return str(err)
    finally:
        engine.destroy()


def test_a_second_job_on_the_same_directory_is_refused_and_the_first_goes_on(tmp_path):
    root = str(tmp_path / "ckpt")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    first = subprocess.Popen([sys.executable, "-c", FIRST_JOB, root, str(tmp_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=os.getcwd(), env=dict(env, ZEROSHARD_QUIET="1"))
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "saved").exists() and first.poll() is None and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "saved").exists(), first.communicate(timeout=30)[1][-2000:]
        messages = run_world(1, _second_job, root)  # the lock is rank 0's: one rank shows it
        out, err = first.communicate("go\n", timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    for message in messages:
        assert message is not None and "belongs to another job" in message, message
        assert f"process {first.pid} " in message and "-c" in message, message
        assert "give this job another save_dir" in message
    assert first.returncode == 0 and "first job done" in out, err[-2000:]
    assert open(os.path.join(root, "latest")).read() == "mine"
    assert sorted(os.listdir(root)) == ["latest", "mine", "shared", "zero_to_fp32.py"]
    # The first job has ended: its lock went with it, and the directory is free for another.
    assert run_world(1, _second_job, root) == [None]
