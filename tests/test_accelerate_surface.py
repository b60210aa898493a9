"""The rest of `zeroshard.Accelerator`: an Accelerate-docs-style loop (accumulate, clipping, a
scheduler, shuffled data) saved with save_state mid-epoch and resumed with load_state +
skip_first_batches ends bit for bit where the uninterrupted run does; gather / gather_for_metrics
/ reduce, rank helpers, save_model, autocast, and the errors that say what to do."""

from __future__ import annotations

import os

import pytest
import torch

from tests.accelerate_seed_loop import CausalLM, samples
from tests.harness import run_world

EPOCHS, GAS, SAVE_AT, CLIP = 2, 2, 4, 0.5


def _docs_loop(tmp, resume: bool):
    """Accelerate's checkpointing example, shaped as in its docs; returns the final state."""
    from zeroshard import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=GAS, zero_stage=2)
    torch.manual_seed(1 if resume else 0)  # the resumed run must get everything from the files
    model = CausalLM(seed=1 if resume else 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    train_dataloader = torch.utils.data.DataLoader(samples(20), batch_size=2, shuffle=True)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=6)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    starting_epoch, resume_step, completed = 0, None, 0
    if resume:
        accelerator.load_state(tmp)
        starting_epoch, resume_step = divmod(SAVE_AT, len(train_dataloader))
        completed = SAVE_AT
    norms = []
    for epoch in range(starting_epoch, EPOCHS):
        if resume and epoch == starting_epoch and resume_step:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                accelerator.backward(outputs.loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            completed += 1
            if completed == SAVE_AT and not resume:
                accelerator.save_state(tmp)
    final = {k: v.clone() for k, v in model.consolidated_state_dict(rank0_only=False).items()}
    result = {"weights": final, "lr": lr_scheduler.get_last_lr(), "steps": model.global_steps,
              "norms": norms, "batches": len(train_dataloader)}
    model.destroy()
    return result


def _surface(rank, world, tmp):
    from zeroshard import Accelerator

    out = {"uninterrupted": _docs_loop(os.path.join(tmp, "state"), resume=False)}
    out["resumed"] = _docs_loop(os.path.join(tmp, "state"), resume=True)
    accelerator = Accelerator(zero_stage=3, mixed_precision="bf16")
    model = CausalLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # 7 samples over 2 ranks in batches of 2: the last round is completed from the first samples.
    evaluation = torch.utils.data.DataLoader(list(range(7)), batch_size=2)
    engine, optimizer, evaluation = accelerator.prepare(model, optimizer, evaluation)
    seen, per_rank = [], []
    for batch in evaluation:
        per_rank.append(batch.tolist())
        seen.append(accelerator.gather_for_metrics(batch))
    out["eval"] = {"per_rank": per_rank, "gathered": torch.cat(seen).tolist(),
                   "len": len(evaluation)}
    value = torch.tensor([float(rank + 1)])
    out["collectives"] = {
        "gather": accelerator.gather(value).tolist(),
        "nested": accelerator.gather({"a": value, "b": [value * 2]})["b"][0].tolist(),
        "objects": accelerator.gather_for_metrics(["x" * (rank + 1)]),
        "sum": accelerator.reduce(value).item(), "mean": accelerator.reduce(value, "mean").item(),
        "max": accelerator.reduce(value, "max").item(),
        "padded": accelerator.pad_across_processes(torch.ones(rank + 1)).tolist()}
    try:
        accelerator.gather(torch.ones(rank + 1))
        out["shape_error"] = "no error"
    except ValueError as err:
        out["shape_error"] = str(err)
    order = os.path.join(tmp, "order.txt")
    with accelerator.main_process_first():
        with open(order, "a") as fh:
            fh.write(str(rank))
    accelerator.wait_for_everyone()
    out["order"] = open(order).read()
    x = torch.randint(0, 23, (2, 6))
    with accelerator.autocast():
        logits = engine.module.lm(x)
    out["info"] = {"main": accelerator.is_main_process, "local_main": accelerator.is_local_main_process,
                   "index": accelerator.process_index, "n": accelerator.num_processes,
                   "device": accelerator.device.type, "precision": accelerator.mixed_precision,
                   "unwrap": accelerator.unwrap_model(engine) is model, "autocast": logits.dtype,
                   "param_dtype": next(model.parameters()).dtype, "stage": engine.zero_optimization_stage(),
                   "distributed_type": accelerator.distributed_type}
    # Saving: the consolidated weights as safetensors (rank 0), in shards when asked.
    state = accelerator.get_state_dict(engine)
    accelerator.save_model(engine, os.path.join(tmp, "model"))
    accelerator.save_model(engine, os.path.join(tmp, "sharded"), max_shard_size="2KB")
    out["saved"] = {k: v.float() for k, v in state.items()}
    # Errors that say what to do.
    errors = {}
    batch = {"input_ids": x, "labels": x}
    accelerator.backward(engine(**batch).loss)
    for name, call in (("twice", lambda: accelerator.backward(engine(**batch).loss)),
                       ("value", lambda: accelerator.clip_grad_value_(engine.parameters(), 1.0)),
                       ("plain backward", lambda: (optimizer.step(), engine(**batch).loss.backward(),
                                                   optimizer.step())),
                       ("subset", lambda: accelerator.clip_grad_norm_([next(engine.parameters())], 1.0)),
                       ("second model", lambda: accelerator.prepare(CausalLM(), torch.optim.SGD(
                           CausalLM().parameters(), lr=0.1))),
                       ("split", lambda: Accelerator(split_batches=True)),
                       ("unknown", lambda: Accelerator(no_such_option=1))):
        try:
            call()
            errors[name] = "no error"
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            errors[name] = f"{type(err).__name__}: {err}"
    out["errors"] = errors
    out["printed"] = accelerator.is_local_main_process
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def surface(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("surface")
    return tmp, run_world(2, _surface, str(tmp))


def test_save_state_load_state_resume_exactly(surface):
    """Saved mid-epoch at an accumulation boundary, resumed in a fresh run with other initial
    weights and seed: the same final weights, LR and norms as without the interruption."""
    for got in surface[1]:
        full, resumed = got["uninterrupted"], got["resumed"]
        assert full["batches"] == 5  # 20 samples, batches of 2, 2 ranks
        # 2 epochs of 5 batches, windows of 2 closed early at each epoch's end: 3 steps each.
        assert full["steps"] == resumed["steps"] == 6
        assert full["lr"] == resumed["lr"]
        assert resumed["norms"] == full["norms"][2:]  # after the 2 steps of the first 4 batches
        for name, tensor in full["weights"].items():
            assert torch.equal(tensor, resumed["weights"][name]), name


def test_gather_for_metrics_drops_the_completion_samples(surface):
    rank0, rank1 = (got["eval"] for got in surface[1])
    # Rank r takes the original batches r, r + 2, ...; the last round is completed with sample 0.
    assert rank0["per_rank"] == [[0, 1], [4, 5]] and rank1["per_rank"] == [[2, 3], [6, 0]]
    assert rank0["gathered"] == rank1["gathered"] == list(range(7))
    assert rank0["len"] == 2


def test_collectives(surface):
    for rank, got in enumerate(surface[1]):
        c = got["collectives"]
        assert c["gather"] == [1.0, 2.0] and c["nested"] == [2.0, 4.0]
        assert c["objects"] == ["x", "xx"]
        assert (c["sum"], c["mean"], c["max"]) == (3.0, 1.5, 2.0)
        assert c["padded"] == [1.0] * (rank + 1) + [0.0] * (1 - rank)
        assert "rank 0: [1], rank 1: [2]" in got["shape_error"] and "pad_across_processes" in got["shape_error"]
        assert got["order"] == "01"  # main_process_first: rank 0's block ran first


def test_rank_helpers_precision_and_autocast(surface):
    for rank, got in enumerate(surface[1]):
        info = got["info"]
        assert (info["main"], info["local_main"], info["index"], info["n"]) == \
            (rank == 0, rank == 0, rank, 2)
        assert info["precision"] == "bf16" and info["param_dtype"] == torch.bfloat16
        assert info["unwrap"] and info["autocast"] == torch.bfloat16 and info["stage"] == 3
        # accelerate's own examples compare it with DistributedType members (a str enum).
        assert info["distributed_type"] == "DEEPSPEED"


def test_save_model_writes_safetensors(surface):
    from safetensors.torch import load_file

    tmp, results = surface
    saved = results[0]["saved"]
    whole = load_file(str(tmp / "model" / "model.safetensors"))
    assert set(whole) == set(saved)
    for name, tensor in whole.items():
        assert torch.equal(tensor.float(), saved[name]), name
    shards = sorted(p.name for p in (tmp / "sharded").iterdir())
    assert "model.safetensors.index.json" in shards and len(shards) > 2
    merged = {}
    for name in shards:
        if name.endswith(".safetensors"):
            merged.update(load_file(str(tmp / "sharded" / name)))
    assert set(merged) == set(saved)


def test_errors_say_what_to_do(surface):
    errors = surface[1][0]["errors"]
    assert "optimizer.step() was not called" in errors["twice"]
    assert "clip_grad_value_ is not supported with ZeRO" in errors["value"]
    assert "instead of loss.backward()" in errors["plain backward"]
    assert "pass model.parameters()" in errors["subset"]
    assert "one model per Accelerator" in errors["second model"]
    assert "Accelerator(split_batches=True) is not supported" in errors["split"]
    assert "TypeError" in errors["unknown"] and "no_such_option" in errors["unknown"]
