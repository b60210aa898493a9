"""A DeepSpeed 0.19 ZeRO checkpoint (`<save_dir>/<tag>/`) read without DeepSpeed:
`DeepSpeedCheckpoint`.

What DeepSpeed writes for a data-parallel run of W ranks, and what this reader relies on:

- `mp_rank_00_model_states.pt` (stages 0-2; stage 3: `zero_pp_rank_<r>_mp_rank_00_model_states.pt`
  per rank): `module` (the module's state_dict in its compute dtype; at stage 3 the parameters
  are empty), `param_shapes` (per flat group, the trained parameters in the order their values
  are laid out), `buffer_names`, `shared_params` (tied names), `frozen_param_shapes` and
  `frozen_param_fragments` (stage 2: whole; stage 3: this rank's part), `lr_scheduler`,
  `global_steps`, `global_samples`, `skipped_steps`, `dp_world_size`, `mp_world_size`,
  `ds_config`, and the user's `client_state` keys beside these.
- `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` (stages 1-3, `bf16_` when bf16 is on):
  `optimizer_state_dict`, whose layout depends on the stage:
  - stages 1-2 (and DeepSpeed's BF16_Optimizer): per optimizer param group, one flat fp32 vector
    of the group's trained parameters in `param_shapes` order (each followed by its
    `param_alignment_paddings` zeros), padded to a multiple of 2W and cut into W equal
    partitions. Rank r holds partition r: `single_partition_of_fp32_groups` (the ZeRO optimizer
    strips its trailing padding, `group_paddings` long; BF16_Optimizer keeps it) and the torch
    optimizer's state of that partition, `base_optimizer_state` (torch's state_dict, or the
    "elastic" list of stripped per-group states);
  - stage 3: every parameter padded to a multiple of W and cut into W equal parts; rank r's
    parts of a sub-group's parameters, end to end in `param_shapes` order (one entry per
    sub-group), are `fp32_flat_groups[i]`; `optimizer_state_dict` is torch's over those flats,
    param group g listing its sub-groups.
- stage 0 has no optimizer files: `module` holds the fp32 weights and `optimizer` torch's
  per-parameter state_dict (which records no names: the loading engine's param groups give them).

The fp32 masters are taken from the optimizer partitions, never from the 16-bit module copy.
Each whole tensor is reassembled on demand from the ranks' partitions (read memory-mapped), so
a reader holds one parameter at a time. Pipeline/tensor parallel (`mp_rank_01`, `layer_*`), MoE
(`expert_*`), NVMe-offloaded (`offloaded_tensors/`) and universal checkpoints are refused, naming
the file that shows it.
"""

from __future__ import annotations

import os
import re
import warnings

import torch

from ..core import keys
from . import deepspeed_pickle
from .portable import Portable
from .verify import CheckpointError

__all__ = ["DeepSpeedCheckpoint", "is_deepspeed", "DS_KEYS"]

MODEL = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_?optim_states\.pt$")
#: The keys DeepSpeed itself writes into model states; the rest is the user's client_state.
DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
    "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info"})


def _model3(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def is_deepspeed(path: str) -> bool:
    """`path` (a tag directory) holds DeepSpeed's model states file."""
    return os.path.isfile(os.path.join(path, MODEL)) or \
        os.path.isfile(os.path.join(path, _model3(0)))


def _refuse_unsupported(path: str, names: list[str]) -> None:
    """CheckpointError for the DeepSpeed checkpoints zeroshard cannot read, naming the evidence."""
    def refuse(name, what):  # noqa: ANN001 - local
        raise CheckpointError(f"{os.path.join(path, name)}: {what}; zeroshard reads DeepSpeed "
                              "checkpoints of data-parallel ZeRO runs (stages 0-3) only")
    for name in names:
        mp = re.search(r"mp_rank_(\d+)", name)
        if mp and int(mp.group(1)) != 0:
            refuse(name, "a tensor- or pipeline-parallel checkpoint (model-parallel rank "
                   f"{int(mp.group(1))})")
        if name.startswith("layer_") and "expert" not in name:
            refuse(name, "a pipeline-parallel checkpoint (per-layer files)")
        if name.startswith(("expp_rank_", "expert_")) or "_expert_" in name:
            refuse(name, "a mixture-of-experts checkpoint (expert files)")
        if name == "offloaded_tensors":
            refuse(name, "an NVMe-offloaded optimizer state (ZeRO-Infinity keeps it in "
                   "swap files DeepSpeed copies there)")
    if "zero" in names and not is_deepspeed(path):
        refuse("zero", "a universal checkpoint (ds_to_universal.py output)")


def _check_model_states(file: str, model: dict) -> None:
    if "module" not in model or "dp_world_size" not in model:
        raise CheckpointError(f"{file} is not a DeepSpeed model states file (it has no "
                              "'module' / 'dp_world_size')")
    if model["module"] is None:
        raise CheckpointError(f"{file}: no module state (a pipeline-parallel checkpoint keeps it "
                              "in per-layer files); not supported")
    dims = model.get("checkpoint_parallel_dimensions") or {}
    if model.get("mp_world_size", 1) != 1 or any(v not in (None, 1) for v in dims.values()):
        raise CheckpointError(f"{file}: saved with model parallelism (mp_world_size "
                              f"{model.get('mp_world_size')}, {dims}); zeroshard reads "
                              "data-parallel checkpoints only")
    if "num_experts" in model:
        raise CheckpointError(f"{file}: a mixture-of-experts checkpoint; not supported")


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


class DeepSpeedCheckpoint(Portable):
    """A DeepSpeed checkpoint as a Portable. `group_names`, per optimizer param group the
    parameter names of the loading engine, names stage 0's unnamed optimizer state."""

    def __init__(self, path: str, group_names: list[list[str]] | None = None):
        if not os.path.isdir(path):
            raise CheckpointError(f"DeepSpeed checkpoint {path} does not exist")
        names = sorted(os.listdir(path))
        _refuse_unsupported(path, names)
        stage3 = _model3(0) in names
        file = os.path.join(path, _model3(0) if stage3 else MODEL)
        model = deepspeed_pickle.load(file)
        _check_model_states(file, model)
        world = int(model["dp_world_size"])
        config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
        module = model["module"]
        buffers = [n for n in model.get("buffer_names") or [] if n in module]
        # rank -> flat -> {"master": tensor, state key: tensor}; name -> (flat, [(rank, start, n)])
        self._flats: list[list[dict]] = []
        self._pieces: dict[str, tuple[int, list]] = {}
        optim_files = _optim_files(path, names, world, config)
        if optim_files:
            optims = [_optimizer_state(f) for f in optim_files]
            if stage3:
                stage, params, groups = self._zero3(file, model, optims, world)
            else:
                stage, params, groups = self._zero12(file, model, optims, world)
        elif stage3:
            raise CheckpointError(f"{path}: a stage-3 checkpoint without its "
                                  "zero_pp_rank_<r>_mp_rank_00_optim_states.pt files")
        else:
            stage = 0
            params, groups = self._zero0(file, model, buffers, group_names)
        self._frozen = self._frozen_values(path, model, stage3, world, params, buffers)
        self._module = module
        shared = model.get("shared_params") or {}
        state_dict = {}
        for key in module:
            if key in buffers:
                state_dict[key] = keys.buffer_key(key)
            elif key in shared and shared[key] in params:
                state_dict[key] = keys.model_key(shared[key])
            elif key in params:
                state_dict[key] = keys.model_key(key)
            elif key in self._frozen:
                state_dict[key] = keys.frozen_key(key)
        dtype = next((t.dtype for k, t in module.items()
                      if k not in buffers and torch.is_tensor(t) and t.is_floating_point()), None)
        gas = config.get("gradient_accumulation_steps")
        for skipped in ("data_sampler", "random_ltd"):
            if model.get(skipped) is not None:
                warnings.warn(f"zeroshard: {file} holds DeepSpeed's {skipped} state, which "
                              "zeroshard does not restore", stacklevel=3)
        super().__init__(
            path=path, source="deepspeed", stage=stage, world_size=world,
            params={n: params[n] for n in module if n in params} |
            {n: v for n, v in params.items() if n not in module},
            frozen={n: tuple(t.shape) for n, t in self._frozen.items()},
            buffers={n: tuple(module[n].shape) for n in buffers}, state_dict=state_dict,
            groups=groups, optimizer_type=_optimizer_type(groups),
            counters={"global_steps": int(model.get("global_steps", 0)),
                      "global_samples": int(model.get("global_samples", 0)),
                      "skipped_steps": int(model.get("skipped_steps", 0))},
            scaler=_scaler(self._loss_scaler, model) if dtype == torch.float16 else None,
            lr_scheduler=model.get("lr_scheduler"),
            client_state={k: v for k, v in model.items() if k not in DS_KEYS}, dtype=dtype,
            extra={"ds_config": config, "ds_version": model.get("ds_version"),
                   "no_optimizer_state": self._no_optimizer_state,
                   "gradient_accumulation_steps": gas if isinstance(gas, int) else None,
                   "model_states": model})

    # -- layouts -------------------------------------------------------------------------------
    _loss_scaler = None
    _no_optimizer_state = None

    def _zero12(self, file, model, optims, world):
        """Stages 1-2 and BF16_Optimizer: flat groups cut into W equal partitions."""
        shapes = model.get("param_shapes")
        first = optims[0]
        if shapes is None or "single_partition_of_fp32_groups" not in first:
            raise CheckpointError(f"{file}: no param_shapes / single_partition_of_fp32_groups: "
                                  "not a DeepSpeed ZeRO stage 1-2 checkpoint")
        stage = int(first.get("zero_stage", 1))
        stripped = "zero_stage" in first  # BF16_Optimizer keeps its partitions padded
        self._loss_scaler = first.get("loss_scaler")
        count = len(shapes)
        _check_partition_count(file, first.get("partition_count"), world)
        bases = [o["base_optimizer_state"] for o in optims]
        params, pieces = {}, {}
        for g in range(count):
            sizes = []
            for rank, osd in enumerate(optims):
                part = osd["single_partition_of_fp32_groups"][g]
                padding = osd["group_paddings"][g] if stripped else 0
                sizes.append(part.numel() + padding)
                state = _group_state(bases[rank], g)
                self._flat(rank, g)["master"] = part.reshape(-1)
                self._flat(rank, g).update({k: v.reshape(-1) for k, v in state.items()
                                            if torch.is_tensor(v) and v.dim() > 0})
            size = sizes[0]
            if any(s != size for s in sizes):
                raise CheckpointError(f"{file}: param group {g}'s partitions differ in size "
                                      f"between ranks ({sizes}); the files are from different "
                                      "saves")
            paddings = (first.get("param_alignment_paddings") or [None] * count)[g] or \
                [0] * len(shapes[g])
            offset = 0
            for (name, shape), pad in zip(shapes[g].items(), paddings):
                n = _numel(shape)
                cuts = []
                for rank in range(world):
                    lo, hi = max(offset, rank * size), min(offset + n, (rank + 1) * size)
                    if lo < hi:
                        cuts.append((rank, lo - rank * size, hi - lo))
                params[name] = (tuple(shape), g)
                pieces[name] = (g, cuts)
                offset += n + pad
            if offset > size * world:
                raise CheckpointError(f"{file}: param group {g} needs {offset} values, its "
                                      f"{world} partitions hold {size * world}")
        self._pieces = pieces
        groups = [_group_meta(_group_state(bases[0], g), _group_hyper(bases[0], g),
                              first.get("base_optimizer_state_step")) for g in range(count)]
        return stage, params, groups

    def _zero3(self, file, model, optims, world):
        """Stage 3: every parameter cut into W equal parts, one flat per sub-group and rank."""
        first = optims[0]
        if "fp32_flat_groups" not in first:
            raise CheckpointError(f"{file}: its optimizer files hold no fp32_flat_groups: not a "
                                  "DeepSpeed ZeRO stage-3 checkpoint")
        self._loss_scaler = first.get("loss_scaler")
        _check_partition_count(file, first.get("partition_count"), world)
        shapes = model["param_shapes"]
        torch_state = first["optimizer_state_dict"]
        owner = {sub: g for g, group in enumerate(torch_state["param_groups"])
                 for sub in group["params"]}
        if len(shapes) != len(first["fp32_flat_groups"]) or set(owner) != set(range(len(shapes))):
            raise CheckpointError(f"{file}: {len(shapes)} sub-groups of parameters but "
                                  f"{len(first['fp32_flat_groups'])} fp32 flat groups")
        params, pieces = {}, {}
        for rank, osd in enumerate(optims):
            state = osd["optimizer_state_dict"]["state"]
            for sub, flat in enumerate(osd["fp32_flat_groups"]):
                self._flat(rank, sub)["master"] = flat.reshape(-1)
                self._flat(rank, sub).update({k: v.reshape(-1) for k, v in
                                              state.get(sub, {}).items()
                                              if torch.is_tensor(v) and v.dim() > 0})
        for sub, group_shapes in enumerate(shapes):
            offset = 0
            for name, shape in group_shapes.items():
                n = _numel(shape)
                part = -(-n // world)
                cuts = [(rank, offset, min(part, n - rank * part)) for rank in range(world)
                        if n - rank * part > 0]
                params[name] = (tuple(shape), owner[sub])
                pieces[name] = (sub, cuts)
                offset += part
            if offset > first["fp32_flat_groups"][sub].numel():
                raise CheckpointError(f"{file}: sub-group {sub} needs {offset} values per rank, "
                                      f"its flat holds {first['fp32_flat_groups'][sub].numel()}")
        self._pieces = pieces
        groups = []
        for g, group in enumerate(torch_state["param_groups"]):
            subs = group["params"]
            state = torch_state["state"].get(subs[0], {}) if subs else {}
            groups.append(_group_meta(state, {k: v for k, v in group.items() if k != "params"}))
        return 3, params, groups

    def _zero0(self, file, model, buffers, group_names):
        """Stage 0: whole weights in `module` (fp32 masters when the model computed in fp32),
        torch's per-parameter optimizer state when zeroshard can name its parameters."""
        module, optim = model["module"], model.get("optimizer")
        candidates = [k for k in module if k not in buffers]
        for j, name in enumerate(candidates):
            self._flat(0, j)["master"] = module[name].reshape(-1)
            self._pieces[name] = (j, [(0, 0, module[name].numel())])
        weights_only = {n: (tuple(module[n].shape), 0) for n in candidates}
        dtypes = {module[n].dtype for n in candidates if module[n].is_floating_point()}
        count = len(optim["param_groups"]) if isinstance(optim, dict) and \
            "param_groups" in optim and "state" in optim else None
        if group_names is None and count == 1:
            group_names = [candidates]
        names_of = group_names or []
        why = None
        if optim is None:
            why = "holds no optimizer state"
        elif count is None:
            why = ("holds an optimizer state that is not a torch optimizer's state_dict "
                   "(DeepSpeed's fp16/bf16 optimizer wrappers at stage 0 are not supported)")
        elif dtypes - {torch.float32}:
            why = f"keeps no fp32 masters of its {sorted(map(str, dtypes))} model"
        elif group_names is None:
            why = (f"is a stage-0 DeepSpeed checkpoint, which does not record which parameter "
                   f"is in which of its {count} param groups; load it with "
                   "engine.load_checkpoint (the engine's param groups name them) instead of "
                   "converting it")
        elif count != len(names_of) or any(len(n) != len(g["params"]) for n, g in
                                           zip(names_of, optim["param_groups"])):
            sizes = [len(g["params"]) for g in optim["param_groups"]]
            why = (f"has {count} param groups of {sizes} parameters, this optimizer "
                   f"{len(names_of)} of {[len(n) for n in names_of]}")
        if why is not None:
            self._no_optimizer_state = f"{file} {why}"
            return weights_only, None
        params, groups = {}, []
        for g, (group, names) in enumerate(zip(optim["param_groups"], names_of)):
            first_state = {}
            for name, index in zip(names, group["params"]):
                state = optim["state"].get(index, {})
                first_state = first_state or state
                self._flats[0][self._pieces[name][0]].update(
                    {k: v.reshape(-1) for k, v in state.items()
                     if torch.is_tensor(v) and v.dim() > 0})
                params[name] = (tuple(module[name].shape), g)
            groups.append(_group_meta(first_state, {k: v for k, v in group.items()
                                                    if k != "params"}))
        return params, groups

    def _flat(self, rank: int, j: int) -> dict:
        while len(self._flats) <= rank:
            self._flats.append([])
        while len(self._flats[rank]) <= j:
            self._flats[rank].append({})
        return self._flats[rank][j]

    def _frozen_values(self, path, model, stage3, world, params, buffers) -> dict:
        """Untrained parameters, whole (stage 3: reassembled from every rank's part)."""
        shapes = model.get("frozen_param_shapes")
        if shapes is None:  # stages 0-1: the module holds them whole
            shared = model.get("shared_params") or {}
            return {k: t for k, t in model["module"].items()
                    if k not in params and k not in buffers and k not in shared}
        fragments = model.get("frozen_param_fragments") or {}
        if not stage3:
            return {n: fragments[n].reshape(tuple(shapes[n])) for n in shapes}
        ranks = [model] + [deepspeed_pickle.load(os.path.join(path, _model3(r)))
                           for r in range(1, world)]
        out = {}
        for name, shape in shapes.items():
            parts = [r["frozen_param_fragments"][name].reshape(-1) for r in ranks]
            out[name] = torch.cat(parts)[:_numel(shape)].reshape(tuple(shape))
        return out

    # -- Portable ------------------------------------------------------------------------------
    def tensor(self, key: str) -> torch.Tensor:
        """One whole tensor, reassembled from the ranks' partitions."""
        kind, state, name = keys.split_key(key)
        if kind == keys.BUFFER:
            return self._module[name]
        if kind == keys.FROZEN:
            return self._frozen[name]
        what = state if kind == keys.OPTIM else "master"
        shape = self.params[name][0]
        j, cuts = self._pieces[name]
        chunks = []
        for rank, start, length in cuts:
            flat = self._flats[rank][j]
            if what not in flat:  # never stepped (stage 0 without a gradient): zeros
                return torch.zeros(shape, device="cpu")
            chunks.append(flat[what][start:start + length])
        return torch.cat(chunks).float().reshape(shape) if chunks else torch.zeros(shape, device="cpu")

    def deepspeed_client_state(self, load_optimizer_states: bool = True,
                               load_lr_scheduler_states: bool = True,
                               load_module_only: bool = False) -> dict:
        """What DeepSpeed's load_checkpoint returns as client_state: the model states' keys it
        does not consume itself."""
        consumed = {"module"}
        if not load_module_only:
            consumed |= {"skipped_steps", "global_steps", "dp_world_size", "mp_world_size",
                         "data_sampler", "random_ltd"}
        if load_lr_scheduler_states:
            consumed.add("lr_scheduler")
        if load_optimizer_states:
            consumed.add("optimizer")
        return {k: v for k, v in self.extra["model_states"].items() if k not in consumed}


def _optim_files(path: str, names: list[str], world: int, config: dict) -> list[str]:
    """The W optimizer files, in rank order ([] if there are none); CheckpointError if some
    rank's file is missing or files of more ranks are there."""
    found: dict[bool, dict[int, str]] = {True: {}, False: {}}
    for name in names:
        match = _OPTIM.match(name)
        if match:
            found[bool(match.group(1))][int(match.group(2))] = name
    bf16 = bool((config.get("bf16") or {}).get("enabled")) if found[True] and found[False] \
        else bool(found[True])
    files = found[bf16]
    if not files:
        return []
    missing = [r for r in range(world) if r not in files]
    if missing:
        prefix = "bf16_" if bf16 else ""
        name = f"{prefix}zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt"
        raise CheckpointError(f"{path}: {name} is missing ({len(missing)} of the {world} ranks' "
                              "optimizer files are); was the save interrupted?")
    extra = sorted(r for r in files if r >= world)
    if extra:
        raise CheckpointError(f"{os.path.join(path, files[extra[0]])}: an optimizer file of rank "
                              f"{extra[0]}, but the checkpoint was saved by {world} ranks (left "
                              "from an earlier save into the same tag?)")
    return [os.path.join(path, files[r]) for r in range(world)]


def _optimizer_state(file: str) -> dict:
    state = deepspeed_pickle.load(file).get("optimizer_state_dict")
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} has no optimizer_state_dict: not a DeepSpeed ZeRO "
                              "optimizer file")
    return state


def _check_partition_count(file: str, count, world: int) -> None:
    counts = count if isinstance(count, list) else [count]
    if any(c not in (None, world) for c in counts):
        raise CheckpointError(f"{file}: partitioned over {counts} ranks but saved by {world} "
                              "(MiCS or hierarchical partitioning); not supported")


def _group_state(base, g: int) -> dict:
    """Param group g's torch optimizer state (rigid state_dict, or elastic list form)."""
    if isinstance(base, list):
        return base[g]
    index = base["param_groups"][g]["params"][0]
    return base["state"].get(index, {})


def _group_hyper(base, g: int) -> dict:
    if isinstance(base, list):
        return {}  # the elastic form keeps no hyper-parameters: the live optimizer's stay
    return {k: v for k, v in base["param_groups"][g].items() if k != "params"}


def _group_meta(state: dict, hyper: dict, step=None) -> dict:
    """A param group as zeroshard records it; `step` always as torch's float32 0-dim tensor."""
    from ..core.state import jsonable  # noqa: PLC0415

    scalars, tensor_keys, order = {}, [], list(state)
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            tensor_keys.append(key)
        elif key == "step":
            scalars[key] = {"value": float(value), "dtype": "torch.float32"}
        else:
            scalars[key] = {"value": jsonable(value),
                            "dtype": str(value.dtype) if torch.is_tensor(value) else None}
    step = step if step is not None else hyper.get("step")
    if "step" not in scalars and step is not None and state:  # FusedAdam keeps it in the group
        scalars["step"] = {"value": float(step), "dtype": "torch.float32"}
        order.insert(0, "step")
    kept = {}
    for key, value in hyper.items():
        try:
            kept[key] = jsonable(value)
        except TypeError:
            pass  # e.g. a callable: the live optimizer's stays
    return {"hyper": kept, "scalars": scalars, "tensor_keys": tensor_keys, "order": order}


def _optimizer_type(groups) -> str:
    hyper = groups[0]["hyper"] if groups else {}
    if "betas" in hyper:
        return "AdamW" if hyper.get("decoupled_weight_decay", True) else "Adam"
    return "unknown"


def _scaler(scaler, model: dict) -> dict | None:
    """DeepSpeed's fp16 loss scaler as zeroshard's LossScaler.state_dict()."""
    if scaler is None:
        return None
    attrs = vars(scaler)
    if not attrs.get("dynamic"):
        return {"scale": float(attrs.get("cur_scale", 1.0)), "hysteresis_left": 1,
                "clean_steps": 0, "overflows": int(model.get("skipped_steps", 0))}
    # DeepSpeed counts iterations and remembers the last overflowing one; zeroshard counts the
    # clean steps since then.
    clean = int(attrs["cur_iter"]) - int(attrs["last_overflow_iter"]) - 1
    return {"scale": float(attrs["cur_scale"]), "hysteresis_left": int(attrs["cur_hysteresis"]),
            "clean_steps": max(clean, 0), "overflows": int(model.get("skipped_steps", 0))}
