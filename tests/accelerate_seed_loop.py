"""The Accelerate loop of the seed document (shared/seeds/000_*.txt, "Hugging Face + ZeRO"),
verbatim, around a small causal LM whose forward returns `.loss`.

tests/test_accelerate.py calls `seed_loop` with `from zeroshard import Accelerator` inside a
world of ranks with the ZeRO settings in an `accelerate config` YAML. Run as a script
(`zeroshard run --config_file acc.yaml tests/accelerate_seed_loop.py --out DIR`) it is the seed
exactly, `from accelerate import Accelerator` (the real one, which reaches zeroshard through
DeepSpeed's name), and rank 0 writes DIR/result.json with the final weights, what accelerate's
state said, what a DeepSpeed-Chat-style `save_zero_three_model` wrote, and how TRL's
`prepare_deepspeed` wrapped a frozen copy of the trained model.
"""

import json
import os
import sys
import types

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import lm_loss, make_model  # noqa: E402

if __name__ == "__main__":
    from accelerate import Accelerator  # the seed's own import line
else:
    from zeroshard import Accelerator  # was: from accelerate import Accelerator

BATCH, SAMPLES, LR = 2, 32, 1e-2


def seed_loop(model, optimizer, train_loader):
    """The seed's lines, from `accelerator = Accelerator()` to the end of the loop."""
    # 使用Hugging Face Accelerate
    accelerator = Accelerator()

    # 自动使用ZeRO配置
    model, optimizer, train_loader = accelerator.prepare(
        model, optimizer, train_loader
    )

    # 训练
    for batch in train_loader:
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return accelerator, model


class CausalLM(nn.Module):
    """tests/models.TinyLM behind a Hugging Face style forward: model(**batch).loss."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.lm = make_model(seed)

    def forward(self, input_ids, labels):
        return types.SimpleNamespace(loss=lm_loss(self.lm(input_ids), labels))


def samples(n: int = SAMPLES, seq: int = 6):
    """Token rows as dicts, as a tokenized Hugging Face dataset gives them."""
    data = torch.randint(0, 23, (n, seq + 1), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row[:-1], "labels": row[1:]} for row in data]


def fresh(seed: int = 0):
    """Model, optimizer (no weight decay: unused parameters get zero gradients under ZeRO, no
    gradient in plain torch) and loader, the same on every call."""
    model = CausalLM(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    return model, optimizer, torch.utils.data.DataLoader(samples(), batch_size=BATCH)


def weights(accelerator, model) -> dict:
    """The whole model's parameters on every rank (gathered at stage 3)."""
    state = model.consolidated_state_dict(rank0_only=False)
    return {name: tensor.float().clone() for name, tensor in state.items()}


def save_like_deepspeed_chat(model, rank: int, path: str) -> None:
    """DeepSpeed-Chat's `save_zero_three_model` pattern: each parameter carrying `ds_id` is read
    inside `deepspeed.zero.GatheredParameters` when it is not available, rank 0 torch.saves."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    state = {}
    for name, param in model.module.named_parameters():
        if hasattr(param, "ds_id"):
            fetch = [param] if param.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
            with deepspeed.zero.GatheredParameters(fetch, enabled=True):
                value = param.data.cpu()
        else:
            value = param.cpu()
        if rank == 0:
            state[name] = value
    if rank == 0:
        torch.save(state, path)


def frozen_reference(accelerator, model) -> dict:
    """TRL's `prepare_deepspeed` (how its trainers wrap reference and teacher models: no
    optimizer, stage 3 or else stage 0) over a frozen copy of the trained model, as TRL's SDFT
    teacher (`requires_grad_(False)`): its loss equals the trained engine's on the same batch."""
    from trl.models.utils import prepare_deepspeed

    reference = CausalLM()
    reference.load_state_dict(weights(accelerator, model))
    reference.requires_grad_(False)
    reference.config = types.SimpleNamespace(hidden_size=8)  # TRL reads the hidden size
    engine = prepare_deepspeed(reference, accelerator)
    batch = {k: torch.stack([s[k] for s in samples(4)]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        got, want = engine(**batch).loss.item(), model(**batch).loss.item()
    return {"stage": engine.zero_optimization_stage(), "loss": got, "trained_loss": want,
            "elements": [sum(p.numel() for p in reference.parameters()),
                         sum(getattr(p, "ds_numel", p.numel()) for p in reference.parameters())],
            "grads_and_optimizer": sum(sum(engine.memory_report()[k].values())
                                       for k in ("grads", "optimizer"))}


def unsaved_errors(model) -> list[str]:
    """What `state_dict()` and `torch.save(param)` of partitioned parameters say (stage 3)."""
    import io

    said = []
    for attempt in (model.module.state_dict,
                    lambda: torch.save(next(model.module.parameters()), io.BytesIO())):
        try:
            attempt()
        except RuntimeError as err:
            said.append(str(err))
    return said


if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    accelerator, model = seed_loop(*fresh())
    final = weights(accelerator, model)
    stage = model.zero_optimization_stage()
    reference = frozen_reference(accelerator, model)
    if stage == 3:
        save_like_deepspeed_chat(model, accelerator.process_index,
                                 os.path.join(out, "pytorch_model.bin"))
    if accelerator.is_main_process:
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump({"world": accelerator.num_processes,
                       "distributed_type": accelerator.distributed_type.value,
                       "stage": stage, "engine": type(model).__module__,
                       "offload": model.config["zero_optimization"].get("offload_optimizer"),
                       "offload_param": model.config["zero_optimization"].get("offload_param"),
                       "unsaved_errors": unsaved_errors(model) if stage == 3 else [],
                       "reference": reference,
                       "weights": {k: v.tolist() for k, v in final.items()}}, fh)
    accelerator.wait_for_everyone()
