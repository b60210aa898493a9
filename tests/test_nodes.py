"""`zeroshard run` across nodes fills in what torchrun guesses from the hostname (cli/nodes.py):
the rendezvous host, --local-addr and GLOO_SOCKET_IFNAME, from the route to the endpoint; and
leaves alone whatever the user gave. Checked here on loopback endpoints; tests/test_multihost.py
runs it on simulated hosts, where the hostname resolves to neither host's address."""

from __future__ import annotations

import os
import sys

import pytest

from zeroshard.cli import launch, nodes

MULTI = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]


@pytest.fixture
def script(tmp_path, monkeypatch):
    """A training script, in an environment without interface or store settings."""
    for name in ("GLOO_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def _unresolvable(monkeypatch):
    """Name lookups fail (without asking a DNS server: the tests send nothing off the machine)."""
    def fail(*args, **kwargs):
        raise nodes.socket.gaierror("not found")
    monkeypatch.setattr(nodes.socket, "getaddrinfo", fail)


def test_route_to_loopback(monkeypatch):
    assert nodes.route_to("127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    _unresolvable(monkeypatch)
    assert nodes.route_to("node0") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interface lookup is Linux's")
def test_interface_of_an_address():
    assert nodes.interface_of("127.0.0.1") == "lo"
    assert nodes.interface_of("192.0.2.1") is None  # TEST-NET-1: on no interface here


def test_multi_node_defaults(script):
    """torchrun already hosts on a loopback endpoint (no is_host added); the local address and
    interface are the loopback's; the environment changes are returned, not applied."""
    before = dict(os.environ)
    args = launch.prepare_run_args([*MULTI, script])
    assert args.local_addr == "127.0.0.1" and "is_host" not in args.rdzv_conf
    if sys.platform.startswith("linux"):
        assert args.node_env["GLOO_SOCKET_IFNAME"] == "lo"
    assert args.node_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "local address 127.0.0.1" in args.node_notes
    assert dict(os.environ) == before


def test_user_settings_are_kept(script, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    args = launch.prepare_run_args([*MULTI, "--local-addr", "node3", "--rdzv-conf",
                                    "is_host=0,join_timeout=5", script])
    assert args.local_addr == "node3" and args.rdzv_conf == "is_host=0,join_timeout=5"
    assert args.node_env == {} and args.node_notes == []


def test_host_decided_where_torch_guesses_wrong(script, monkeypatch):
    """Where torchrun's hostname comparison disagrees with the route (several machines sharing
    one hostname), the route decides, in both directions."""
    monkeypatch.setattr(nodes, "_torch_thinks_host", lambda host: False)
    assert "is_host=1" in launch.prepare_run_args([*MULTI, script]).rdzv_conf
    monkeypatch.setattr(nodes, "_torch_thinks_host", lambda host: True)
    monkeypatch.setattr(nodes, "route_to", lambda host: ("10.213.0.1", "10.213.0.2"))
    args = launch.prepare_run_args([*MULTI, script])
    assert args.rdzv_conf == "is_host=0" and args.local_addr == "10.213.0.2"


def test_single_node_and_unresolvable_endpoints_are_left_alone(script, monkeypatch):
    args = launch.prepare_run_args([script])
    assert args.standalone and args.node_env == {} and args.local_addr is None
    _unresolvable(monkeypatch)
    args = launch.prepare_run_args(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                    "node0:29400", script])
    assert args.node_env == {} and args.local_addr is None and args.rdzv_conf == ""
