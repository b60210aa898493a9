"""`zeroshard run` across machines: what torchrun leaves to the user, found from the network.

Started on each node with the same `--nnodes H --rdzv-backend c10d --rdzv-endpoint HOST:PORT`,
torchrun needs three things it guesses from the machine's hostname, and the guesses fail where the
hostname resolves to a loopback or management address (or several machines share a hostname):

* which agent hosts the rendezvous store (c10d's `is_host`): torchrun compares the endpoint with
  the hostname's addresses; here, the agent whose machine holds the endpoint's address hosts it;
* the address other nodes reach this one at (`--local-addr`, which becomes the workers'
  MASTER_ADDR on node 0): here, the local address of the route to the endpoint;
* the interface gloo binds to (`GLOO_SOCKET_IFNAME`): here, the interface holding that address.

An option or variable the user set is left alone. On a multi-node c10d job it also sets
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: each attempt's workers then start on a fresh store held by
rank 0 (see `zeroshard.comm.init_distributed`), so a restarted attempt never reads an earlier
attempt's keys, whichever node failed. Nothing is sent: the route is looked up by connecting a UDP
socket, which transmits no packet.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def route_to(host: str) -> tuple[str, str] | None:
    """(the endpoint's address, this machine's source address towards it), or None if unknown."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((sockaddr[0], 9))  # UDP connect: a route lookup, nothing is sent
                return sockaddr[0], sock.getsockname()[0]
        except OSError:
            continue
    return None


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 `address` (Linux), or None."""
    if not hasattr(socket, "if_nameindex"):
        return None
    try:
        import fcntl
        import struct

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return None
    for name in names:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


def _is_local(endpoint_addr: str, source: str) -> bool:
    # A route to one of this machine's own addresses leaves from that very address.
    return ipaddress.ip_address(endpoint_addr).is_loopback or endpoint_addr == source


def _torch_thinks_host(host: str) -> bool | None:
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:
        return None
    try:
        return _matches_machine_hostname(host)
    except OSError:
        return False


def _endpoint_host(args: argparse.Namespace) -> str | None:
    if args.rdzv_backend == "static":
        return args.master_addr or None
    if not args.rdzv_endpoint:
        return None
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    return parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)[0]


def _conf_keys(conf: str) -> set[str]:
    return {item.split("=", 1)[0].strip().lower() for item in conf.split(",") if "=" in item}


def apply_node_defaults(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Fill in a multi-node launch's missing is_host / --local-addr; return (notes, env to add).

    The environment variables are for the agent and its workers (GLOO_SOCKET_IFNAME,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE), never one already set; the caller applies them.
    """
    host = _endpoint_host(args)
    route = route_to(host) if host else None
    if route is None:
        return [], {}
    endpoint_addr, source = route
    local = _is_local(endpoint_addr, source)
    notes, env = [], {}
    if args.rdzv_backend == "c10d":
        if "is_host" not in _conf_keys(args.rdzv_conf) and _torch_thinks_host(host) != local:
            args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"is_host={int(local)}"]))
            notes.append("this node hosts the rendezvous" if local else
                         "another node hosts the rendezvous")
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if args.local_addr is None:
        args.local_addr = source
        notes.append(f"local address {source}")
    ifname = interface_of(source)
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
        notes.append(f"GLOO_SOCKET_IFNAME={ifname}")
    env = {k: v for k, v in env.items() if k not in os.environ}
    if "GLOO_SOCKET_IFNAME" not in env:
        notes = [n for n in notes if not n.startswith("GLOO_SOCKET_IFNAME")]
    return notes, env


def announce(notes: list[str], endpoint: str) -> None:
    """One line on stderr saying what `apply_node_defaults` chose."""
    if notes:
        print(f"zeroshard run: rendezvous at {endpoint}: {'; '.join(notes)}", file=sys.stderr,
              flush=True)
