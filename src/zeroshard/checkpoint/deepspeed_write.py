"""Writing a checkpoint as DeepSpeed 0.19 does, for DeepSpeed's own `load_checkpoint`:
`write_deepspeed`.

The inverse of `deepspeed_read.py` (whose docstring describes the files) for a data-parallel run
of W ranks at ZeRO stage S, laid out as DeepSpeed 0.19.8 lays out a model with its defaults:
parameters of a param group in the module's order (DeepSpeed uses the order of the param
group's list, the same unless a group lists them otherwise), no `round_robin_gradients`, no
`parameter_alignment`, stage 3's sub-groups cut at `sub_group_size` as DeepSpeed cuts them.
DeepSpeed loads optimizer state only at the world size that saved it, so W is the caller's
choice; its loader takes the fp32 masters from these partitions (`load_from_fp32_weights`,
default on) and the 16-bit module from `module`.

Not written: `clip_grad` (DeepSpeed would let it override the loading config's
`gradient_clipping`; without it the config's value applies), RNG states (DeepSpeed saves none).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import torch

from ..core import keys
from .deepspeed_pickle import DynamicLossScaler, FragmentAddress, LossScaler, ZeroStage, save
from .deepspeed_read import DS_KEYS, MODEL
from .portable import Portable
from .verify import CheckpointError

__all__ = ["write_deepspeed"]

DS_VERSION = "0.19.8"  # the release whose layout this is; DeepSpeed only checks it is set


def write_deepspeed(ckpt: Portable, save_dir: str, tag: str, world_size: int, stage: int,
                    dtype: torch.dtype = torch.float32, ds_config: dict | None = None,
                    sub_group_size: int = 10**9) -> list[str]:
    """Write `ckpt` as DeepSpeed's `save_dir/tag/` of a `world_size`-rank stage-`stage` run
    computing in `dtype` (`save_dir` exists; `latest` is the caller's); returns the files."""
    if world_size < 1:
        raise CheckpointError(f"--world-size must be at least 1, got {world_size}")
    if stage not in (0, 1, 2, 3):
        raise CheckpointError(f"--stage must be 0, 1, 2 or 3, got {stage}")
    if ckpt.groups is None:
        raise CheckpointError(f"{ckpt.path} holds no optimizer state: a DeepSpeed checkpoint "
                              "needs it")
    if stage == 0 and dtype != torch.float32:
        raise CheckpointError("DeepSpeed keeps no fp32 masters of a 16-bit model at stage 0 in "
                              "a form zeroshard writes; choose --stage 1-3 or --dtype fp32")
    clash = sorted(set(ckpt.client_state) & DS_KEYS)
    if clash:
        raise CheckpointError(f"{ckpt.path}: client_state keys {clash} are DeepSpeed's own "
                              "model-state keys; rename them to convert")
    config = dict(ds_config or {})
    config.setdefault("zero_optimization", {"stage": stage})
    if dtype != torch.float32:
        config.setdefault("bf16" if dtype == torch.bfloat16 else "fp16", {"enabled": True})
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir)
    writer = _Writer(ckpt, world_size, stage, dtype, config)
    written = []
    if stage == 3:
        written += writer.stage3(tag_dir, sub_group_size)
    else:
        written += writer.stage012(tag_dir)
    return written


class _Writer:
    """The pieces every file shares, and the per-stage layouts."""

    def __init__(self, ckpt: Portable, world: int, stage: int, dtype: torch.dtype, config: dict):
        self.ckpt, self.world, self.stage = ckpt, world, stage
        self.dtype, self.config = dtype, config
        self.names = ckpt.group_names()
        self.scaler, self.dynamic = _loss_scaler(ckpt, dtype, config)

    # -- shared ----------------------------------------------------------------------------------
    def _module(self, empty: bool) -> tuple[OrderedDict, dict, list]:
        """The module's state_dict (stage 3: parameters empty), shared_params, buffer_names."""
        module, made, shared, buffers, owner = OrderedDict(), {}, {}, [], {}
        for key, entry in self.ckpt.state_dict.items():
            if keys.name_of(entry, keys.BUFFER) is not None:
                module[key] = self.ckpt.tensor(entry)
                buffers.append(key)
                continue
            if entry in owner:  # a tied name: DeepSpeed records which name holds the values
                shared[key] = owner[entry]
                module[key] = made[entry]
                continue
            owner[entry] = key
            value = self.ckpt.tensor(entry)
            if keys.name_of(entry, keys.MODEL) is not None:
                value = value.to(self.dtype)
            made[entry] = torch.empty(0, dtype=value.dtype, device="cpu") if empty else value
            module[key] = made[entry]
        return module, shared, buffers

    def _model_states(self, module, shared, buffers, **layout) -> dict:
        ckpt = self.ckpt
        state = dict(module=module, buffer_names=buffers, optimizer=None, param_shapes=None,
                     frozen_param_shapes=None, shared_params=shared, frozen_param_fragments=None,
                     lr_scheduler=ckpt.lr_scheduler, data_sampler=None, random_ltd=None,
                     skipped_steps=ckpt.counters["skipped_steps"],
                     global_steps=ckpt.counters["global_steps"],
                     global_samples=ckpt.counters["global_samples"], dp_world_size=self.world,
                     mp_world_size=1,
                     checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1},
                     ds_config=self.config, ds_version=DS_VERSION)
        state.update(layout)
        state.update(ckpt.client_state)
        return state

    def _group_state(self, g: int, tensors: dict[str, torch.Tensor]) -> dict:
        """Param group g's torch optimizer state over `tensors` (state key -> flat or shaped)."""
        meta = self.ckpt.groups[g]
        out = {}
        for key in meta["order"]:
            if key in tensors:
                out[key] = tensors[key]
            elif key in meta["scalars"]:
                info = meta["scalars"][key]
                out[key] = torch.tensor(info["value"], device="cpu", dtype=getattr(
                    torch, info["dtype"].split(".")[-1])) if info["dtype"] else info["value"]
        return out

    def _hyper(self, g: int) -> dict:
        return {k: tuple(v) if isinstance(v, list) else v
                for k, v in self.ckpt.groups[g]["hyper"].items()}

    def _optim_file(self, tag_dir: str, rank: int, osd: dict) -> str:
        prefix = "bf16_" if self.dtype == torch.bfloat16 else ""
        file = os.path.join(tag_dir, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        save({"optimizer_state_dict": osd, "ds_config": self.config, "ds_version": DS_VERSION},
             file)
        return file

    def _flat(self, kind: str, names: list[str]) -> torch.Tensor:
        """`kind` ("model" or a state key) of `names`, end to end, fp32."""
        parts = [self.ckpt.tensor(keys.flat_key(kind, n)).float().reshape(-1) for n in names]
        return torch.cat(parts) if parts else torch.zeros(0, device="cpu")

    # -- stages 0-2 --------------------------------------------------------------------------------
    def stage012(self, tag_dir: str) -> list[str]:
        """Stage 0: torch's state_dict in the model states; 1-2: flat groups in W partitions."""
        ckpt, world = self.ckpt, self.world
        module, shared, buffers = self._module(empty=False)
        if self.stage == 0:
            state, groups, index = {}, [], 0
            for g, names in enumerate(self.names):
                ids = []
                for name in names:
                    tensors = {k: ckpt.tensor(keys.optim_key(k, name))
                               for k in ckpt.groups[g]["tensor_keys"]}
                    state[index] = self._group_state(g, tensors)
                    ids.append(index)
                    index += 1
                groups.append({**self._hyper(g), "params": ids})
            file = os.path.join(tag_dir, MODEL)
            save(self._model_states(module, shared, buffers,
                                    optimizer={"state": state, "param_groups": groups}), file)
            return [file]
        align = 2 * world  # DeepSpeed's nccl_start_alignment_factor (2) x the world size
        per_rank = [dict(state={}, fp32=[], paddings=[], mappings=[]) for _ in range(world)]
        for g, names in enumerate(self.names):
            flats = {"model": self._flat("model", names)}
            flats.update({k: self._flat(k, names) for k in ckpt.groups[g]["tensor_keys"]})
            total = flats["model"].numel()
            padded = math.ceil(total / align) * align
            size = padded // world
            flats = {k: torch.cat([v, v.new_zeros(padded - total)]) for k, v in flats.items()}
            offsets, at = [], 0
            for name in names:
                offsets.append((name, at, math.prod(ckpt.params[name][0])))
                at += offsets[-1][2]
            for rank, mine in enumerate(per_rank):
                lo = rank * size
                padding = size if total <= lo else max(0, lo + size - total)
                mine["fp32"].append(flats["model"][lo:lo + size - padding].clone())
                mine["paddings"].append(padding)
                tensors = {k: v[lo:lo + size].clone() for k, v in flats.items() if k != "model"}
                mine["state"][g] = self._group_state(g, tensors)
                mine["mappings"].append(OrderedDict(
                    (name, FragmentAddress(numel=min(o + n, lo + size) - max(o, lo),
                                           start=max(o, lo) - lo))
                    for name, o, n in offsets if max(o, lo) < min(o + n, lo + size)))
        written = []
        for rank, mine in enumerate(per_rank):
            osd = {"loss_scaler": self.scaler, "dynamic_loss_scale": self.dynamic,
                   "overflow": False,
                   "base_optimizer_state": {"state": mine["state"], "param_groups": [
                       {**self._hyper(g), "params": [g]} for g in range(len(self.names))]},
                   "single_partition_of_fp32_groups": mine["fp32"],
                   "zero_stage": ZeroStage(self.stage), "group_paddings": mine["paddings"],
                   "param_alignment_paddings": [[0] * len(n) for n in self.names],
                   "partition_count": [world] * len(self.names), "ds_version": DS_VERSION,
                   "param_slice_mappings": mine["mappings"]}
            written.append(self._optim_file(tag_dir, rank, osd))
        frozen = {}
        if self.stage == 2:  # DeepSpeed records untrained parameters from stage 2 on
            frozen = dict(frozen_param_shapes=OrderedDict(
                (n, torch.Size(s)) for n, s in ckpt.frozen.items()),
                frozen_param_fragments=OrderedDict(
                    (n, ckpt.tensor(keys.frozen_key(n))) for n in ckpt.frozen))
        shapes = [OrderedDict((n, torch.Size(ckpt.params[n][0])) for n in names)
                  for names in self.names]
        file = os.path.join(tag_dir, MODEL)
        save(self._model_states(module, shared, buffers, param_shapes=shapes, **frozen), file)
        return [file, *written]

    # -- stage 3 ---------------------------------------------------------------------------------
    def stage3(self, tag_dir: str, sub_group_size: int) -> list[str]:
        """Every parameter cut into W equal parts; one flat per sub-group and rank."""
        ckpt, world = self.ckpt, self.world
        part = {n: -(-math.prod(ckpt.params[n][0]) // world) for n in ckpt.params}
        subs, owner = [], []  # sub-group -> names; sub-group -> param group
        for g, names in enumerate(self.names):
            for sub in _sub_groups(names, part, sub_group_size):
                subs.append(sub)
                owner.append(g)
        module, shared, buffers = self._module(empty=True)
        shapes = [OrderedDict((n, torch.Size(ckpt.params[n][0])) for n in sub) for sub in subs]
        frozen = {n: ckpt.tensor(keys.frozen_key(n)).reshape(-1) for n in ckpt.frozen}
        written = []
        for rank in range(world):
            flats, state = [], {}
            for i, (names, g) in enumerate(zip(subs, owner)):
                kinds = ["model", *ckpt.groups[g]["tensor_keys"]]
                cut = {k: self._rank_part(k, names, part, rank) for k in kinds}
                flats.append(cut.pop("model"))
                state[i] = self._group_state(g, cut)
            groups = [{**self._hyper(g), "params": [i for i, o in enumerate(owner) if o == g]}
                      for g in range(len(self.names))]
            osd = {"zero_stage": ZeroStage(3), "loss_scaler": self.scaler,
                   "dynamic_loss_scale": self.dynamic, "overflow": False,
                   "partition_count": world,
                   "optimizer_state_dict": {"state": state, "param_groups": groups},
                   "fp32_flat_groups": flats}
            written.append(self._optim_file(tag_dir, rank, osd))
            fragments = OrderedDict()
            for name, value in frozen.items():
                size = -(-value.numel() // world)
                piece = value[rank * size:(rank + 1) * size]
                fragments[name] = torch.cat([piece, piece.new_zeros(size - piece.numel())])
            file = os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
            save(self._model_states(
                module, shared, buffers, param_shapes=shapes,
                frozen_param_shapes=OrderedDict((n, torch.Size(s)) for n, s in ckpt.frozen.items()),
                frozen_param_fragments=fragments), file)
            written.append(file)
        return written

    def _rank_part(self, kind: str, names: list[str], part: dict, rank: int) -> torch.Tensor:
        """Rank `rank`'s part of each of `names` (padded to W equal parts), end to end."""
        pieces = []
        for name in names:
            flat = self.ckpt.tensor(keys.flat_key(kind, name)).float().reshape(-1)
            piece = flat[rank * part[name]:(rank + 1) * part[name]]
            pieces.append(torch.cat([piece, piece.new_zeros(part[name] - piece.numel())]))
        return torch.cat(pieces) if pieces else torch.zeros(0, device="cpu")


def _sub_groups(names: list[str], part: dict, sub_group_size: int) -> list[list[str]]:
    """A param group's parameters cut into sub-groups as DeepSpeed's stage 3 cuts them."""
    if sub_group_size >= sum(part[n] for n in names):
        return [names]
    out, current, size = [], [], 0
    for name in names:
        current.append(name)
        size += part[name]
        if size >= sub_group_size or name == names[-1]:
            out.append(current)
            current, size = [], 0
    return out


def _loss_scaler(ckpt: Portable, dtype: torch.dtype, config: dict):
    """DeepSpeed's loss scaler object (and its dynamic flag) for the run being written."""
    if dtype != torch.float16:
        return LossScaler(cur_scale=1.0, dynamic=False), False
    fp16 = config.get("fp16") or {}

    def number(key, default):  # "auto" and other non-numbers (Hugging Face's): DeepSpeed's default
        value = fp16.get(key, default)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    state = ckpt.scaler or {}
    if number("loss_scale", 0) > 0:
        return LossScaler(cur_scale=float(number("loss_scale", 0)), dynamic=False), False
    steps = ckpt.counters["global_steps"]
    scale = float(state.get("scale", 2.0 ** number("initial_scale_power", 16)))
    hysteresis = int(number("hysteresis", 2))
    # zeroshard counts the clean steps since the last overflow; DeepSpeed remembers its iteration.
    clean = int(state.get("clean_steps", steps))
    return DynamicLossScaler(
        cur_scale=scale, dynamic=True, cur_iter=steps, last_overflow_iter=steps - clean - 1,
        scale_factor=2.0, scale_window=int(number("loss_scale_window", 1000)),
        min_scale=number("min_loss_scale", 1), delayed_shift=hysteresis,
        cur_hysteresis=int(state.get("hysteresis_left", hysteresis)),
        consecutive_hysteresis=fp16.get("consecutive_hysteresis") is True,
        raise_error_at_min_scale=True, dtype=torch.float16), True
