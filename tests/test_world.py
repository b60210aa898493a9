"""dist/world.py: the World is made in one place and hands every Comm its ledger, watchdog and step
counter at construction.

One world of 2 gloo ranks records, per rank: what `World.current()` returns before and after a
build (the same object each time; the builder's after it), whether a MiCS-style subgroup counts
into the World's ledger with the World's deadline and counter and is made once, whether the code
outside an engine (Init, GatheredParameters on a plain parameter) uses the current World's Comm,
and that destroying the default group forgets the World.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_world

WORLD = 2


def _probe(rank, world):
    import zeroshard
    from zeroshard.dist.groups import blocks
    from zeroshard.dist.steps import PROCESS_STEPS
    from zeroshard.dist.world import World

    out = {}
    lazy = World.current()
    out["lazy_is_current"] = World.current() is lazy
    out["lazy_watched"] = lazy.comm.watch is not None
    out["lazy_steps_are_the_process_counter"] = lazy.comm.steps is PROCESS_STEPS

    plain = torch.nn.Parameter(torch.full((4,), float(rank)))
    with zeroshard.GatheredParameters([plain], modifier_rank=0):
        pass
    out["plain_broadcast_in_lazy_ledger"] = lazy.comm.report()["broadcast"]

    built = World.build(30.0)
    out["built_is_current"] = World.current() is built and built is not lazy
    out["built_watch_timeout"] = built.comm.watch.timeout_s
    out["built_ledger_fresh"] = built.comm.report()["total"]
    part = built.split(blocks(world, 1))  # each rank alone: made on every rank, in order
    out["part_made_once"] = built.split(blocks(world, 1)) is part
    out["part_shares"] = {"ledger": part.ledger is built.ledger,
                          "steps": part.steps is built.steps,
                          "watched": part.watch is not None}  # one rank: nothing to watch
    pair = built.split([[0, 1]])
    out["pair_watch_timeout"] = pair.watch.timeout_s
    out["pair_watch_steps"] = pair.watch.steps is built.steps
    before = built.comm.report()["all_reduce"]
    pair.all_reduce(torch.ones(8))
    out["pair_bytes_in_world_ledger"] = built.comm.report()["all_reduce"] - before
    out["lazy_ledger_untouched"] = lazy.comm.report()["all_reduce"]

    with zeroshard.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}) as init:
        torch.nn.Linear(3, 3)
    out["init_uses_current"] = init.comm is built.comm

    dist.destroy_process_group()
    try:
        World.current()
        out["after_destroy"] = "a World"
    except RuntimeError as err:
        out["after_destroy"] = str(err)
    return out


@pytest.fixture(scope="module")
def results():
    """Every rank's observations, in one world."""
    return run_world(WORLD, _probe)


def test_current_is_made_once_lazily_then_the_builders(results):
    for got in results:
        assert got["lazy_is_current"] and got["built_is_current"], got
        assert not got["lazy_watched"]  # a plain world: no deadline configured
        assert got["lazy_steps_are_the_process_counter"]
        assert got["built_ledger_fresh"] == 0  # an engine's report starts at its build
        assert got["init_uses_current"]


def test_code_outside_an_engine_counts_in_the_current_world(results):
    for got in results:
        # GatheredParameters on a parameter no engine manages: a 16-byte broadcast (N-1)/N.
        assert got["plain_broadcast_in_lazy_ledger"] == 8, got


def test_subgroups_get_the_worlds_ledger_deadline_and_counter_at_construction(results):
    for got in results:
        assert got["part_made_once"]
        assert got["part_shares"]["ledger"] and got["part_shares"]["steps"]
        assert not got["part_shares"]["watched"]
        assert (got["pair_watch_timeout"], got["pair_watch_steps"]) == (30.0, True)
        assert got["pair_bytes_in_world_ledger"] == 32  # 32 bytes, twice x (N-1)/N
        assert got["lazy_ledger_untouched"] == 0


def test_destroying_the_group_forgets_the_world(results):
    for got in results:
        assert "no process group" in got["after_destroy"], got["after_destroy"]
