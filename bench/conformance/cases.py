"""The conformance matrix: one model, one data stream, many DeepSpeed configs.

Every case is trained the same way by real DeepSpeed and by zeroshard (`train()` takes the
`deepspeed` module it is given: DeepSpeed's own, or zeroshard under `zeroshard run`, or
`zeroshard` itself in the test suite). What is compared per optimizer step: the loss (mean over
micro-batches and ranks), the global gradient norm, the learning rate, the loss scale, the skipped
step count; after the last step: every parameter, in the module's dtype and as fp32 master.

The model is a small MLP with biases; inputs are scaled so that the gradient norm is well above
1 (DeepSpeed's default clipping engages) and a large initial fp16 loss scale overflows at first.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

IN, HIDDEN, OUT = 16, 48, 8
MICRO = 4  # samples per rank per micro-batch
STEPS = 6

#: Tolerances per precision: (relative on loss / norm / lr / scale, absolute on weights).
TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 2e-2), "fp16": (2e-3, 2e-3)}


def _adamw(lr=1e-2, **extra):
    return {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, **extra}}


def _base(stage, **top):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": _adamw(),
           "zero_optimization": {"stage": stage}}
    cfg.update(top)
    return cfg


def _with_zero(cfg, **zero):
    cfg = copy.deepcopy(cfg)
    cfg["zero_optimization"].update(zero)
    return cfg


def _fp16(stage, **fp16):
    return _base(stage, fp16={"enabled": True, "initial_scale_power": 16,
                              "loss_scale_window": 2, "hysteresis": 1, **fp16})


def _sched(kind, **params):
    return _base(2, scheduler={"type": kind, "params": params})


def _opt(kind, **params):
    return _base(2, optimizer={"type": kind, "params": {"lr": 1e-2, **params}})


#: The Trainer-style config of Hugging Face's docs with the "auto" values written out.
HF_ZERO2 = {
    "train_batch_size": 2 * MICRO * 2, "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "wall_clock_breakdown": False, "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-3,
                                                      "warmup_num_steps": 2,
                                                      "total_num_steps": STEPS}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True,
                          "allgather_bucket_size": 200_000_000, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 200_000_000,
                          "contiguous_gradients": True},
}
HF_ZERO3 = {
    **{k: v for k, v in HF_ZERO2.items() if k != "zero_optimization"},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "sub_group_size": 1_000_000_000, "reduce_bucket_size": 100_000,
                          "stage3_prefetch_bucket_size": 100_000,
                          "stage3_param_persistence_threshold": 0,
                          "stage3_max_live_parameters": 1_000_000_000,
                          "stage3_max_reuse_distance": 1_000_000_000,
                          "stage3_gather_16bit_weights_on_model_save": True},
}

#: name -> (world size, config). Names say what differs from the stage-2 fp32 AdamW default.
CASES: dict[str, tuple[int, dict]] = {
    **{f"z{s}-fp32": (2, _base(s)) for s in range(4)},
    "z3-fp32-partitioned": (2, _with_zero(_base(3), stage3_param_persistence_threshold=0)),
    "z2-clip-off": (2, _base(2, gradient_clipping=0.0)),
    "z2-clip-0.5": (2, _base(2, gradient_clipping=0.5)),
    "z1-clip-off": (2, _base(1, gradient_clipping=0.0)),
    **{f"z{s}-gas2": (2, _base(s, gradient_accumulation_steps=2)) for s in (0, 1, 2, 3)},
    **{f"z{s}-bf16": (2, _base(s, bf16={"enabled": True})) for s in range(4)},
    **{f"z{s}-fp16": (2, _fp16(s)) for s in (1, 2, 3)},
    "z2-fp16-static": (2, _base(2, fp16={"enabled": True, "loss_scale": 128})),
    "z2-WarmupLR": (2, _sched("WarmupLR", warmup_min_lr=0.0, warmup_max_lr=1e-2,
                              warmup_num_steps=3)),
    "z2-WarmupLR-log": (2, _sched("WarmupLR", warmup_min_lr=1e-4, warmup_max_lr=1e-2,
                                  warmup_num_steps=4, warmup_type="log")),
    "z2-WarmupDecayLR": (2, _sched("WarmupDecayLR", warmup_min_lr=0.0, warmup_max_lr=1e-2,
                                   warmup_num_steps=2, total_num_steps=STEPS)),
    "z2-WarmupCosineLR": (2, _sched("WarmupCosineLR", total_num_steps=STEPS, warmup_num_steps=2,
                                    warmup_min_ratio=0.0, cos_min_ratio=0.1)),
    "z2-OneCycle": (2, _sched("OneCycle", cycle_min_lr=1e-3, cycle_max_lr=1e-2,
                              cycle_first_step_size=2, cycle_momentum=False)),
    "z2-LRRangeTest": (2, _sched("LRRangeTest", lr_range_test_min_lr=1e-3,
                                 lr_range_test_step_size=2, lr_range_test_step_rate=2.0)),
    "z2-Adam": (2, _opt("Adam", weight_decay=0.01)),
    "z2-Adam-no-adamw-mode": (2, _opt("Adam", weight_decay=0.01, adam_w_mode=False)),
    # DeepSpeed wants SGD declared "untested" at ZeRO stages; zeroshard takes it as it is.
    "z2-SGD": (2, {**_opt("SGD", momentum=0.9), "zero_allow_untested_optimizer": True}),
    "z2-Adagrad": (2, _opt("Adagrad")),
    "z2-Lion": (2, _opt("Lion", lr=1e-3)),
    "z2-Lamb": (2, _opt("Lamb")),
    "z2-offload-opt": (2, _with_zero(_base(2), offload_optimizer={"device": "cpu"})),
    "z3-offload-opt": (2, _with_zero(_base(3), offload_optimizer={"device": "cpu"})),
    "z3-offload-opt-param": (2, _with_zero(_base(3), offload_optimizer={"device": "cpu"},
                                           offload_param={"device": "cpu"},
                                           stage3_param_persistence_threshold=0)),
    "hf-zero2": (2, HF_ZERO2),
    "hf-zero3": (2, HF_ZERO3),
    **{f"w4-z{s}-fp32": (4, _base(s)) for s in (1, 2, 3)},
    "w4-z2-bf16-gas2": (4, _base(2, bf16={"enabled": True}, gradient_accumulation_steps=2)),
}


#: Cases where DeepSpeed 0.19.8 disagrees with itself: zeroshard is judged against the DeepSpeed
#: case named here instead (docs/migrating-from-deepspeed.md says why).
JUDGED_AGAINST = {
    "z0-bf16": ("z1-bf16", "DeepSpeed 0.19.8 runs bf16 at stage 0 through its FP16_Optimizer, "
                           "whose result differs from its own stages 1-3 by ~4% in loss after 6 "
                           "steps on this model (its SGD agrees; its AdamW path does not); "
                           "zeroshard's stage 0 equals DeepSpeed's stages 1-3"),
}


#: Quantities of a case whose DeepSpeed value is not the reference, and why.
NOT_JUDGED = {
    "z3-fp16": {"grad_norm": "DeepSpeed 0.19.8's stage 3 divides the gradient norm by the loss "
                             "scale after updating the scale, so on a step where the scale "
                             "doubles it reports half the norm"},
}


def precision(config: dict) -> str:
    """fp32 / bf16 / fp16: which tolerance a case is judged by."""
    if config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "bf16" if config.get("bf16", {}).get("enabled") else "fp32"


def make_model() -> torch.nn.Module:
    """The same initial weights on every rank and in every run."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, OUT))


def batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global micro-batch `micro` of optimizer step `step`."""
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(MICRO * world, IN, generator=gen) * 10
    y = torch.randn(MICRO * world, OUT, generator=gen)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    return x[rows], y[rows]


def _loss_scale(engine) -> float:
    opt = engine.optimizer
    for name in ("loss_scale", "cur_scale"):
        value = getattr(opt, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, torch.Tensor):
            return float(value)
    return 1.0


def _number(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None  # inf / nan: a skipped step


def train(deepspeed, config: dict, rank: int, world: int, steps: int = STEPS) -> dict:
    """Train one case with the given `deepspeed` module; per-step records and final weights."""
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=copy.deepcopy(config))
    dtype = next(engine.module.parameters()).dtype
    gas = engine.gradient_accumulation_steps()
    records = []
    for step in range(steps):
        losses = []
        for micro in range(gas):
            x, y = batch(step, micro, rank, world)
            x = x.to(dtype)
            out = engine(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean().reshape(1).clone()
        dist.all_reduce(mean)
        records.append({"loss": float(mean) / world,
                        "grad_norm": _number(engine.get_global_grad_norm()),
                        "lr": float(engine.get_lr()[0]),
                        "loss_scale": _loss_scale(engine),
                        "skipped": int(engine.skipped_steps)})
    return {"records": records, "weights": final_weights(deepspeed, engine)}


def final_weights(deepspeed, engine) -> dict[str, dict[str, list]]:
    """Every parameter, whole, in the module's dtype (as fp32 numbers) and as fp32 master."""
    named = list(engine.module.named_parameters())
    params = [p for _, p in named]
    module, master = {}, {}
    with deepspeed.zero.GatheredParameters(params):
        for name, p in named:
            module[name] = p.detach().float().flatten().tolist()
    for name, p in named:
        full = deepspeed.utils.safe_get_full_fp32_param(p)
        master[name] = None if full is None else full.detach().float().flatten().tolist()
    return {"module": module, "master": master}
