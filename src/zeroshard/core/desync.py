"""Turning desynchronised ranks into a readable error instead of a hang: the collective watchdog.

Every rank must issue the same collectives in the same order. When one rank takes another path (a
data-dependent branch in forward, an exception caught on one rank followed by `save_checkpoint`,
a step without its micro-step, a crash), its peers wait for a collective that never comes; torch
reports that only after the process group's timeout (30 minutes by default), naming nothing.

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
import ctypes
import datetime
import json
import socket
import threading
import time

import torch.distributed as dist

#: Longest wait for the peers' entries once a rank is stuck.
PEER_WAIT_S = 30.0
#: How often the NCCL poller looks at the oldest outstanding collective.
POLL_S = 1.0


class DesyncError(RuntimeError):
    """Ranks disagreed about the next collective (a hang, or a failure, caught by the watchdog)."""


def watch_collectives(comm, timeout_s: float) -> "Watchdog | None":
    """Attach a watchdog to `comm` (None and nothing attached for one rank or timeout 0)."""
    comm.watch = Watchdog(comm, timeout_s) if comm.world_size > 1 and timeout_s > 0 else None
    return comm.watch


class Watchdog:
    """Per-Comm record of the last collective, and the diagnosis run when one gets stuck."""

    def __init__(self, comm, timeout_s: float):
        self.comm = comm
        self.timeout_s = float(timeout_s)
        self.count = 0
        self.last = None  # ticket of the last collective issued
        self.phase = None  # what the engine is doing ("backward", "save_checkpoint", ...)
        self.verdict: str | None = None  # set once: the report every later call raises
        self.seen: dict[int, bytes] = {}  # peer -> its entry we already reported
        name = getattr(comm.group, "group_name", None) if comm.group is not None else "default"
        self.prefix = f"zeroshard_desync/{name}/"
        self.polled = not comm.composed  # device backends: the host does not block in wait()
        self.outstanding = collections.deque()  # (work, ticket), polled backends only
        self.poller: threading.Thread | None = None
        self.lock = threading.Lock()

    # -- the hot path ----------------------------------------------------------------------------
    def issued(self, kind: str, unit=None) -> tuple:
        """Record, locally, that collective `kind` (of `unit`) starts now; returns its ticket."""
        if self.verdict is not None:
            raise DesyncError(self.verdict)
        self.count += 1
        ticket = (self.count, kind, unit, self.phase, time.monotonic())
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

    # -- diagnosis -------------------------------------------------------------------------------
    def _stuck(self, ticket: tuple, start: float, err, works=()) -> None:
        """Publish this rank's operation, read the peers', raise DesyncError on this rank."""
        with self.lock:
            if self.verdict is None:
                self.verdict = self._diagnose(ticket, start, err)
                _park(self.comm.group, works)
        raise DesyncError(self.verdict)

    def _diagnose(self, ticket: tuple, start: float, err) -> str:
        now = time.monotonic()
        rank, world = self.comm.rank, self.comm.world_size
        mine = {"op": self.describe(ticket), "waited": round(now - start, 2),
                "issued": round(now - ticket[4], 2), "wall": time.time(),
                "error": _first_line(err) if err is not None else None,
                "host": socket.gethostname()}
        if self.last is not None and self.last[0] != ticket[0]:
            mine["last"] = self.describe(self.last)
        entries = {rank: mine}
        problem = None
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(self.prefix + str(self.comm._ranks[rank]), json.dumps(mine))
            entries.update(self._read_peers(store))
            self._let_peers_read(store, mine["wall"], [p for p in entries if p != rank])
        except Exception as store_err:  # noqa: BLE001 - the report must still come out
            problem = f"the rendezvous store could not be used ({_first_line(store_err)})"
        lines = []
        for peer in range(world):
            entry = entries.get(peer)
            lines.append(f"rank {peer}: " + (_say(entry, time.time()) if entry else
                                             "not responding (no report: it exited, crashed, or "
                                             "is busy outside any collective)"))
        cause = (f"collective failed after {now - start:.1f}s: {mine['error']}" if err is not None
                 else f"no collective completed within zeroshard_desync_timeout="
                      f"{self.timeout_s:g}s")
        return (f"ranks are desynchronised (rank {rank}: {cause}). " + "; ".join(lines) +
                (f". Note: {problem}" if problem else "") +
                ". Every rank must issue the same collectives in the same order: the same modules "
                "in forward, backward on every rank, the same number of micro-steps, and "
                "save_checkpoint/load_checkpoint called by every rank at the same point (not from "
                "an exception handler on one rank). This process group cannot be used any more: "
                "restart from the last checkpoint.")

    def _read_peers(self, store) -> dict[int, dict]:
        """Every peer's entry that is new to this rank, waiting up to PEER_WAIT_S for them."""
        found: dict[int, dict] = {}
        deadline = time.monotonic() + min(self.timeout_s, PEER_WAIT_S)
        peers = [p for p in range(self.comm.world_size) if p != self.comm.rank]
        while True:
            for peer in peers:
                key = self.prefix + str(self.comm._ranks[peer])
                if peer in found or not store.check([key]):
                    continue
                raw = store.get(key)
                if raw != self.seen.get(peer):
                    self.seen[peer] = raw
                    found[peer] = json.loads(raw)
            if len(found) == len(peers) or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def _let_peers_read(self, store, since: float, peers: list[int]) -> None:
        """Say this rank has read the entries; wait (briefly) until the peers that reported have
        read ours too: rank 0 hosts the store, and once it raises and exits the store is gone."""
        store.set(self.prefix + f"read/{self.comm._ranks[self.comm.rank]}", repr(time.time()))
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        keys = [self.prefix + f"read/{self.comm._ranks[p]}" for p in peers]
        while keys and time.monotonic() < deadline:
            keys = [k for k in keys if not store.check([k]) or float(store.get(k)) < since - 1]
            if keys:
                time.sleep(0.05)

    def describe(self, ticket: tuple) -> str:
        """`reduce-scatter #12 of unit 3 (blocks.1: ...) in backward`."""
        count, kind, unit, phase, _ = ticket
        text = f"{kind} #{count}"
        if unit is not None:
            text += f" of {unit.describe() if hasattr(unit, 'describe') else unit}"
        return text + (f" in {phase}" if phase else "")

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
                dist.distributed_c10d._abort_process_group(self.comm.group)
            except Exception:  # noqa: BLE001 - best effort: the next zeroshard call raises
                pass


def _say(entry: dict, now_wall: float) -> str:
    """One rank's entry as text."""
    text = f"waiting {entry['waited']:.1f}s for {entry['op']}"
    if entry.get("error"):
        text += f", which failed: {entry['error']}"
    if entry.get("last"):
        text += f" (last issued: {entry['last']})"
    age = now_wall - entry.get("wall", now_wall)
    if age > 5:
        text += f" [reported {age:.0f}s ago]"
    return text


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
