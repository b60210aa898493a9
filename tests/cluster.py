"""A cluster of simulated hosts on one Linux machine: network namespaces joined by a bridge.

Each host is a network namespace with one interface, `zsnet`, holding 10.213.0.<h+1>/24; the
other end of its veth pair sits in a switch namespace, on a bridge. Processes started on a host
see only that namespace's network (its `lo` and `zsnet`), so ranks on one host talk over loopback
and ranks on different hosts over the veth pairs, whose byte counters (`tx_bytes`) are the
inter-host traffic. `rate` limits each host's uplink with `tc ... tbf` (its egress: traffic from
the host to every other host). Nothing here sends to an address outside these namespaces.

    with Cluster(hosts=2) as cluster:
        agent = cluster.start(0, ["python", "-m", "zeroshard.cli", "run", ...], log_path)

Needs root and iproute2 (`ip`, `tc`); `unavailable()` says why not, for a skip. Namespaces are
named `zst<pid>-<n>-...` after the creating process, so `remove_leftovers()` can delete those of a
run that died without tearing down (the `zst` prefix is ours alone). Used by
tests/test_multihost.py; a benchmark with a slow inter-host link can reuse it.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time

PREFIX = "zst"
SUBNET = "10.213.0"  # a private subnet, only ever inside namespaces made here
IFNAME = "zsnet"
_counter = itertools.count()
_verdicts: dict[bool, str | None] = {}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Cluster:
    """`hosts` network namespaces on one bridge; a context manager that tears everything down."""

    def __init__(self, hosts: int, rate: str | None = None):
        self.hosts = hosts
        self.rate = rate
        self.name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.switch = f"{self.name}-sw"
        self.namespaces = [f"{self.name}-h{h}" for h in range(hosts)]
        self.addresses = [f"{SUBNET}.{h + 1}" for h in range(hosts)]
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> "Cluster":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            _ip("netns", "add", ns)
            _ip("link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", f"h{h}",
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"h{h}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"h{h}", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME,
                                "root", "tbf", "rate", self.rate, "burst", "256kb", "latency",
                                "100ms"], check=True, capture_output=True, timeout=30)

    def start(self, host: int, argv: list[str], log_path,
              env: dict | None = None) -> subprocess.Popen:
        """Run `argv` on `host` (in its namespace, a session of its own), output to `log_path`."""
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *argv],
                                    stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.processes.append(proc)
        return proc

    def kill_host(self, host: int) -> None:
        """SIGKILL every process on `host`, as when the machine fails."""
        _kill_namespace(self.namespaces[host])

    def tx_bytes(self, host: int) -> int:
        """Bytes `host` sent to other hosts (its uplink's transmit counter, headers included)."""
        out = subprocess.run(["ip", "netns", "exec", self.namespaces[host], "cat", "/proc/net/dev"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return interface_tx_bytes(out, IFNAME)

    def close(self) -> None:
        """Stop every process started here and delete the namespaces (idempotent)."""
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for ns in [*self.namespaces, self.switch]:
            _delete_namespace(ns)
        for proc in self.processes:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def interface_tx_bytes(proc_net_dev: str, ifname: str) -> int:
    """The transmit byte counter of `ifname` in the text of /proc/net/dev."""
    for line in proc_net_dev.splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == ifname:
            return int(fields.split()[8])
    raise KeyError(f"no interface {ifname} in /proc/net/dev")


def _kill_namespace(ns: str) -> None:
    # Workers run in sessions of their own (torchrun starts them so): find them by namespace.
    for _ in range(20):
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.1)


def _delete_namespace(ns: str) -> None:
    if ns not in _namespaces():
        return
    _kill_namespace(ns)
    _ip("netns", "del", ns, check=False)


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_leftovers() -> list[str]:
    """Delete the namespaces of clusters whose creating process is gone; return their names."""
    removed = []
    for ns in _namespaces():
        match = re.fullmatch(rf"{PREFIX}(\d+)-\d+-(sw|h\d+)", ns)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


def unavailable(rate_limited: bool = False) -> str | None:
    """Why simulated hosts (with a tbf-limited uplink) cannot be made here, or None if they can."""
    if rate_limited in _verdicts:
        return _verdicts[rate_limited]
    reason = None
    if os.geteuid() != 0:
        reason = "simulated hosts need root (network namespaces)"
    elif not (shutil.which("ip") and shutil.which("tc")):
        reason = "simulated hosts need iproute2 ('ip' and 'tc')"
    else:
        try:
            remove_leftovers()
            with Cluster(hosts=1, rate="1gbit" if rate_limited else None):
                pass
        except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as err:
            detail = getattr(err, "stderr", "") or err
            made = "network namespaces, veth pairs" + (" and tbf" if rate_limited else "")
            reason = f"cannot create {made} here: {detail}".strip()
    _verdicts[rate_limited] = reason
    return reason
