"""Starting and ending the default process group: torchrun's or Slurm's environment (or a world of
one) in, groups destroyed cleanly at interpreter exit.

Ending it also compares the ranks' step counts (`steps_agree`): a rank that skipped
`engine.step()` or `engine.backward()` late in a run, after its last collective, leaves replicas
that differ, which no collective can tell any more. The comparison runs in the exit handler and,
because many scripts end with `dist.destroy_process_group()` themselves (accelerate's
`end_training()`, torchtitan), also inside that call: `leave_cleanly_at_exit` hooks torch's
`destroy_process_group` (the function object, so whatever name a script bound it to) so that
destroying the default group first compares the counts and then raises `DesyncError` on every
rank when they differ (the group is destroyed either way). The counts are the process's
`steps.PROCESS_STEPS`.

`zeroshard.comm` (compat/deepspeed/comm.py) re-exports `init_distributed` and
`leave_cleanly_at_exit`, the names users and `deepspeed.comm` scripts call.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import time
import types

import torch
import torch.distributed as dist

from .steps import PROCESS_STEPS, DesyncError, describe_step_counts


#: Longest wait at exit for the peers' counts (a peer that does not come has failed: no verdict).
EXIT_WAIT_S = 10.0
#: A copy of torch's `destroy_process_group` as it was before `_hook_destroy` changed its code.
_TORCH_DESTROY = None
#: Comparisons of the step counts made so far in this process (each gets its own store keys).
_EXIT_CHECKS = 0
#: Called (no arguments) once the default group is destroyed (`world.py` forgets its World).
_ON_DESTROY: list = []


def on_default_group_destroyed(callback) -> None:
    """Call `callback()` each time the default group is destroyed (by any name, or at exit)."""
    if callback not in _ON_DESTROY:
        _ON_DESTROY.append(callback)


def _destroyed() -> None:
    for callback in _ON_DESTROY:
        callback()


def step_counts() -> tuple[int, int]:
    """(optimizer steps, backward passes) this process has run through its engines."""
    return PROCESS_STEPS.counts()


#: A folder from `zeroshard run`: initialize() leaves a file there, so that a job handed a DeepSpeed
#: config whose workers never built an engine fails instead of ending as if it had trained.
ENGAGED_DIR = "ZEROSHARD_ENGAGED_DIR"


def mark_engaged() -> None:
    """Tell the launcher (if any) that this worker built a ZeRO engine."""
    folder = os.environ.get(ENGAGED_DIR)
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}"), "w"):
            pass


def env_int(*names: str) -> int | None:
    """The first of these environment variables that is set and not empty, as an int."""
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


#: DeepSpeed's variable for its process group's timeout, in whole minutes.
TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"


def env_timeout() -> datetime.timedelta | None:
    """The collectives' timeout that DEEPSPEED_TIMEOUT asks for (whole minutes, as DeepSpeed reads
    it), or None when it is unset (torch's default then applies)."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return None
    try:
        minutes = int(value)
    except ValueError:
        minutes = 0
    if minutes < 1:
        raise ValueError(f"{TIMEOUT_ENV}={value!r}: expected a whole number of minutes >= 1 for "
                         "the process group's timeout (e.g. 10, DeepSpeed's default); fix or unset it")
    return datetime.timedelta(minutes=minutes)


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None,
                     dist_backend: str | None = None, distributed_port: int | None = None,
                     verbose: bool = True, init_method: str | None = None, rank: int = -1,
                     world_size: int = -1, **_ignored) -> None:
    """Start the default process group from torchrun's (or Slurm's) environment; no-op if started.

    DeepSpeed's spellings are accepted: `dist_backend` for `backend`, `distributed_port` for the
    rendezvous port when the environment gives none, and an explicit `init_method` (a `file://`
    or `tcp://` rendezvous) with `rank` and `world_size`, which then win over the environment;
    `verbose` and other keywords are ignored. Without `timeout`, DEEPSPEED_TIMEOUT (minutes) sets
    the collectives' timeout, as in DeepSpeed: a rank left waiting on a failed peer then gives up.
    """
    if dist.is_available() and dist.is_initialized():
        return
    timeout = timeout if timeout is not None else env_timeout()
    backend = backend or dist_backend
    if init_method is not None:
        if rank < 0 or world_size < 1:
            raise ValueError(f"init_distributed: init_method={init_method!r} needs rank and "
                             f"world_size as well (got rank={rank}, world_size={world_size})")
        _init_explicit(backend, init_method, rank, world_size, timeout)
        return
    if distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    rank = rank if rank >= 0 else env_int("RANK", "SLURM_PROCID")
    world = world_size if world_size > 0 else env_int("WORLD_SIZE", "SLURM_NTASKS")
    local_rank = env_int("LOCAL_RANK", "SLURM_LOCALID")
    if rank is None or world is None:
        # A plain `python train.py` is a world of one: give it a private rendezvous.
        rank, world, local_rank = 0, 1, 0
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    else:
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = _slurm_master() or "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(local_rank or 0))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank or 0)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if (restart is not None and "MASTER_PORT" in os.environ
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("GROUP_WORLD_SIZE", "1") == "1"):
        # Under torchrun's elastic agent the agent's store outlives a restart, and measured
        # restarts intermittently read the previous attempt's gloo addresses from it
        # ("connectFullMesh failed ... Connection refused"): key this attempt's rendezvous by the
        # restart count. Only with one agent: each agent counts its own restarts, so across nodes
        # the counts differ (a replaced node's agent starts at 0) and would split the ranks.
        # There `zeroshard run` turns the shared store off (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
        # and each attempt's rank 0 holds a fresh store: nothing stale to read.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout or datetime.timedelta(minutes=30))
        kwargs["store"] = dist.PrefixStore(f"zeroshard/attempt_{restart}", store)
    _load_dynamo_first()
    dist.init_process_group(backend=backend, rank=rank, world_size=world, **kwargs)
    leave_cleanly_at_exit()


def _load_dynamo_first() -> None:
    """Import torch._dynamo before the default group exists. zeroshard's stage hooks load it at
    their first call (`import zeroshard` stays light), but in torch 2.13 importing it (its
    torch._inductor part) after a gloo group exists keeps that group's worker and store threads
    alive past `destroy_process_group()`, which undoes `leave_cleanly_at_exit` (measured: 5
    threads left at exit instead of 1, tests/test_exit.py). Imported here, the ~1.3 s is paid at
    the group's start, where it is lost in the rendezvous."""
    import torch._dynamo  # noqa: F401


def _init_explicit(backend, init_method: str, rank: int, world_size: int, timeout) -> None:
    """The default group from a rendezvous the caller names (DeepSpeed's test harness passes a
    file store): RANK / WORLD_SIZE in the environment are set to match, for code that reads them."""
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    local_rank = env_int("LOCAL_RANK", "SLURM_LOCALID") or 0
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    _load_dynamo_first()
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                            world_size=world_size, **kwargs)
    leave_cleanly_at_exit()


def leave_cleanly_at_exit() -> None:
    """Have the process groups destroyed at interpreter exit, before Python finalizes (idempotent).

    A gloo worker thread that finishes a collective after the interpreter began finalizing drops
    the last reference to the collective's tensors, needs the GIL to free them, and aborts the
    whole process ("terminate called without an active exception"; seen once in about 35 two-rank
    launches): a completed run then reports failure. Destroying the groups at exit joins those
    threads while Python is still whole. After an uncaught exception nothing is done, so a
    failing rank still leaves at once instead of waiting on its peers.
    """
    atexit.unregister(_destroy_at_exit)
    atexit.register(_destroy_at_exit)
    _hook_destroy()


def _call_zeroshard_destroy(group=None):
    """The code torch's `destroy_process_group` runs once hooked: zeroshard's checked destroy,
    looked up in torch's module, where `_hook_destroy` put it."""
    return _zeroshard_checked_destroy(group)  # noqa: F821 - a global of torch's distributed_c10d


def _hook_destroy() -> None:
    """Make torch's `destroy_process_group` compare the step counts before the default group goes
    (idempotent).

    The function object itself is changed (its code now calls `_checked_destroy`), not the names
    bound to it: a script that ran `from torch.distributed import destroy_process_group` before
    zeroshard was imported holds that same object, and its call is checked too. Where torch's
    function cannot take new code (a closure), its public names are rebound instead."""
    global _TORCH_DESTROY
    if _TORCH_DESTROY is not None or not dist.is_available():
        return
    torch_fn = dist.distributed_c10d.destroy_process_group
    _TORCH_DESTROY = types.FunctionType(torch_fn.__code__, torch_fn.__globals__, torch_fn.__name__,
                                        torch_fn.__defaults__, torch_fn.__closure__)
    _TORCH_DESTROY.__kwdefaults__ = torch_fn.__kwdefaults__
    if torch_fn.__closure__ is None:
        torch_fn.__globals__["_zeroshard_checked_destroy"] = _checked_destroy
        torch_fn.__code__ = _call_zeroshard_destroy.__code__
    else:
        dist.destroy_process_group = dist.distributed_c10d.destroy_process_group = _checked_destroy


def _checked_destroy(group=None):
    """torch's destroy_process_group; for the default group, first the step-count check
    (DesyncError on every rank, after the group is destroyed, when the counts differ)."""
    problem = None
    default = group is None or group is dist.GroupMember.WORLD
    if default and dist.is_initialized() and getattr(sys, "last_value", None) is None:
        problem = steps_agree()
    _TORCH_DESTROY(group)
    if default:
        _destroyed()
        _await_store_thread()  # as at exit: the script may end right after this call
    if problem is not None:
        raise DesyncError(f"at destroy_process_group(): {problem}")


def _destroy_at_exit() -> None:
    if getattr(sys, "last_value", None) is not None:  # set by an uncaught exception
        return
    if dist.is_available() and dist.is_initialized():
        problem = steps_agree()
        (_TORCH_DESTROY or dist.destroy_process_group)()  # the counts are compared already
        _destroyed()
        _await_store_thread()
        if problem is not None:
            # Exiting 0 would report a run whose replicas differ as a success.
            print(f"zeroshard: {problem}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)


def steps_agree(timeout_s: float = EXIT_WAIT_S) -> str | None:
    """At a clean exit: every rank posts its step counts in the rendezvous store and reads the
    others'; the text of a disagreement (naming ranks and counts), or None (agreement, one rank,
    or a peer that did not come within `timeout_s`, which has failed and says so itself)."""
    world = dist.get_world_size()
    if world == 1:
        return None
    # Each comparison in this process gets its own keys (a script may destroy the group, start a
    # new one over the same store and compare again); every rank counts them alike.
    global _EXIT_CHECKS
    _EXIT_CHECKS += 1
    try:
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        prefix = (f"zeroshard_exit/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                  f"{_EXIT_CHECKS}/")
        store.set(f"{prefix}{rank}", json.dumps(step_counts()))
        keys = [f"{prefix}{r}" for r in range(world)]
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        counts = [tuple(json.loads(store.get(k))) for k in keys]
        store.set(f"{prefix}read/{rank}", "1")
        if rank == 0:  # rank 0 serves the store: stay until every peer has read
            store.wait([f"{prefix}read/{r}" for r in range(world)],
                       datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a peer gone, or no store: nothing to compare
        return None
    if len(set(counts)) == 1:
        return None
    return describe_step_counts(counts)


#: Name of the thread that serves torch's TCPStore (rank 0's rendezvous store).
_STORE_THREAD = "pt_tcpstore_uv"


def _await_store_thread(timeout_s: float = 2.0) -> None:
    """Wait (at most `timeout_s`) for the TCPStore server's thread to end: freeing the store
    stops its event loop, but the thread exits a moment later, and in about one exit in four it
    was still running when the interpreter began finalizing. Linux only (/proc); elsewhere a
    no-op."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return

    def alive() -> bool:
        for task in os.listdir(tasks):
            try:
                with open(f"{tasks}/{task}/comm") as fh:
                    if fh.read().strip() == _STORE_THREAD:
                        return True
            except OSError:  # the thread ended while we looked
                continue
        return False

    deadline = time.monotonic() + timeout_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.002)


def _slurm_master() -> str | None:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes:
        return None
    # "node[01-04],other" -> "node01"; good enough for the common contiguous case.
    first = nodes.split(",")[0]
    if "[" in first:
        prefix, rest = first.split("[", 1)
        first = prefix + rest.split("-")[0].split("]")[0]
    return first


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
