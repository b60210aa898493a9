"""Two simulated hosts of two ranks each (tests/cluster.py: network namespaces on a bridge), every
host running its own torchrun agent through the README's multi-node command line:

    zeroshard run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 10.213.0.1:29400 --rdzv-id ID [--max-restarts 1] SCRIPT ...

(`python -m zeroshard.cli run` here, which is `zeroshard run`), with no is_host, --local-addr or
GLOO_SOCKET_IFNAME given: `zeroshard run` finds them. One job (tests/multihost_script.py) trains
at stages 1-3 and is compared with a single-process reference, measures the comm ledger's
inter-host bytes against the bytes that crossed the hosts' links, and runs examples/
train_elastic.py's loop uninterrupted. A second job runs that loop, loses host 1 (its agent and
ranks SIGKILLed after step 5), gets a replacement agent on host 1 as a scheduler would start one,
resumes from the step-4 checkpoint and ends bitwise equal to the uninterrupted run.
Skipped, saying why, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import cluster as simulated
from tests.models import make_batches, reference_run
from tests.multihost_script import LINK_STEPS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "multihost_script.py"
EXAMPLE = ROOT / "examples" / "train_elastic.py"
HOSTS, PER_HOST = 2, 2
WORLD = HOSTS * PER_HOST
TIMEOUT = 400  # seconds for one job: a hang fails the test instead of the suite
# Bytes that crossed a host's link over the ring model's inter-host bytes of that host's ranks,
# in training: a loose band, not a measurement. On gloo, Comm composes all-gather from broadcasts
# and reduce-scatter from pairwise exchanges (faster on one machine), which route more bytes
# across hosts than a ring: measured here, per host, 4/3 of the ring's bytes for the exchanges,
# 5/3 for the broadcasts (each root sends its slice to every peer), so 1.45-1.51 at stages 1-2
# and 1.58 at stage 3 (two gathers, one reduce-scatter, plus the desync check's small
# all-gathers). TCP/IP headers and ACKs add little on veth (64 KB segments), more on a real NIC.
LINK_BAND = (0.8, 2.0)
# gloo's all-reduce is the ring the model assumes: there the model and the link agree closely
# (measured within 0.3%); the rest of the allowance is headers and ACKs.
RING_TOLERANCE = 0.05


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLOO_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", ZEROSHARD_QUIET="1")
    return env


def _command(cluster, run_id: str, port: int, script_args: list[str], *launcher: str) -> list[str]:
    return [sys.executable, "-m", "zeroshard.cli", "run", "--nnodes", str(HOSTS),
            "--nproc-per-node", str(PER_HOST), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{cluster.addresses[0]}:{port}", "--rdzv-id", run_id,
            *launcher, *script_args]


def _wait(proc: subprocess.Popen, deadline: float) -> int:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _logs(paths) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in paths
                     if p.exists())


@pytest.fixture(scope="module")
def cluster():
    """Two simulated hosts, torn down after the module (also when a test fails)."""
    reason = simulated.unavailable()
    if reason:
        pytest.skip(reason)
    with simulated.Cluster(hosts=HOSTS) as made:
        yield made


@pytest.fixture(scope="module")
def job(cluster, tmp_path_factory):
    """tests/multihost_script.py on both hosts: its output directory, the agents' exit codes, their
    logs, and what each host's link sent over the whole job (Cluster.tx_bytes)."""
    out = tmp_path_factory.mktemp("multihost")
    logs = [out / f"host{h}.log" for h in range(HOSTS)]
    argv = _command(cluster, "stages", 29400,
                    [str(SCRIPT), "--out", str(out), "--elastic-ckpt", str(out / "ckpt")])
    procs = [cluster.start(h, argv, logs[h], env=_env()) for h in range(HOSTS)]
    deadline = time.monotonic() + TIMEOUT
    codes = [_wait(p, deadline) for p in procs]
    text = _logs(logs)
    if None in codes:
        cluster.kill_host(0), cluster.kill_host(1)
        pytest.fail(f"the two-host job did not finish within {TIMEOUT}s:\n{text}")
    return SimpleNamespace(out=out, codes=codes, text=text,
                           sent=[cluster.tx_bytes(h) for h in range(HOSTS)])


def test_job_succeeds_and_exits_cleanly(job):
    """Both agents report success, and no rank aborted while exiting (the gloo teardown abort,
    "terminate called without an active exception", that comm.py's clean exit fixed)."""
    assert job.codes == [0, 0], job.text
    assert "terminate called" not in job.text, job.text


def test_zeroshard_run_finds_the_rendezvous_host_and_interface(job):
    """Host 0 holds the endpoint address, so it hosts the rendezvous; gloo binds to zsnet."""
    host0, host1 = ((job.out / f"host{h}.log").read_text() for h in range(HOSTS))
    assert "this node hosts the rendezvous; local address 10.213.0.1" in host0, host0[-3000:]
    assert "local address 10.213.0.2" in host1 and "hosts the rendezvous" not in host1
    assert f"GLOO_SOCKET_IFNAME={simulated.IFNAME}" in host0 + host1


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_hosts_train_like_one_process(job, stage):
    """fp32 parameters after 4 Adam steps within 1e-5 relative of a single process on the same
    global batches (tests/multihost_script.py: TinyLM, 2 sequences per rank)."""
    assert job.codes == [0, 0], job.text
    out = job.out
    got = torch.load(out / f"stage{stage}.pt", weights_only=True)
    ref = reference_run(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
                        make_batches(4, WORLD * 2))
    for name, expected in ref.items():
        err = (got[name].float() - expected).abs().max() / expected.abs().max().clamp_min(1e-12)
        assert err < 1e-5, f"stage {stage} {name}: relative error {err:.2e}"


def _link(out: Path) -> list[dict]:
    return [json.loads((out / f"link_rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_inter_host_ledger_matches_the_link(job, stage):
    """Per rank, the ledger's inter-host share is 1/P (comm.py's ring model: 2 of the 4 hops
    cross); per host, the inter-host bytes of its ranks are within LINK_BAND of what its link
    really sent (a loose band, see LINK_BAND)."""
    assert job.codes == [0, 0], job.text
    out = job.out
    ranks = _link(out)
    for got in ranks:
        step = got["stages"][stage]
        assert step["intra_host"] + step["inter_host"] == step["total"] > 0
        assert abs(step["inter_host"] - step["total"] / PER_HOST) <= 100, step
    for node in range(HOSTS):
        mine = [r["stages"][stage] for r in ranks if r["node"] == node]
        modelled = sum(s["inter_host"] for s in mine)
        sent = mine[0]["sent"]  # one interface per host: every rank on it reads the same counter
        assert LINK_BAND[0] * modelled <= sent <= LINK_BAND[1] * modelled, (node, sent, modelled)
        assert job.sent[node] > sent  # the whole job (the harness's counter) sent more


def test_hpz_keeps_backward_gathers_off_the_link(job):
    """Stage 3 with hpZ (P = 2, the ranks of a host) ends bitwise equal to plain stage 3; its
    ledger's inter-host bytes lose exactly the backward all-gathers (Psi (N-1)/N x 1/2 per rank
    and step, fp32), and what each host's link really sent falls with them."""
    assert job.codes == [0, 0], job.text
    out = job.out
    plain, hpz = (torch.load(out / f"stage{s}.pt", weights_only=True) for s in ("3", "3hpz"))
    assert all(torch.equal(plain[n], hpz[n]) for n in plain)
    ranks = _link(out)
    for got in ranks:
        s3, with_hpz = got["stages"]["3"], got["stages"]["3hpz"]
        backward_gathers = LINK_STEPS * s3["psi"] * 4 * (WORLD - 1) / WORLD / PER_HOST
        assert abs(s3["inter_host"] - with_hpz["inter_host"] - backward_gathers) <= 200, got
    for node in range(HOSTS):
        mine = [r["stages"] for r in ranks if r["node"] == node]
        modelled = sum(s["3hpz"]["inter_host"] for s in mine)
        sent_plain, sent_hpz = mine[0]["3"]["sent"], mine[0]["3hpz"]["sent"]
        assert LINK_BAND[0] * modelled <= sent_hpz <= LINK_BAND[1] * modelled, (node, mine[0])
        assert sent_hpz < 0.85 * sent_plain, (node, sent_hpz, sent_plain)


def test_inter_host_ledger_is_exact_for_a_ring(job):
    """Three 4 MiB all-reduces: what each host's link sent equals the inter-host bytes the ledger
    gives its ranks (2 x 3/4 x payload per all-reduce per host) within RING_TOLERANCE."""
    assert job.codes == [0, 0], job.text
    out = job.out
    ranks = _link(out)
    payload = 3 * 4 * (1 << 20)
    for node in range(HOSTS):
        mine = [r["ring"] for r in ranks if r["node"] == node]
        modelled = sum(m["inter_host"] for m in mine)
        assert modelled == 2 * payload * (WORLD - 1) / WORLD  # what the host's one ring hop carries
        assert abs(mine[0]["sent"] - modelled) <= RING_TOLERANCE * modelled, (node, mine[0])


def test_failed_host_is_replaced_and_the_run_resumes_bitwise(cluster, job, tmp_path):
    """examples/train_elastic.py with --max-restarts 1: host 1's agent and both its ranks are
    SIGKILLed after step 5 (--kill-node 1); host 0's agent restarts its workers and waits; a
    replacement agent started on host 1 with the same command joins; every rank resumes from the
    step-4 checkpoint and the final parameters equal the uninterrupted run's bit for bit."""
    assert job.codes == [0, 0], job.text
    out = job.out
    result = tmp_path / "final.pt"
    argv = _command(cluster, "restart", 29400,
                    [str(EXAMPLE), "--ckpt", str(tmp_path / "ckpt"), "--out", str(result),
                     "--kill-node", "1", "--kill-at", "5"], "--max-restarts", "1")
    logs = [tmp_path / "host0.log", tmp_path / "host1.log", tmp_path / "host1-replacement.log"]
    deadline = time.monotonic() + TIMEOUT
    host0 = cluster.start(0, argv, logs[0], env=_env())
    failed = _wait(cluster.start(1, argv, logs[1], env=_env()), deadline)
    assert failed == -9, f"host 1's agent should have been killed, got {failed}\n{_logs(logs)}"
    replacement = cluster.start(1, argv, logs[2], env=_env())
    codes = [_wait(host0, deadline), _wait(replacement, deadline)]
    text = _logs(logs)
    if None in codes:
        cluster.kill_host(0), cluster.kill_host(1)
    assert codes == [0, 0], text
    assert "resumed from" in text and "global_step4 at step 4" in text, text
    assert "terminate called" not in text, text
    whole = torch.load(out / "elastic.pt", weights_only=True)
    resumed = torch.load(result, weights_only=True)
    assert sorted(resumed) == sorted(whole)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
