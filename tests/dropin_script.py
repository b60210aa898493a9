"""A DeepSpeed-tutorial-style training script, unchanged except for its import line.

Run by tests/test_deepspeed_dropin.py as
    zeroshard tests/dropin_script.py --deepspeed --deepspeed_config cfg.json --out DIR
It trains, checkpoints with client_state, reloads, trains on, and exercises the DeepSpeed names
scripts use; rank 0 writes DIR/result.json (final weights and what each check saw).
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import zeroshard as deepspeed

FEATURES, STEPS, SAVE_AT = 12, 6, 3


class Net(nn.Module):
    """A small MLP (two blocks, so stage 3 has units to gather)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(FEATURES, 24), nn.Tanh(),
                                                   nn.Linear(24, FEATURES)) for _ in range(2)])
        self.head = nn.Linear(FEATURES, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def dataset():
    """Deterministic regression data."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, FEATURES, generator=gen)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Net()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset())
    checks = {"local_rank_arg": args.local_rank == int(os.environ["LOCAL_RANK"]),
              "version": isinstance(deepspeed.__version__, str)}
    ckpt = os.path.join(args.out, "ckpt")
    step, losses = 0, []
    for epoch in range(10):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            step += 1
            if step == SAVE_AT:
                engine.save_checkpoint(ckpt, client_state={"step": step, "epoch": epoch})
                # Reload at once (as after a restart) and go on from the loaded state.
                _, client = engine.load_checkpoint(ckpt)
                checks["client_state"] = client == {"step": step, "epoch": epoch}
            if step == STEPS:
                break
        if step == STEPS:
            break
    stage = engine.zero_optimization_stage()
    checks.update(_engine_members(engine, optimizer, scheduler, stage))
    checks.update(_module_names(engine, stage))
    checks["nothing_to_load"] = engine.load_checkpoint(os.path.join(args.out, "empty")) == (None, None)
    state = engine._zero3_consolidated_16bit_state_dict()
    fp32 = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    checks["zero_to_fp32"] = sorted(fp32) == sorted(n for n, _ in model.named_parameters())
    engine.destroy()
    if deepspeed.comm.get_rank() == 0:
        with open(os.path.join(args.out, "result.json"), "w") as fh:
            json.dump({"losses": losses, "checks": checks, "stage": stage,
                       "weights": {k: v.tolist() for k, v in state.items()}}, fh)
    deepspeed.comm.barrier()
    torch.distributed.destroy_process_group()


def _engine_members(engine, optimizer, scheduler, stage):
    """Every engine member DeepSpeed clients use."""
    out = {"device": engine.device.type == "cpu", "module": isinstance(engine.module, Net),
           "optimizer": engine.optimizer is optimizer, "lr_scheduler": engine.lr_scheduler is scheduler,
           "config": engine.config["zero_optimization"]["stage"] == stage,
           "local_rank": engine.local_rank == int(os.environ["LOCAL_RANK"]),
           "precision": (engine.fp16_enabled(), engine.bfloat16_enabled()) == (False, False),
           "grad_norm": engine.get_global_grad_norm() > 0, "applied": engine.was_step_applied(),
           "gather_16bit": engine.zero_gather_16bit_weights_on_model_save() is False,
           "passthrough": len(engine.blocks) == 2}
    engine.set_gradient_accumulation_boundary(False)
    out["boundary"] = not engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(None)
    engine.eval()
    out["eval"] = not engine.module.training
    engine.train()
    try:
        with engine.no_sync():
            pass
        out["no_sync"] = stage < 2
    except RuntimeError as err:
        out["no_sync"] = stage >= 2 and "gradient_accumulation_steps" in str(err)
    return out


def _module_names(engine, stage):
    """deepspeed.comm / zero / ops names, and the stage-3 parameter attributes."""
    comm = deepspeed.comm
    total = torch.ones(1)
    comm.all_reduce(total)
    out = {"comm": (comm.is_initialized(), comm.get_world_size(), total.item()) == (True, 2, 2.0)
           and comm.get_local_rank() == comm.get_rank()}
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params[0]):
        one = params[0].numel() > 0
    with deepspeed.zero.GatheredParameters(params):
        listed = all(p.numel() > 0 for p in params)
    with deepspeed.zero.GatheredParameters(p for p in params):
        generated = all(p.numel() > 0 for p in params)
    out["gathered"] = one and listed and generated
    if stage == 3:
        status = deepspeed.zero.ZeroParamStatus
        released = [p for p in params if p.numel() == 0]
        out["ds_attrs"] = bool(released) and all(
            p.ds_status == status.NOT_AVAILABLE and p.ds_numel == p.ds_shape.numel()
            for p in released)
    adam = deepspeed.ops.adam
    out["ops"] = all(issubclass(c, torch.optim.Optimizer) for c in (adam.DeepSpeedCPUAdam,
                                                                     adam.FusedAdam))
    return out


if __name__ == "__main__":
    main()
