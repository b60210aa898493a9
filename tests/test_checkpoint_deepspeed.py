"""DeepSpeed checkpoints both ways, against files written by REAL DeepSpeed 0.19.8
(`tests/fixtures/deepspeed_0_19_8/`, see `make_deepspeed_ckpt.py`: 2 ranks, stages 0-3, fp32 /
bf16 (BF16_Optimizer) / fp16, two AdamW param groups, WarmupDecayLR, client_state; DeepSpeed's own
view of the masters and Adam state at save time, and its losses for M more steps).

- `engine.load_checkpoint(<DeepSpeed dir>)` at world 2 and 4, into the same and other zeroshard
  stages (one with the optimizer offloaded to the CPU): fp32 masters, exp_avg, exp_avg_sq bitwise as DeepSpeed held them; step, counters, lr,
  LR scheduler, fp16 loss scaler, DeepSpeed's client_state; then the next M losses as DeepSpeed's
  (bitwise at 2 ranks in fp32 and fp16; within rounding at 4 ranks or in bf16);
- `zeroshard convert --from deepspeed` then `--to deepspeed` gives DeepSpeed's tensors back, and a
  checkpoint zeroshard saved itself converts to DeepSpeed's layout at other world sizes;
- `zero_to_fp32.py` (written into every save) and bad input: clear errors, nothing written.

That real DeepSpeed loads and continues from `convert --to deepspeed` output is checked by hand
with `tests/fixtures/check_deepspeed_load.py` (docs/guides/checkpoints.md).
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys

import pytest
import torch

from tests.fixtures.make_deepspeed_ckpt import (CASES, CLIENT, K, M, ROOT, config, make_net,
                                                make_optimizer, mean_over_ranks, train_step)
from tests.harness import run_world

#: (fixture case, zeroshard stage) resumed at each world size; "3+cpu": optimizer offload
PLAN = {2: [("s0_fp32", 0), ("s1_bf16", 1), ("s2_fp32", 2), ("s2_fp32", 3), ("s2_fp16", 2),
            ("s3_fp32", "3+cpu"), ("s3_fp32", 1)],
        4: [("s0_fp32", 2), ("s1_bf16", 3), ("s2_fp32", 3), ("s2_fp16", 1), ("s3_fp32", 2)]}


def _expected(case):
    root = os.path.join(ROOT, case)
    with open(os.path.join(root, "expected.json")) as fh:
        return torch.load(os.path.join(root, "expected.pt"), weights_only=True), json.load(fh)


def _engine(case, stage, world, seed=99, **overrides):
    """A fresh engine for `case` at zeroshard `stage`, its weights scrambled (the load must win)."""
    import zeroshard

    precision = CASES[case][1]
    cfg = config(int(str(stage)[0]), precision, world)
    cfg.pop("data_types", None)  # DeepSpeed's BF16_Optimizer switch; inert here
    if str(stage).endswith("+cpu"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg.update(overrides)
    model = make_net()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=make_optimizer(model),
                                           config=cfg)
    return engine


def _state(engine):
    """Every parameter's whole fp32 master and optimizer state, gathered from the shards (as
    make_ckpt_v1.full_state, with offloaded shards copied to the compute device first)."""
    from zeroshard.dist.hostmem import to_device

    opt = engine.optimizer
    masters, optim = {}, {}
    for unit in opt.units:
        master, state = opt.placement.tensors(unit)

        def whole(t):
            t = to_device(t.detach().float(), opt.device)
            if not opt.policy.shards_optimizer:
                return t.clone()
            out = torch.empty(unit.padded_numel, dtype=t.dtype, device=t.device)
            opt.comm.all_gather(out, t.contiguous())
            return out

        full = whole(master)
        tensors = {k: whole(v) for k, v in state.items()
                   if torch.is_tensor(v) and v.dim() > 0 and v.shape == master.shape}
        scalars = {k: (v.detach().clone() if torch.is_tensor(v) else v)
                   for k, v in state.items() if k not in tensors}
        for slot in unit.slots:
            cut = slice(slot.offset, slot.offset + slot.numel)
            masters[slot.name] = full[cut].view(slot.shape).clone()
            optim[slot.name] = {**{k: v[cut].view(slot.shape).clone() for k, v in tensors.items()},
                                **scalars}
    return masters, optim


def _resume(rank, world, save_root):
    """Per planned case: what the engine holds after loading DeepSpeed's files, and after M steps."""
    out = {}
    for case, stage in PLAN[world]:
        engine = _engine(case, stage, world)
        path, client = engine.load_checkpoint(os.path.join(ROOT, case))
        masters, optim = _state(engine)
        got = {"path": path, "client": client, "masters": masters, "optim": optim,
               "counters": {k: getattr(engine, k) for k in
                            ("global_steps", "global_samples", "skipped_steps", "micro_steps")},
               "lr": engine.get_lr(), "scheduler": engine.lr_scheduler.state_dict(),
               "scale": engine.scaler.scale, "hysteresis": engine.scaler.hysteresis_left,
               "buffers": {n: b.clone() for n, b in engine.module.named_buffers()}}
        got["losses"] = [mean_over_ranks(train_step(engine, s, rank, world))
                         for s in range(K, K + M)]
        got["final"], _ = _state(engine)
        got["final_skipped"] = engine.skipped_steps
        if (case, stage, world) == ("s2_fp32", 3, 2):  # zeroshard's own save, for test_convert_*
            engine.save_checkpoint(save_root, client_state={"after": "zeroshard"})
            got["saved_final"] = got["final"]
        engine.destroy()
        out[(case, stage)] = got
    if world == 2:
        out["options"] = _options(rank, world)
        out["errors"] = _errors(rank, world, save_root)
    return out


def _options(rank, world):
    """load_optimizer_states=False / load_module_only=True / a ZeRO-3 load keeping the scheduler."""
    out = {}
    for name, kwargs in (("weights", {"load_optimizer_states": False}),
                         ("module_only", {"load_module_only": True}),
                         ("no_scheduler", {"load_lr_scheduler_states": False})):
        engine = _engine("s2_fp32", 3, world)
        _, client = engine.load_checkpoint(os.path.join(ROOT, "s2_fp32"), **kwargs)
        masters, optim = _state(engine)
        out[name] = {"masters": masters, "state": any(len(o) for o in optim.values()),
                     "steps": engine.global_steps, "client": sorted(client),
                     "scheduler": engine.lr_scheduler.state_dict()}
        engine.destroy()
    return out


def _errors(rank, world, root):
    """What each bad load raised (every rank alike), and that the engine kept its weights."""
    from zeroshard.checkpoint import CheckpointError

    out = {}
    scratch = os.path.join(root, "bad")
    if rank == 0:
        os.makedirs(os.path.join(scratch, "neither", "global_step4"))
        with open(os.path.join(scratch, "neither", "global_step4", "notes.txt"), "w") as fh:
            fh.write("x")
        with open(os.path.join(scratch, "neither", "latest"), "w") as fh:
            fh.write("global_step4")
        shutil.copytree(os.path.join(ROOT, "s2_fp32"), os.path.join(scratch, "torn"))
        os.remove(os.path.join(scratch, "torn", "global_step4",
                               "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    torch.distributed.barrier()
    cases = {"neither": (os.path.join(scratch, "neither"), {}),
             "torn": (os.path.join(scratch, "torn"), {}),
             "one_group": (os.path.join(ROOT, "s2_fp32"), {"groups": 1}),
             "one_group_s0": (os.path.join(ROOT, "s0_fp32"), {"groups": 1}),
             "other_model": (os.path.join(ROOT, "s2_fp32"), {"wide": True})}
    for name, (path, how) in cases.items():
        import zeroshard

        cfg = config(2, "fp32", world)
        model = make_net()
        if how.get("wide"):
            model.out = torch.nn.Linear(11, 4)
        opt = make_optimizer(model) if not how.get("groups") else \
            torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, _, _, _ = zeroshard.initialize(model=model, optimizer=opt, config=cfg)
        before, _ = _state(engine)
        try:
            engine.load_checkpoint(path)
            out[name] = None
        except CheckpointError as err:
            out[name] = str(err)
        after, _ = _state(engine)
        out[f"{name}_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
        if name.startswith("one_group"):  # the weights alone still load
            engine.load_checkpoint(path, load_optimizer_states=False)
            out[f"{name}_weights"], _ = _state(engine)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zs_saved"))


@pytest.fixture(scope="module")
def world2(saved):
    if not os.path.isdir(ROOT):
        pytest.fail(f"{ROOT} is missing: it is committed with the repository")
    return run_world(2, _resume, saved)


@pytest.fixture(scope="module")
def world4(saved):
    return run_world(4, _resume, os.path.join(saved, "w4"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("world", [2, 4])
def test_loads_deepspeed_state_bitwise_at_any_world_and_stage(world, request):
    results = request.getfixturevalue(f"world{world}")
    for case, stage in PLAN[world]:
        expected, meta = _expected(case)
        for rank, result in enumerate(results):
            got = result[(case, stage)]
            where = f"{case} -> zeroshard stage {stage}, world {world}, rank {rank}"
            assert got["path"] == os.path.join(ROOT, case, meta["tag"]), where
            for name, value in expected["master"].items():
                assert torch.equal(got["masters"][name], value), (where, name)
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(got["optim"][name][key], expected[key][name]), \
                        (where, name, key)
                applied = meta["counters"]["global_steps"] - meta["counters"]["skipped_steps"]
                assert float(got["optim"][name]["step"]) == applied, (where, name)
            for name, value in expected["buffers"].items():
                assert torch.equal(got["buffers"][name].to(value.dtype), value), where
            assert {k: got["counters"][k] for k in meta["counters"]} == meta["counters"], where
            assert got["counters"]["micro_steps"] == meta["counters"]["global_steps"]
            assert got["lr"] == meta["lr"] and got["scheduler"] == meta["lr_scheduler"], where
            # DeepSpeed's client_state: the model states' keys it does not consume itself
            assert {k: got["client"][k] for k in CLIENT} == CLIENT, where
            assert got["client"]["ds_version"] == "0.19.8" and "module" not in got["client"]
            if meta["scaler"] is not None:
                assert got["scale"] == meta["scaler"]["cur_scale"], where
                assert got["hysteresis"] == meta["scaler"]["cur_hysteresis"], where


#: relative tolerance of the continuation losses / absolute one of the final weights
TOLERANCE = {"fp32": (1e-6, 1e-6), "fp16": (1e-3, 1e-4), "bf16": (2e-3, 1e-3)}


@pytest.mark.parametrize("world", [2, 4])
def test_continues_with_deepspeeds_losses(world, request):
    results = request.getfixturevalue(f"world{world}")
    for case, stage in PLAN[world]:
        expected, meta = _expected(case)
        precision = CASES[case][1]
        loss_tol, weight_tol = TOLERANCE[precision]
        got = results[0][(case, stage)]
        where = f"{case} -> zeroshard stage {stage}, world {world}"
        if world == 2 and precision in ("fp32", "fp16"):  # the same reduction order: bitwise
            assert got["losses"] == meta["losses"], where
        for mine, theirs in zip(got["losses"], meta["losses"]):
            assert _rel(mine, theirs) < loss_tol, (where, got["losses"], meta["losses"])
        for name, value in expected["final"].items():
            assert torch.allclose(got["final"][name], value, rtol=0, atol=weight_tol), \
                (where, name, (got["final"][name] - value).abs().max())
        assert got["final_skipped"] == meta["final_counters"]["skipped_steps"], where


def test_load_options(world2):
    expected, meta = _expected("s2_fp32")
    got = world2[0]["options"]
    for name in ("weights", "module_only", "no_scheduler"):
        for param, value in expected["master"].items():
            assert torch.equal(got[name]["masters"][param], value), (name, param)
    assert not got["weights"]["state"] and got["weights"]["steps"] == K
    assert "optimizer" in got["weights"]["client"]  # DeepSpeed hands it back when not loaded
    assert not got["module_only"]["state"] and got["module_only"]["steps"] == 0
    assert got["no_scheduler"]["state"] and \
        got["no_scheduler"]["scheduler"] == {"last_batch_iteration": -1}
    assert "lr_scheduler" in got["no_scheduler"]["client"]


def test_bad_loads_are_clear_errors_and_change_nothing(world2):
    expected, _ = _expected("s2_fp32")
    for result in world2:
        got = result["errors"]
        for name in ("neither", "torn", "one_group", "one_group_s0", "other_model"):
            assert got[name] is not None and got[f"{name}_unchanged"], (name, got[name])
        assert "neither a zeroshard checkpoint" in got["neither"] and "notes.txt" in got["neither"]
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in got["torn"]
        assert "2 optimizer param groups in the checkpoint, 1 here" in got["one_group"]
        assert "load_optimizer_states=False" in got["one_group"]
        assert "has shape [3" in got["other_model"] and "in the checkpoint but [4" in \
            got["other_model"]
        assert got["neither"].startswith("ranks 0-1: ")  # every rank saw it, every rank raised
        assert "has 2 param groups of [3, 3] parameters, this optimizer 1 of [6]" in \
            got["one_group_s0"] and "load_optimizer_states=False" in got["one_group_s0"]
        for param, value in expected["master"].items():
            assert torch.equal(got["one_group_weights"][param], value)
        for param, value in _expected("s0_fp32")[0]["master"].items():
            assert torch.equal(got["one_group_s0_weights"][param], value)


# -- convert, zero_to_fp32.py, refusals: one process ------------------------------------------------

def _tensors(obj, path=""):
    """Every tensor in a nested DeepSpeed state, by its path (DeepSpeed objects by attribute)."""
    from zeroshard.checkpoint.deepspeed_pickle import DeepSpeedObject

    if torch.is_tensor(obj):
        return {path: obj}
    if isinstance(obj, DeepSpeedObject):
        obj = vars(obj)
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out = {}
    for key, value in items:
        out.update(_tensors(value, f"{path}/{key}"))
    return out


def _cli(*argv) -> tuple[int, str]:
    import contextlib
    import io

    from zeroshard.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.mark.parametrize("case", ["s1_bf16", "s2_fp32", "s2_fp16", "s3_fp32"])
def test_convert_round_trip_gives_deepspeeds_tensors(case, tmp_path):
    from zeroshard.checkpoint.deepspeed_pickle import load
    from zeroshard.checkpoint.deepspeed_read import DeepSpeedCheckpoint

    stage, precision = CASES[case]
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(config(stage, precision)))
    assert _cli("convert", "--from", "deepspeed", os.path.join(ROOT, case),
                str(tmp_path / "zs"))[0] == 0
    assert _cli("convert", "--to", "deepspeed", str(tmp_path / "zs"), str(tmp_path / "ds"),
                "--config", str(cfg))[0] == 0
    assert sorted(os.listdir(tmp_path / "ds")) == ["global_step4", "latest", "zero_to_fp32.py"]
    original = os.path.join(ROOT, case, "global_step4")
    again = str(tmp_path / "ds" / "global_step4")
    assert sorted(os.listdir(again)) == sorted(f for f in os.listdir(original))
    a, b = DeepSpeedCheckpoint(original), DeepSpeedCheckpoint(again)
    keys = [f"model.{n}" for n in a.params] + [f"buffer.{n}" for n in a.buffers] + \
        [f"optim.{k}.{n}" for n in a.params for k in ("exp_avg", "exp_avg_sq")]
    for key in keys:
        assert torch.equal(a.tensor(key), b.tensor(key)), key
    assert (a.counters, a.lr_scheduler, a.client_state, a.groups, a.scaler) == \
        (b.counters, b.lr_scheduler, b.client_state, b.groups, b.scaler)
    for name in os.listdir(original):  # file by file: every tensor DeepSpeed wrote, bitwise
        mine, theirs = _tensors(load(os.path.join(again, name))), \
            _tensors(load(os.path.join(original, name)))
        if case == "s1_bf16":  # BF16_Optimizer keeps its partitions padded; the ZeRO layout
            theirs = {k: v for k, v in theirs.items()  # written back strips them
                      if "single_partition_of_fp32_groups" not in k}
            mine = {k: v for k, v in mine.items() if "single_partition_of_fp32_groups" not in k}
        assert sorted(mine) == sorted(theirs), name
        for key, value in theirs.items():
            if "fp32_flat_groups" in key:  # stage 3 leaves its padding uninitialized
                continue
            assert mine[key].dtype == value.dtype and torch.equal(mine[key], value), (name, key)


def test_convert_zeroshard_save_to_deepspeed_at_other_world_sizes(world2, saved, tmp_path):
    from zeroshard.checkpoint.deepspeed_read import DeepSpeedCheckpoint
    from zeroshard.checkpoint.portable import ZeroshardCheckpoint

    final = world2[0][("s2_fp32", 3)]["saved_final"]
    source = ZeroshardCheckpoint(os.path.join(saved, f"global_step{K + M}"))
    for world, stage, dtype in ((4, 1, "fp32"), (3, 3, "fp32"), (1, 2, "bf16"), (2, 0, "fp32")):
        out = tmp_path / f"ds{world}{stage}"
        code, err = _cli("convert", "--to", "deepspeed", saved, str(out), "--world-size",
                         str(world), "--stage", str(stage), "--dtype", dtype)
        assert code == 0, err
        ds = DeepSpeedCheckpoint(str(out / f"global_step{K + M}"),
                                 group_names=source.group_names())
        assert (ds.world_size, ds.stage) == (world, stage)
        assert ds.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
        for name, value in final.items():
            assert torch.equal(ds.tensor(f"model.{name}"), value), (world, stage, name)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ds.tensor(f"optim.{key}.{name}"),
                                   source.tensor(f"optim.{key}.{name}")), (world, stage, key)
        assert ds.counters == {"global_steps": K + M, "global_samples": (K + M) * 8,
                               "skipped_steps": 0}
        assert ds.client_state == {"after": "zeroshard"}
        assert ds.lr_scheduler == {"last_batch_iteration": K + M - 1}


def test_zero_to_fp32_script_is_written_and_reads_both_formats(world2, saved, tmp_path):
    from zeroshard.checkpoint.recovery import main
    from zeroshard.checkpoint.recovery_script import SCRIPT
    from safetensors.torch import load_file

    final = world2[0][("s2_fp32", 3)]["saved_final"]
    script = os.path.join(saved, "zero_to_fp32.py")
    assert open(script).read() == SCRIPT and os.access(script, os.X_OK)
    argv = sys.argv
    try:  # the script as `python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR` runs it
        sys.argv = [script, saved, str(tmp_path / "bin")]
        with pytest.raises(SystemExit) as done:
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
    assert done.value.code == 0
    state = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert sorted(state) == ["inp.bias", "inp.weight", "mid.bias", "mid.weight", "out.bias",
                             "out.weight", "scale"]
    for name, value in final.items():
        assert torch.equal(state[name], value), name
    expected, _ = _expected("s3_fp32")  # DeepSpeed's own checkpoint, through the same script
    assert main([os.path.join(ROOT, "s3_fp32"), str(tmp_path / "st"), "--safe_serialization",
                 "-t", "global_step4"]) == 0
    state = load_file(str(tmp_path / "st" / "model.safetensors"))
    for name, value in expected["master"].items():
        assert torch.equal(state[name], value), name
    assert torch.equal(state["scale"], expected["buffers"]["scale"])


def test_convert_refuses_bad_input_and_writes_nothing(tmp_path):
    ds = os.path.join(ROOT, "s2_fp32")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    cases = {
        "missing": (("--from", "deepspeed", str(tmp_path / "nope"), str(tmp_path / "a")),
                    "does not exist"),
        "not_empty": (("--from", "deepspeed", ds, str(busy)), "exists and is not an empty"),
        "wrong_way": (("--to", "deepspeed", ds, str(tmp_path / "b")),
                      "is a DeepSpeed checkpoint, not a zeroshard one"),
        "stage0": (("--from", "deepspeed", os.path.join(ROOT, "s0_fp32"), str(tmp_path / "c")),
                   "does not record which parameter is in which of its 2 param groups"),
        "no_tag": (("--from", "deepspeed", ds, str(tmp_path / "d"), "--tag", "global_step9"),
                   "global_step9 does not exist"),
        "options": (("--from", "deepspeed", ds, str(tmp_path / "e"), "--world-size", "4"),
                    "go with --to deepspeed"),
    }
    for name, (argv, words) in cases.items():
        code, err = _cli("convert", *argv)
        assert code == 2 and words in err, (name, err)
    assert sorted(os.listdir(tmp_path)) == ["busy"]  # no destination, no temporary left
    assert os.listdir(busy) == ["keep.txt"]


def _copy(tmp_path, case="s2_fp32"):
    dst = tmp_path / case
    shutil.copytree(os.path.join(ROOT, case, "global_step4"), dst)
    return dst


def test_unreadable_deepspeed_checkpoints_say_why(tmp_path):
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint.deepspeed_read import DeepSpeedCheckpoint

    def refused(path, *words):
        with pytest.raises(CheckpointError) as err:
            DeepSpeedCheckpoint(str(path))
        for word in words:
            assert word in str(err.value), str(err.value)

    tp = _copy(tmp_path / "tp")
    shutil.copy(tp / "mp_rank_00_model_states.pt", tp / "mp_rank_01_model_states.pt")
    refused(tp, "mp_rank_01_model_states.pt", "tensor- or pipeline-parallel")
    moe = _copy(tmp_path / "moe")
    (moe / "layer_0_expert_0_mp_rank_00_model_states.pt").write_bytes(b"")
    refused(moe, "expert", "mixture-of-experts")
    nvme = _copy(tmp_path / "nvme")
    (nvme / "offloaded_tensors").mkdir()
    refused(nvme, "offloaded_tensors", "NVMe")
    extra = _copy(tmp_path / "extra")
    shutil.copy(extra / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                extra / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    refused(extra, "zero_pp_rank_2_mp_rank_00_optim_states.pt", "saved by 2 ranks")
    unsafe = _copy(tmp_path / "unsafe")
    torch.save({"optimizer_state_dict": {"f": shutil.rmtree}},
               unsafe / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    refused(unsafe, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "cannot be read safely")
    garbage = _copy(tmp_path / "garbage")
    (garbage / "mp_rank_00_model_states.pt").write_bytes(b"not a torch file")
    refused(garbage, "mp_rank_00_model_states.pt", "cannot be read safely")
