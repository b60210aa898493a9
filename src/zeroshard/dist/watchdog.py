"""Turning desynchronised ranks into a readable error instead of a hang: the collective watchdog.

Every rank must issue the same collectives in the same order. When one rank takes another path (a
data-dependent branch in forward, an exception caught on one rank followed by `save_checkpoint`,
a step without its micro-step, a crash), its peers wait for a collective that never comes; torch
reports that only after the process group's timeout (30 minutes by default), naming nothing.

A `World` (`world.py`) makes one `Watchdog` per process group and hands it to that group's `Comm`
at construction (none for one rank or `zeroshard_desync_timeout` 0); a subgroup's watchdog
(`for_group`) keeps the parent's deadline and step counter.

Steady state costs nothing: no extra collective, no tensor, no store traffic. Before each
collective `Comm` asks the watchdog for a ticket: a tuple of (running count, kind, unit, phase,
start time), kept locally as "the last operation". The cost is a counter increment and a
`time.monotonic()` call.

Detection depends on how the backend waits:

- gloo (CPU): the host thread waits for each collective, so `Comm` waits in one call with a
  deadline (`work.wait(timeout=...)`, which raises while the collective goes on). A wait that runs
  past `zero_optimization.zeroshard_desync_timeout` seconds, or a collective that fails (a peer
  closed its connection, mismatched sizes), starts a diagnosis on that rank.
- NCCL and other device backends: `wait()` only orders streams, so a daemon thread polls the
  oldest outstanding collective's `is_completed()` about once a second; past the timeout it runs
  the diagnosis, then aborts the process group so that a host thread stuck on the device is
  released, and the next zeroshard collective or wait raises. (Written to the same protocol;
  not yet run on GPUs.)

Diagnosis, only on a rank that is already stuck: it publishes what it is waiting for (operation,
unit, phase, true waiting time, the underlying error) under `zeroshard_desync/<group>/<rank>` in
the rendezvous store (`torch.distributed`'s default store), then reads every peer's entry, giving
them up to `min(timeout, 30 s)` to appear: peers stuck on the same mismatch time out at about the
same moment and publish theirs. A peer with no new entry is named "not responding" (it exited,
crashed, or is busy outside any collective). Every stuck rank then raises `DesyncError` naming
each rank's operation and unit. The process group is unusable afterwards (its collectives were
left unmatched): further collectives on this `Comm` raise the same error at once, and the group
and its pending work are deliberately never destroyed, because destroying a gloo group joins
worker threads that are blocked on the missing peers (exit would hang until torch's timeout).
A rank that was busy elsewhere meets the error the next time one of its collectives times out;
entries it has not read yet (from the incident its peers already reported) are read at once.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import json
import os
import socket
import threading
import time
from typing import NoReturn

import torch.distributed as dist

from .steps import DesyncError, StepCounter
from .topology import group_ranks

#: Longest wait for the peers' entries once a rank is stuck.
PEER_WAIT_S = 30.0
#: How often the NCCL poller looks at the oldest outstanding collective.
POLL_S = 1.0
#: After a collective failed on a closed or reset connection (a peer's process is gone), how long
#: a silent peer on another host still gets to report (same-host peers are checked by pid).
DEAD_PEER_GRACE_S = 3.0
#: Errors of a collective that say a peer's connection closed: its process is gone.
_CONNECTION_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
                    "connection refused", "end of file")


class Watchdog:
    """The record of one process group's last collective, and the diagnosis run when one gets
    stuck."""

    def __init__(self, group, timeout_s: float, steps: StepCounter, *, ranks: list[int],
                 rank: int, polled: bool):
        """`group` (None: the default one) has global `ranks` (group order), this process at
        position `rank`; `polled`: a device backend, whose waits do not block the host."""
        self.group = group
        self.timeout_s = float(timeout_s)
        self.steps = steps
        self.ranks = list(ranks)
        self.rank = rank
        self.world_size = len(self.ranks)
        self.count = 0
        self.last = None  # ticket of the last collective issued
        self.phase = None  # what the engine is doing ("backward", "save_checkpoint", ...)
        self.verdict: str | None = None  # set once: the report every later call raises
        self.seen: dict[int, bytes] = {}  # peer -> its entry we already reported
        name = getattr(group, "group_name", None) if group is not None else "default"
        self.prefix = f"zeroshard_desync/{name}/"
        # Device backends: the host does not block in wait(), a poller thread watches instead.
        self.polled = polled
        self.outstanding = collections.deque()  # (work, ticket), polled backends only
        self.poller: threading.Thread | None = None
        self.lock = threading.Lock()
        self._announce()

    @classmethod
    def arm(cls, group, timeout_s: float, steps: StepCounter) -> "Watchdog | None":
        """A watchdog for `group`, or None where none is needed (one rank, timeout 0)."""
        if timeout_s <= 0 or dist.get_world_size(group) < 2:
            return None
        return cls(group, timeout_s, steps, ranks=group_ranks(group), rank=dist.get_rank(group),
                   polled=dist.get_backend(group) != "gloo")

    def for_group(self, group) -> "Watchdog | None":
        """A watchdog for a subgroup of this one's ranks: the same deadline and step counter."""
        return Watchdog.arm(group, self.timeout_s, self.steps)

    @contextlib.contextmanager
    def in_phase(self, name: str):
        """Label the collectives issued inside with the engine phase `name` in reports."""
        outer, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = outer

    def _announce(self) -> None:
        """Publish this rank's host and pid once (a peer that finds the pid gone on its own host
        knows this rank is dead instead of waiting for its report); no store, no announcement."""
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(self.prefix + f"proc/{self.ranks[self.rank]}",
                      json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        except Exception:  # noqa: BLE001 - the diagnosis then waits for reports as before
            pass

    # -- the hot path ----------------------------------------------------------------------------
    def issued(self, kind: str, unit=None) -> tuple:
        """Record, locally, that collective `kind` (of `unit`) starts now; returns its ticket."""
        if self.verdict is not None:
            raise DesyncError(self.verdict)
        self.count += 1
        ticket = (self.count, kind, unit, self.phase, time.monotonic(), self.steps.counts())
        self.last = ticket
        return ticket

    def started(self, works, ticket: tuple) -> None:
        """Polled backends: hand the collective's work objects to the poller."""
        if self.polled:
            for work in works:
                self.outstanding.append((work, ticket))
            if self.poller is None:
                self.poller = threading.Thread(target=self._poll, name="zeroshard-watchdog",
                                               daemon=True)
                self.poller.start()

    def wait(self, works, ticket: tuple) -> None:
        """Wait for `works` (one collective); DesyncError past the timeout or on a failure."""
        if self.polled:
            try:
                for work in works:
                    work.wait()
            except RuntimeError:
                if self.verdict is not None:  # the poller aborted the group
                    raise DesyncError(self.verdict) from None
                raise
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        for work in works:
            try:
                work.wait(timeout=datetime.timedelta(
                    seconds=max(deadline - time.monotonic(), 1e-3)))
            except RuntimeError as err:
                if self.verdict is not None:
                    raise DesyncError(self.verdict) from None
                timed_out = "timed out" in str(err).lower()
                self._stuck(ticket, start, None if timed_out else err, works)

    def failed(self, ticket: tuple, err: RuntimeError) -> NoReturn:
        """A collective that could not even be posted (a peer's connection is already closed):
        DesyncError, diagnosed as a failed wait."""
        if self.verdict is not None:
            raise DesyncError(self.verdict) from None
        self._stuck(ticket, time.monotonic(), err)

    # -- diagnosis -------------------------------------------------------------------------------
    def _stuck(self, ticket: tuple, start: float, err, works=()) -> None:
        """Publish this rank's operation, read the peers', raise DesyncError on this rank."""
        with self.lock:
            if self.verdict is None:
                self.verdict = self._diagnose(ticket, start, err)
                _park(self.group, works)
        raise DesyncError(self.verdict)

    def _diagnose(self, ticket: tuple, start: float, err) -> str:
        now = time.monotonic()
        rank, world = self.rank, self.world_size
        mine = {"op": self.describe(ticket), "waited": round(now - start, 2),
                "issued": round(now - ticket[4], 2), "wall": time.time(),
                "error": _first_line(err) if err is not None else None,
                "host": socket.gethostname(), "steps": list(ticket[5])}
        if self.last is not None and self.last[0] != ticket[0]:
            mine["last"] = self.describe(self.last)
        entries = {rank: mine}
        problem = None
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(self.prefix + str(self.ranks[rank]), json.dumps(mine))
            lost = err is not None and any(k in str(err).lower() for k in _CONNECTION_LOST)
            found, dead = self._read_peers(store, lost)
            entries.update(found)
            self._let_peers_read(store, mine["wall"], [p for p in entries if p != rank])
        except Exception as store_err:  # noqa: BLE001 - the report must still come out
            problem = f"the rendezvous store could not be used ({_first_line(store_err)})"
            dead = {}
        lines = []
        for peer in range(world):
            entry = entries.get(peer)
            if entry:
                lines.append(f"rank {peer}: " + _say(entry, time.time(), own=peer == rank))
            elif peer in dead:
                lines.append(f"rank {peer}: dead ({dead[peer]})")
            else:
                lines.append(f"rank {peer}: not responding (no report: it exited, crashed, or "
                             "is busy outside any collective)")
        counts = {tuple(e["steps"]) for e in entries.values() if e.get("steps") is not None}
        steps = f". {_step_disagreement(entries)}" if len(counts) > 1 else ""
        cause = (f"collective failed after {now - start:.1f}s: {mine['error']}" if err is not None
                 else f"no collective completed within zeroshard_desync_timeout="
                      f"{self.timeout_s:g}s")
        return (f"ranks are desynchronised (rank {rank}: {cause}). " + "; ".join(lines) + steps +
                (f". Note: {problem}" if problem else "") +
                ". Every rank must issue the same collectives in the same order: the same modules "
                "in forward, backward on every rank, the same number of micro-steps, and "
                "save_checkpoint/load_checkpoint called by every rank at the same point (not from "
                "an exception handler on one rank). This process group cannot be used any more: "
                "restart from the last checkpoint.")

    def _read_peers(self, store, connection_lost: bool = False) -> tuple[dict, dict]:
        """Every peer's entry that is new to this rank, waiting up to PEER_WAIT_S for them, and
        the peers known dead ({peer: why}), which are not waited for: a peer on this host whose
        process is gone, and, once this rank's collective failed on a lost connection, peers
        that stay silent past DEAD_PEER_GRACE_S."""
        found: dict[int, dict] = {}
        dead: dict[int, str] = {}
        start = time.monotonic()
        deadline = start + min(self.timeout_s, PEER_WAIT_S)
        peers = [p for p in range(self.world_size) if p != self.rank]
        procs: dict[int, dict] = {}
        checked = 0.0
        while True:
            for peer in peers:
                key = self.prefix + str(self.ranks[peer])
                if peer in found or not store.check([key]):
                    continue
                raw = store.get(key)
                if raw != self.seen.get(peer):
                    self.seen[peer] = raw
                    found[peer] = json.loads(raw)
                    dead.pop(peer, None)
            now = time.monotonic()
            if now - checked > 0.25:  # a few cheap looks per second at the silent peers
                checked = now
                for peer in peers:
                    if peer not in found and peer not in dead:
                        why = self._gone(store, peer, procs)
                        if why is not None:
                            dead[peer] = why
            waiting = [p for p in peers if p not in found and p not in dead]
            if connection_lost and now - start > DEAD_PEER_GRACE_S:
                for peer in waiting:  # a silent peer behind a lost connection: not waited for
                    dead[peer] = ("no report within "
                                  f"{DEAD_PEER_GRACE_S:g}s after a connection was lost: its "
                                  "process is gone or cut off")
                waiting = []
            if not waiting or now > deadline:
                return found, dead
            time.sleep(0.05)

    def _gone(self, store, peer: int, procs: dict) -> str | None:
        """Why `peer` is known dead (its announced pid is gone on this host), or None."""
        if peer not in procs:
            key = self.prefix + f"proc/{self.ranks[peer]}"
            try:
                procs[peer] = json.loads(store.get(key)) if store.check([key]) else {}
            except Exception:  # noqa: BLE001 - unknown: keep waiting for its report
                procs[peer] = {}
        proc = procs[peer]
        if proc.get("host") != socket.gethostname() or not proc.get("pid"):
            return None
        try:
            os.kill(int(proc["pid"]), 0)
        except ProcessLookupError:
            return f"its process {proc['pid']} on this host has ended"
        except PermissionError:
            return None
        if _zombie(int(proc["pid"])):
            return f"its process {proc['pid']} on this host has ended"
        return None

    def _let_peers_read(self, store, since: float, peers: list[int]) -> None:
        """Say this rank has read the entries; wait (briefly) until the peers that reported have
        read ours too: rank 0 hosts the store, and once it raises and exits the store is gone."""
        store.set(self.prefix + f"read/{self.ranks[self.rank]}", repr(time.time()))
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        keys = [self.prefix + f"read/{self.ranks[p]}" for p in peers]
        while keys and time.monotonic() < deadline:
            keys = [k for k in keys if not store.check([k]) or float(store.get(k)) < since - 1]
            if keys:
                time.sleep(0.05)

    def describe(self, ticket: tuple) -> str:
        """`reduce-scatter #12 of unit 3 (blocks.1: ...) in backward, after 2 optimizer steps
        and 3 backward passes`."""
        count, kind, unit, phase = ticket[:4]
        text = f"{kind} #{count}"
        if unit is not None:
            text += f" of {unit.describe() if hasattr(unit, 'describe') else unit}"
        text += f" in {phase}" if phase else ""
        if len(ticket) > 5 and any(ticket[5]):
            steps, backwards = ticket[5]
            text += f", after {steps} optimizer steps and {backwards} backward passes"
        return text

    # -- device backends -------------------------------------------------------------------------
    def _poll(self) -> None:
        """Poller thread: diagnose when the oldest outstanding collective passes the timeout."""
        while self.verdict is None:
            time.sleep(min(POLL_S, self.timeout_s / 4))
            while self.outstanding and self.outstanding[0][0].is_completed():
                self.outstanding.popleft()
            if not self.outstanding:
                continue
            work, ticket = self.outstanding[0]
            if time.monotonic() - ticket[4] < self.timeout_s:
                continue
            try:
                self._stuck(ticket, ticket[4], None, [work])
            except DesyncError:
                pass
            try:  # release a host thread blocked on the device (NCCL kernels that never end)
                dist.distributed_c10d._abort_process_group(self.group)
            except Exception:  # noqa: BLE001 - best effort: the next zeroshard call raises
                pass


def _say(entry: dict, now_wall: float, own: bool = False) -> str:
    """One rank's entry as text (the age of a peer's report when it is old news)."""
    text = f"waiting {entry['waited']:.1f}s for {entry['op']}"
    if entry.get("error"):
        text += f", which failed: {entry['error']}"
    if entry.get("last"):
        text += f" (last issued: {entry['last']})"
    age = now_wall - entry.get("wall", now_wall)
    if age > 5 and not own:
        text += f" [reported {age:.0f}s ago]"
    return text


def _step_disagreement(entries: dict[int, dict]) -> str:
    """"The ranks are at different steps: rank 0 after ..., rank 1 after ...: a rank skipped"."""
    each = ", ".join(f"rank {p} after {entries[p]['steps'][0]} optimizer steps and "
                     f"{entries[p]['steps'][1]} backward passes"
                     for p in sorted(entries) if entries[p].get("steps") is not None)
    return (f"The ranks are at different steps: {each}; a rank skipped engine.step() or "
            "engine.backward(), or ran an extra one")


def _zombie(pid: int) -> bool:
    """Whether `pid` has ended and waits to be reaped (Linux /proc; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(") ", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _first_line(err) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def _park(group, works) -> None:
    """Keep the poisoned process group and its pending work alive until the process ends.

    Their C++ destructors join gloo worker threads still blocked on peers that will never answer,
    which would hang (until torch's timeout) whoever drops the last reference: exit, or
    destroy_process_group. One extra reference, never released, keeps them from running.
    """
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):
        pg = None
    for obj in [pg, *works]:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
