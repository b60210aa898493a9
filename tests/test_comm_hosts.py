"""The comm ledger's intra-/inter-host split: the ring model of comm.py's docstring, checked on
hand-computed layouts, and the node layout read from torchrun's and Slurm's environment.

The split measured in real training worlds is in tests/test_ledgers.py (hosts simulated through
LOCAL_WORLD_SIZE) and against a simulated host's link in tests/test_multihost.py."""

from __future__ import annotations

import pytest

from zeroshard.dist import HostLayout

# (ranks per host, ranks of the ring in ring order, hops that cross hosts / hops), by hand:
CASES = [
    (2, [0, 1, 2, 3], 2 / 4),      # 0-1 | 1->2 crosses | 2-3 | 3->0 crosses
    (2, [0, 1, 2, 3, 4, 5], 3 / 6),  # three hosts of two: 1->2, 3->4, 5->0
    (3, [0, 1, 2, 3, 4, 5], 2 / 6),  # two hosts of three: 2->3, 5->0
    (4, [0, 1, 2, 3], 0.0),          # one host
    (1, [0, 1, 2, 3], 1.0),          # one rank per host: every hop crosses
    (2, [0, 2], 1.0),                # a group of one rank per host (both hops cross)
    (2, [0, 1], 0.0),                # a group inside one host
    (2, [0, 1, 2], 2 / 3),           # 0-1 | 1->2 crosses | 2->0 crosses
    (2, [5], 0.0),                   # a group of one moves nothing
]


@pytest.mark.parametrize("per_host,ranks,share", CASES)
def test_crossing_share_by_hand(per_host, ranks, share):
    assert HostLayout(per_host).crossing_share(ranks) == pytest.approx(share)


def test_two_hosts_of_two_all_gather_by_hand():
    """An all-gather of 1000 bytes over 2 hosts x 2 ranks: each rank counts 3/4 x 1000 = 750 bytes,
    half of them inter-host (375); a host's two ranks sum to 750, what the ring's one hop out of
    the host carries (three 250-byte chunks)."""
    layout = HostLayout(2)
    per_rank = 1000 * 3 / 4
    inter = per_rank * layout.crossing_share([0, 1, 2, 3])
    assert (per_rank, inter) == (750, 375)
    assert 2 * inter == 3 * 250


@pytest.fixture
def env(monkeypatch):
    """A clean node-layout environment."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "GROUP_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_layout_from_torchrun(env):
    env.setenv("LOCAL_WORLD_SIZE", "2")
    env.setenv("GROUP_RANK", "1")
    env.setenv("RANK", "3")
    layout = HostLayout.from_env(4)
    assert layout.ranks_per_host == 2 and [layout.host(r) for r in range(4)] == [0, 0, 1, 1]


def test_layout_without_launcher_is_one_host(env):
    assert HostLayout.from_env(3).crossing_share([0, 1, 2]) == 0.0


def test_layout_from_slurm(env):
    env.setenv("SLURM_NTASKS_PER_NODE", "4")
    assert HostLayout.from_env(8).ranks_per_host == 4
    env.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")  # not one plain number: one host assumed
    assert HostLayout.from_env(8).ranks_per_host == 8


def test_uneven_hosts_warn(env):
    env.setenv("LOCAL_WORLD_SIZE", "1")
    env.setenv("GROUP_RANK", "1")
    env.setenv("RANK", "3")  # host 1 of a 3 + 1 layout: rank 3 is not on host 3
    with pytest.warns(RuntimeWarning, match="do not all run"):
        HostLayout.from_env(4)


def test_demo_shows_the_split():
    """`zeroshard demo` prints each stage's bytes per step, intra-host and inter-host."""
    from zeroshard.cli.demo import VariantResult, comm_table

    rows = [VariantResult("2", comm={"total": 4_000_000, "intra_host": 2_000_000,
                                     "inter_host": 2_000_000}, hosts=(2, 2)),
            VariantResult("3", comm={"total": 6_000_000, "intra_host": 3_000_000,
                                     "inter_host": 3_000_000}, hosts=(2, 2))]
    lines = comm_table(rows)
    assert "2 hosts x 2 ranks" in lines[0]
    assert lines[1].split() == ["stage", "total", "MB", "intra-host", "MB", "inter-host", "MB"]
    assert lines[2].split() == ["2", "4.000", "2.000", "2.000"]
    assert lines[3].split() == ["3", "6.000", "3.000", "3.000"]
