"""ZeRO++ hpZ (zero_hpz_partition_size): bitwise equal to plain stage 3, backward gathers inside
the host, secondary shards in the memory ledger, clear errors for bad values. MiCS
(mics_shard_size): equal to the single-process reference, parameter and gradient collectives
inside the shard group.

One world of 4 gloo ranks laid out as 2 hosts x 2 ranks (LOCAL_WORLD_SIZE=2, as torchrun sets it)
runs every case; hpZ uses P = 2 and MiCS S = 2, the ranks of one host.
"""

from __future__ import annotations

import os

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice, reference_run
from tests.test_stages import _rel_error

WORLD = 4
PER_HOST = 2
STEPS = 4
MICRO = 2
LEAN = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0}
PREFETCH = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1000,
            "stage3_max_live_parameters": 1600, "stage3_max_reuse_distance": 600}
#: (name, gradient accumulation steps, stage-3 knobs, model options, bf16)
CASES = [("prefetch_gas3", 3, PREFETCH, {}, False),
         ("lean_ckpt_reentrant", 1, LEAN, {"checkpoint": "reentrant"}, False),
         ("bf16_gas2", 2, PREFETCH, {}, True)]


def _config(gas, zero, hpz=1, bf16=False, stage=3, mics=-1):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "gradient_clipping": 0.05,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, **zero}}
    if hpz != 1:
        cfg["zero_optimization"]["zero_hpz_partition_size"] = hpz
    if mics != -1:
        cfg["zero_optimization"]["mics_shard_size"] = mics
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _sgd(params):
    """SGD with momentum: scale-sensitive, so a wrong gradient average shows up directly."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _engine(gas, zero, hpz, bf16=False, seed=0, mics=-1, optimizer=None, **model_options):
    model = make_model(seed, **model_options)
    make = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-2))
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=make(model.parameters()),
        config=_config(gas, zero, hpz, bf16, mics=mics))
    return engine, model


def _train(engine, batches, rank, gas):
    for batch in batches:
        for micro in range(gas):
            tokens, targets = micro_slice(batch, micro, rank, WORLD, MICRO)
            engine.backward(lm_loss(engine(tokens), targets))
            engine.step()


def _final(engine, model) -> dict[str, torch.Tensor]:
    engine.destroy()  # leaves the model whole
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _equality_case(rank, name, gas, zero, options, bf16, root):
    """Plain stage 3 for STEPS steps vs hpZ for half of them, a checkpoint round trip into a
    fresh hpZ engine built from other weights, then the rest: bitwise equal parameters."""
    batches = make_batches(STEPS, MICRO * gas * WORLD)
    plain, model = _engine(gas, zero, 1, bf16, **options)
    _train(plain, batches, rank, gas)
    want = _final(plain, model)
    hpz, _ = _engine(gas, zero, PER_HOST, bf16, **options)
    _train(hpz, batches[:STEPS // 2], rank, gas)
    held = hpz.optimizer.policy.gather.secondary_bytes()  # dropped by the step
    hpz.save_checkpoint(os.path.join(root, name))
    hpz.destroy()
    resumed, model = _engine(gas, zero, PER_HOST, bf16, seed=5, **options)
    resumed.load_checkpoint(os.path.join(root, name))
    _train(resumed, batches[STEPS // 2:], rank, gas)
    got = _final(resumed, model)
    init = dict(make_model().named_parameters())
    return {"equal": all(torch.equal(want[n], got[n]) for n in want), "held_after_step": held,
            "moved": all(not torch.equal(want[n], init[n].float()) for n in want
                         if n != "unused")}


def _per_phase(engine, tokens, targets):
    """Ledger counts of one forward, one backward and one step: per kind, total and inter-host."""
    comm = engine.comm
    out = {}
    for phase, run in (("forward", None), ("backward", None), ("step", None)):
        comm.reset()
        if phase == "forward":
            loss = lm_loss(engine(tokens), targets)
            policy = engine.optimizer.policy
            out["memory_after_forward"] = engine.memory_report()["params"]["device"]
            out["secondary_after_forward"] = getattr(getattr(policy, "gather", None),
                                                     "secondary_bytes", lambda: 0)()
        elif phase == "backward":
            engine.backward(loss)
        else:
            engine.step()
            out["memory_after_step"] = engine.memory_report()["params"]["device"]
        out[phase] = {"all_gather": comm.bytes.get("all_gather", 0),
                      "all_gather_inter": comm.inter_host_bytes.get("all_gather", 0),
                      **comm.report()}
    return out


def _ledger_case(rank):
    """One step (gradient accumulation 1, lean schedule) with and without hpZ, phase by phase."""
    tokens, targets = micro_slice(make_batches(1, MICRO * WORLD)[0], 0, rank, WORLD, MICRO)
    out = {}
    for hpz in (1, PER_HOST):
        engine, _ = _engine(1, LEAN, hpz)
        policy = engine.optimizer.policy
        out[hpz] = _per_phase(engine, tokens, targets)
        out[hpz]["expected_secondary"] = sum(
            policy.by_index[i].padded_numel // PER_HOST * 4 for i in policy.sharded)
        # Every sharded unit gathered once over the world (fp32): 3/4 of it per rank, half of
        # that over the ring's hops between hosts.
        out[hpz]["world_once_inter"] = sum(
            policy.by_index[i].padded_numel * 4 * 3 // 4 // 2 for i in policy.sharded)
        out[hpz]["gas2_second_forward_inter"] = _second_forward_inter(hpz, tokens, targets)
        engine.destroy()
    return out


def _second_forward_inter(hpz, tokens, targets):
    """Under gradient accumulation, the inter-host all-gather bytes of the second forward."""
    engine, _ = _engine(2, LEAN, hpz)
    engine.backward(lm_loss(engine(tokens), targets))
    engine.step()
    engine.comm.reset()
    engine.backward(lm_loss(engine(tokens), targets))
    inter = engine.comm.inter_host_bytes.get("all_gather", 0)
    engine.step()
    engine.destroy()
    return inter


def _error_case(rank):
    out = {}
    for name, gas_cfg in (("not_dividing", _config(1, LEAN, hpz=3)),
                          ("stage2", _config(1, {}, hpz=2, stage=2)),
                          ("offload", _config(1, {**LEAN, "offload_param": {"device": "cpu"}},
                                              hpz=2)),
                          ("mics_not_dividing", _config(1, LEAN, mics=3)),
                          ("mics_stage2", _config(1, {}, stage=2, mics=2)),
                          ("mics_with_hpz", _config(1, LEAN, hpz=2, mics=2))):
        model = make_model()
        try:
            zeroshard.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 config=gas_cfg)
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    # Groups of 4 span both hosts of 2: it runs, and rank 0 warns that backward gathers cross.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _ = _engine(1, LEAN, WORLD)
    out["spanning"] = [str(w.message) for w in caught
                       if "zero_hpz_partition_size" in str(w.message)]
    engine.destroy()
    return out


def _mics_case(rank, root):
    """MiCS S=2 with accumulation, clipping and a checkpoint round trip against the reference;
    the ledger of the last step; replicas built from different weights start from rank 0's."""
    gas = 2
    batches = make_batches(STEPS, MICRO * gas * WORLD)
    ref = reference_run(lambda m: _sgd(m.parameters()), batches, 0.05)
    # Each rank builds its model from other weights: replicas must start from rank 0's.
    first, _ = _engine(gas, PREFETCH, 1, mics=PER_HOST, seed=rank, optimizer=_sgd)
    _train(first, batches[:STEPS // 2], rank, gas)
    first.save_checkpoint(os.path.join(root, "mics"))
    first.destroy()
    engine, model = _engine(gas, PREFETCH, 1, mics=PER_HOST, seed=5, optimizer=_sgd)
    engine.load_checkpoint(os.path.join(root, "mics"))
    _train(engine, batches[STEPS // 2:-1], rank, gas)
    engine.comm.reset()
    _train(engine, batches[-1:], rank, gas)
    comm = engine.comm
    out = {"shard_world": engine.optimizer.comm.world_size,
           "ledger": {k: (comm.bytes.get(k, 0), comm.inter_host_bytes.get(k, 0))
                      for k in ("all_gather", "reduce_scatter", "all_reduce")}}
    engine.destroy()
    out["error"] = _rel_error(model, ref)
    return out


def _all_cases(rank, world, root):
    assert os.environ["LOCAL_WORLD_SIZE"] == str(PER_HOST)
    return {"equal": {c[0]: _equality_case(rank, *c, root) for c in CASES},
            "ledger": _ledger_case(rank), "errors": _error_case(rank),
            "mics": _mics_case(rank, root)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's per-rank results from one world of 2 hosts x 2 ranks."""
    root = str(tmp_path_factory.mktemp("hpz_ckpt"))
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_HOST)  # the ranks inherit it: 2 simulated hosts
    try:
        return run_world(WORLD, _all_cases, root)
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_hpz_bitwise_equal_to_stage3_through_a_checkpoint(results, case):
    for rank, res in enumerate(results):
        got = res["equal"][case]
        assert got["equal"], f"rank {rank}: hpZ parameters differ from plain stage 3 ({case})"
        assert got["moved"]
        assert got["held_after_step"] == 0, "secondary shards outlived the optimizer step"


def test_backward_all_gathers_stay_inside_the_host(results):
    for rank, res in enumerate(results):
        plain, hpz = res["ledger"][1], res["ledger"][PER_HOST]
        # Forward: each unit gathered over the world once, half of the ring's hops crossing
        # hosts (plain stage 3 gathers the tied embedding twice: for the embedding and the head;
        # hpZ gathers it the second time from the secondary shards).
        assert hpz["forward"]["all_gather_inter"] == hpz["world_once_inter"] > 0
        assert plain["forward"]["all_gather_inter"] > hpz["world_once_inter"]
        # Backward: within the host only; the ring of 2 moves 1/2 of a unit instead of 3/4.
        assert plain["backward"]["all_gather_inter"] > 0
        assert hpz["backward"]["all_gather_inter"] == 0
        assert 3 * hpz["backward"]["all_gather"] == 2 * plain["backward"]["all_gather"] > 0
        # Gradients still cross: the reduce-scatters are the same.
        assert hpz["backward"]["reduce_scatter"] == plain["backward"]["reduce_scatter"]
        assert hpz["backward"]["inter_host"] == plain["backward"]["inter_host"] - \
            plain["backward"]["all_gather_inter"]
        per_step = sum(hpz[p]["all_gather_inter"] for p in ("forward", "backward", "step"))
        assert per_step == hpz["forward"]["all_gather_inter"]
        # A second micro-step's forward gathers from the secondary shards too.
        assert res["ledger"][PER_HOST]["gas2_second_forward_inter"] == 0
        assert res["ledger"][1]["gas2_second_forward_inter"] > 0


def test_secondary_shards_in_the_memory_ledger(results):
    for res in results:
        plain, hpz = res["ledger"][1], res["ledger"][PER_HOST]
        expected = hpz["expected_secondary"]
        assert hpz["secondary_after_forward"] == expected > 0
        assert hpz["memory_after_forward"] - plain["memory_after_forward"] == expected
        assert hpz["memory_after_step"] == plain["memory_after_step"]


def test_bad_hpz_values_are_clear_errors(results):
    errors = results[0]["errors"]
    assert "zero_hpz_partition_size=3 must divide the world size 4" in errors["not_dividing"]
    assert "zero_hpz_partition_size=2 needs ZeRO stage 3" in errors["stage2"]
    assert "offload_param" in errors["offload"]
    assert "mics_shard_size=3 must divide the world size 4" in errors["mics_not_dividing"]
    assert "mics_shard_size=2 needs ZeRO stage 3" in errors["mics_stage2"]
    assert "zero_hpz_partition_size > 1 (hpZ) is not supported" in errors["mics_with_hpz"]
    assert len(errors["spanning"]) == 1 and "span hosts of 2 ranks" in errors["spanning"][0]
    assert all(not res["errors"]["spanning"] for res in results[1:])  # said once, by rank 0


def test_hpz_and_mics_keys_no_longer_warn_as_inert(recwarn):
    from zeroshard.config.schema import load_config

    load_config(_config(1, {}, hpz=2, mics=2), world_size=4)
    assert not [w for w in recwarn if "zero_hpz_partition_size" in str(w.message)
                or "mics_shard_size" in str(w.message)]


# -- estimate and plan ---------------------------------------------------------------------------

def test_estimate_counts_the_secondary_shards():
    from zeroshard.estimate import estimate
    from zeroshard.sizing.hierarchy import hpz_row, inter_node_bytes

    est = estimate(7.5e9, gpus=64, gpus_per_node=8, precision="bf16")
    plain = est.row(3)
    row = hpz_row(plain, est.params, 64, 2, 8)
    assert row.states["params"]["device"] - plain.states["params"]["device"] == 2 * 7.5e9 / 8
    # Inter-node bytes per GPU: stage 3's 3 Psi p (N-1)/N / G falls to stage 2's 2 Psi p (N-1)/N/G.
    assert inter_node_bytes(row, est.params, 64, 8, 2) == \
        pytest.approx(inter_node_bytes(est.row(2), est.params, 64, 8, 2))
    assert inter_node_bytes(plain, est.params, 64, 8, 2) == \
        pytest.approx(3 * 7.5e9 * 2 * 63 / 64 / 8)


def test_estimate_matches_the_measured_secondary_shards(results):
    """The measured secondary bytes (fp32 TinyLM, P=2) equal Psi x 4 / 2 up to padding."""
    from zeroshard.estimate import estimate
    from zeroshard.sizing.hierarchy import hpz_row

    psi = sum(p.numel() for p in make_model().parameters())
    est = estimate(psi, gpus=WORLD, gpus_per_node=PER_HOST, precision="fp32")
    row = hpz_row(est.row(3), psi, WORLD, 4, PER_HOST)
    predicted = row.states["params"]["device"] - est.row(3).states["params"]["device"]
    measured = results[0]["ledger"][PER_HOST]["expected_secondary"]
    assert 0 <= measured - predicted <= 4 * 16 * WORLD * 8  # padding: < 64 elements per unit


def test_cli_estimate_hpz_row():
    from zeroshard.cli import main as cli_main
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["estimate", "--params", "7.5e9", "--gpus", "64", "--gpus-per-node", "8",
                         "--precision", "bf16", "--hpz", "8"]) == 0
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.getvalue().splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["stage 3 + hpZ 8"][0] == "2.11"  # 0.234 primary + 1.875 secondary
    assert rows["stage 3 + hpZ 8"][-1] == rows["stage 2"][-1] == "3.69"  # inter-node GB
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["estimate", "--params", "7.5e9", "--gpus", "64", "--gpus-per-node", "8",
                         "--precision", "bf16", "--hpz", "8", "--qwz", "--qgz"]) == 0
    row = [line.split("|")[2:-1] for line in out.getvalue().splitlines()
           if line.startswith("| stage 3 + hpZ 8 + qwZ + qgZ |")][0]
    # Secondary shards of packed int8 rows: 7.5e9 x (1 + 4/256) / 8 bytes (+ 0.234 primary).
    assert float(row[0]) == pytest.approx(0.234 + 7.5e9 * 1.015625 / 8 / 1e9, abs=0.01)
    # Inter-node: the forward gather at 1.016 bytes, 1/8 of it across nodes, and 7 of 64
    # slots of the gradient at 1.0625 bytes: 0.94 + 0.87 GB (stage 3 alone: 5.54).
    expected = 7.5e9 * (1.015625 * 63 / 64 / 8 + 7 / 64 * 1.0625) / 1e9
    assert float(row[-1]) == pytest.approx(expected, rel=0.01)


def test_plan_picks_hpz_on_a_slow_inter_node_link():
    from zeroshard.estimate import GB
    from zeroshard.sizing.plan import plan

    slow = plan("30B", gpu_mem=40 * GB, gpus=32, gpus_per_node=8, inter_node_gbps=200)
    assert slow.choice.row.stage == 3 and slow.choice.row.hpz == 8
    assert slow.config["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert "inter-node link is slow" in slow.report() and "7.5 GB more per GPU" in slow.report()
    # qwZ / qgZ are named with what they would save, but not chosen: they quantize.
    assert "adding qwZ + qgZ" in slow.report()
    assert "zero_quantized_weights" not in slow.config["zero_optimization"]
    zeroshard.load_config(slow.config, world_size=32)
    fast = plan("30B", gpu_mem=40 * GB, gpus=32, gpus_per_node=8, inter_node_gbps=3200)
    assert fast.choice.row.hpz == 1 and "hpZ not needed" in fast.report()
    assert "zero_hpz_partition_size" not in fast.config["zero_optimization"]
    # No room for the secondary shards: plain stage 3, and the report says why.
    tight = plan("30B", gpu_mem=25 * GB, gpus=32, gpus_per_node=8, inter_node_gbps=200)
    assert tight.choice.row.hpz == 1 and "do not fit" in tight.report()
    # Without the bandwidth plan says nothing about hpZ.
    assert plan("30B", gpu_mem=40 * GB, gpus=32, gpus_per_node=8).choice.row.hpz == 1


def test_mics_equals_the_reference_through_a_checkpoint(results):
    """fp32 parameters within 1e-5 relative of one process on the same global batches (the
    suite's stage-3 tolerance), though every rank built its model from other weights."""
    for rank, res in enumerate(results):
        got = res["mics"]
        assert got["shard_world"] == PER_HOST
        assert got["error"] < 1e-5, f"rank {rank}: relative error {got['error']:.2e}"


def test_mics_keeps_parameter_and_gradient_shards_inside_the_host(results):
    for res in results:
        ledger = res["mics"]["ledger"]
        assert ledger["all_gather"][0] > 0 and ledger["all_gather"][1] == 0
        assert ledger["reduce_scatter"][0] > 0 and ledger["reduce_scatter"][1] == 0
        # The replica all-reduce of the gradient shards crosses hosts; the gradient norm's
        # scalar all-reduce (float64) stays in the shard group.
        total, inter = ledger["all_reduce"]
        assert inter > 0 and total - inter == 8
