"""Every setting zeroshard refuses, in one place: a valid config the engine cannot run yet
(`require_supported`, NotSupportedYetError), combinations DeepSpeed refuses too
(`check_reduce_and_accumulate`), ZeRO++ / MiCS combinations that cannot run at this
world size (`check_hpz`, `check_mics`), and optimizers that cannot step on flat shards
(`check_elementwise`). Each error names the key (or class) and says what to change; edit
refusals only here."""

from __future__ import annotations

import warnings

import torch

from .schema import ConfigError, NotSupportedYetError, ZeroConfig

#: The config keys, named in errors.
HPZ_KEY = "zero_optimization.zero_hpz_partition_size"
MICS_KEY = "zero_optimization.mics_shard_size"

# Optimizers whose update of an element depends only on that element's own history: they give the
# same result on any partition of the flat buffers.
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "NAdam",
               "RAdam", "Rprop", "ASGD", "Lion"}
# Optimizers that need whole tensors (trust ratios, factored moments, orthogonalisation, closures).
WHOLE_TENSOR = {"lamb", "lars", "lbfgs", "adafactor", "shampoo", "muon", "novograd", "sparseadam",
                "onebitlamb", "fusedlamb", "adan"}


def require_supported(cfg: ZeroConfig) -> None:
    """Raise NotSupportedYetError for valid settings the engine cannot run yet (edit only here)."""
    zero = cfg.zero_optimization
    opt = zero.offload_optimizer
    if opt is not None and opt.device in ("cpu", "nvme") and zero.stage > 0 and opt.ratio < 1.0:
        raise NotSupportedYetError(
            f"not supported yet: zero_optimization.offload_optimizer.ratio={opt.ratio:g} (partial "
            "offload); zeroshard offloads the whole optimizer step. Remove ratio (or set it to 1.0)")
    bf16 = cfg.bf16
    if bf16.enabled and bf16.bf16_master_weights_and_grads and zero.stage > 0:
        if not bf16.bf16_optimizer_states:
            raise NotSupportedYetError(
                "not supported yet: bf16.bf16_master_weights_and_grads=true with fp32 optimizer "
                "state (bf16_optimizer_states=false); torch's optimizers keep their state in the "
                "master's dtype. Set bf16.bf16_optimizer_states=true as well (bf16 masters and "
                "state: 6 bytes per parameter with Adam), or drop bf16_master_weights_and_grads")
        if opt is not None and opt.device == "nvme":
            raise NotSupportedYetError(
                "not supported yet: bf16.bf16_master_weights_and_grads with "
                "zero_optimization.offload_optimizer.device='nvme' (the swap files hold fp32); "
                "use offload_optimizer.device 'cpu' or 'none', or drop the bf16 master keys")


def check_reduce_and_accumulate(cfg: ZeroConfig) -> None:
    """Refuse what DeepSpeed 0.19.8 refuses of `gradient_allreduce_op` and
    `managed_gradient_accumulation` (its config and engine checks), naming the keys."""
    stage = cfg.zero_optimization.stage
    if cfg.gradient_allreduce_op == "sum" and stage == 3:
        raise ConfigError(
            "gradient_allreduce_op='sum' is not supported with ZeRO stage 3 (as in DeepSpeed): "
            "use 'mean' (the default), or stage 0-2")
    if not cfg.managed_gradient_accumulation and stage < 2 and cfg.zero_optimization.overlap_comm:
        raise ConfigError(
            f"managed_gradient_accumulation=false with zero_optimization.overlap_comm=true at "
            f"stage {stage}: DeepSpeed refuses it (stages 0-1 reduce in step(), there is nothing to "
            "overlap). Drop overlap_comm, or keep managed_gradient_accumulation true")


def check_hpz(size: int, stage: int, world_size: int, offload_param: str = "none") -> None:
    """Refuse hpZ settings that cannot run, naming the key and what to change (no-op at P == 1)."""
    if size <= 1:
        return
    if stage != 3:
        # DeepSpeed 0.19.8 ignores the key below stage 3 without a word; a secondary parameter
        # shard only exists where parameters are sharded, so say so instead.
        raise ValueError(
            f"{HPZ_KEY}={size} needs ZeRO stage 3 (it keeps a secondary copy of the stage-3 "
            f"parameter shards inside each host), but the stage is {stage}. Set "
            "zero_optimization.stage=3, or remove the key (1 turns hpZ off)")
    if world_size % size:
        raise ValueError(
            f"{HPZ_KEY}={size} must divide the world size {world_size} (groups of {size} "
            "consecutive ranks, usually the ranks of one host: LOCAL_WORLD_SIZE). Use a divisor "
            f"of {world_size}, or 1 to turn hpZ off")
    if offload_param not in (None, "none"):
        raise ValueError(
            f"{HPZ_KEY}={size} with zero_optimization.offload_param.device={offload_param!r} is "
            "not supported: the secondary shards would live on the device the offload frees. "
            "Turn one of them off")


def check_mics(size: int, stage: int, world_size: int, hpz: int = 1, offload: bool = False,
               built_partitioned: bool = False, quantized: bool = False) -> None:
    """Refuse MiCS settings that cannot run, naming the key and what to change (no-op if off)."""
    if size <= 0:
        return
    if stage != 3:
        raise ValueError(f"{MICS_KEY}={size} needs ZeRO stage 3 (it shards parameters inside "
                         f"groups of {size} ranks), but the stage is {stage}. Set "
                         "zero_optimization.stage=3, or remove the key (-1 turns MiCS off)")
    if world_size % size:
        raise ValueError(f"{MICS_KEY}={size} must divide the world size {world_size} (shard "
                         f"groups of {size} consecutive ranks). Use a divisor of {world_size}")
    for cond, what in ((hpz > 1, "zero_hpz_partition_size > 1 (hpZ)"),
                       (offload, "offload_optimizer / offload_param"),
                       (built_partitioned, "a model built under zeroshard.Init"),
                       (quantized, "zero_quantized_weights / zero_quantized_gradients")):
        if cond:
            raise ValueError(f"{MICS_KEY}={size} together with {what} is not supported; "
                             "turn one of them off")


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose update needs whole tensors (they would be wrong on shards)."""
    name = type(optimizer).__name__
    if getattr(optimizer, "_zeroshard_muon", False):
        return  # zeroshard's Muon: core/muon_exchange.py orthogonalises whole matrices first
    if name.lower() == "muon":
        raise ValueError(
            f"optimizer {type(optimizer).__module__}.{name} orthogonalises whole matrices, so it "
            "cannot step on zeroshard's flat 1/N shards. Use the config's \"optimizer\": "
            "{\"type\": \"Muon\", ...} (DeepSpeed's Muon with an auxiliary Adam, each matrix "
            "orthogonalised whole on one rank), or pass zeroshard.core.muon.MuonWithAuxAdam")
    if name.lower() in WHOLE_TENSOR or isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            f"optimizer {name} needs whole parameter tensors (per-tensor norms or closures), so it "
            "cannot step on zeroshard's flat 1/N shards. Use an elementwise optimizer (Adam, "
            "AdamW, SGD, Adagrad, Lion, ...).")
    if name not in ELEMENTWISE and not getattr(optimizer, "_zeroshard_elementwise", False):
        warnings.warn(f"zeroshard: optimizer {name} is not known to be elementwise; it will step on "
                      "flat shards. Set `_zeroshard_elementwise = True` on the class to silence this.",
                      stacklevel=3)
