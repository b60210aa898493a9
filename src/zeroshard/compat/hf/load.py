"""Hugging Face models built partitioned, with pretrained weights streamed slice by slice.

`from_pretrained(path, config=ds_config)` at stage 3:
  1. reads the checkpoint's headers only (safetensors: single file or sharded with an index);
  2. builds the model under `zeroshard.Init` with weight init switched off (transformers'
     `no_init_weights`), so every parameter is split 1/N per rank as it is built, and ties its
     weights;
  3. checks the checkpoint against the model - unexpected keys and wrong shapes are an error
     naming them, raised before anything is written;
  4. each rank reads, for each parameter, only the byte range of its own 1/N slice (one `pread`
     per parameter: `checkpoint/safetensors_read.py`), casts it to the model's dtype and writes it
     into its construction slice. No rank holds a whole tensor or the model;
  5. parameters the checkpoint lacks get Hugging Face's init, gathered one module at a time
     (`core/init_hf.py`), loaded ones flagged `_is_hf_initialized` so that init skips them.
`initialize()` later re-lays the slices into stage-3 units without gathering them.
Below stage 3 it is transformers' own `from_pretrained`. `from_config` is the same without step 4.

A `.bin` (pickle) checkpoint is refused unless `allow_pickle=True`: unpickling can run code. With
it, the file is memory-mapped (`torch.load(mmap=True, weights_only=True)`) and each rank still
copies only its slices.
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch
import torch.distributed as dist
from torch import nn

from ...checkpoint.safetensors_read import checkpoint_entries
from ...dist import init_distributed
from ...config.schema import load_config
from ...dist.hostmem import host_copy, to_device
from ...core.init import Init
from .init import HF_FLAG, initialize_gathered
from ...core.layout import INIT_ATTR, full_shape

BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def _stage(config) -> int:
    """The ZeRO stage of a DeepSpeed-style config (0 when there is none)."""
    if config is None:
        return 0
    init_distributed()
    return load_config(config, world_size=dist.get_world_size()).zero_optimization.stage


def _model_class(hf_config, model_class):
    """The class to build: given, else the config's first architecture, else AutoModelForCausalLM."""
    import transformers
    if model_class is not None:
        return model_class
    for name in getattr(hf_config, "architectures", None) or ():
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModelForCausalLM


def _build(model_class, hf_config, kwargs):
    """`model_class` from `hf_config` (an Auto class or a concrete one), with `kwargs`."""
    if hasattr(model_class, "_from_config"):
        return model_class._from_config(hf_config, **kwargs)
    return model_class.from_config(hf_config, **kwargs)


def from_config(hf_config, config=None, model_class=None, **hf_kwargs):
    """A model built from `hf_config` with Hugging Face's init: partitioned at stage 3 (built
    under zeroshard.Init), plain below it. `model_class` defaults to AutoModelForCausalLM."""
    import transformers
    model_class = model_class or transformers.AutoModelForCausalLM
    with Init(config=config, enabled=_stage(config) == 3):
        return _build(model_class, hf_config, hf_kwargs)


class PickleEntry:
    """One tensor of a memory-mapped `.bin` checkpoint (same interface as TensorEntry)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)

    def read(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements `[start, end)` of the flattened tensor (a host copy of only those pages)."""
        return host_copy(self.tensor.reshape(-1)[start:end])


def _pickle_entries(directory: str, allow_pickle: bool) -> dict | None:
    """The tensors of a `.bin` checkpoint (memory-mapped), if allowed; None if there is none."""
    index = os.path.join(directory, BIN_INDEX)
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    elif os.path.isfile(os.path.join(directory, BIN_SINGLE)):
        files = [BIN_SINGLE]
    else:
        return None
    if not allow_pickle:
        raise ValueError(
            f"{directory} holds a pickle checkpoint ({files[0]}) and no model.safetensors. "
            "Loading a pickle can run arbitrary code from the file; convert it to safetensors, "
            "or pass allow_pickle=True if you trust its origin (it is then read with "
            "torch.load(weights_only=True, mmap=True)).")
    entries = {}
    for name in files:
        state = torch.load(os.path.join(directory, name), map_location="cpu", mmap=True,
                           weights_only=True)
        entries.update({k: PickleEntry(v) for k, v in state.items()})
    return entries


def _entries(directory: str, allow_pickle: bool) -> dict:
    """Every tensor of the checkpoint in `directory`, by name (headers only for safetensors)."""
    if not os.path.isdir(directory):
        raise ValueError(
            f"zeroshard's stage-3 from_pretrained reads local checkpoints only; {directory!r} is "
            "not a directory. Download it first (huggingface_hub.snapshot_download(repo_id)) "
            "and pass the directory.")
    entries = checkpoint_entries(directory)
    if entries is None:
        entries = _pickle_entries(directory, allow_pickle)
    if entries is None:
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*")))
        raise ValueError(f"{directory} holds no model.safetensors, model.safetensors.index.json "
                         f"or pytorch_model.bin (found {found[:10]})")
    return entries


def _resolve_dtype(dtype, hf_config, entries):
    """Hugging Face's dtype rule: a dtype, a name, or "auto" (the config's, else the checkpoint's
    first floating dtype); None means torch's default dtype."""
    if dtype is None:
        return torch.get_default_dtype()
    if dtype == "auto":
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if dtype is None:
            dtype = next((e.dtype for e in entries.values() if e.dtype.is_floating_point),
                         torch.get_default_dtype())
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _rename(names: list[str], model: nn.Module) -> dict[str, str]:
    """checkpoint name -> model name: a base model's checkpoint into a model with a head, or the
    reverse, differ by `base_model_prefix.`."""
    prefix = getattr(model, "base_model_prefix", "")
    keys = set(model.state_dict(keep_vars=True).keys())
    if prefix and names and not any(n.startswith(prefix + ".") for n in names) and \
            any(k.startswith(prefix + ".") for k in keys):
        return {n: f"{prefix}.{n}" if f"{prefix}.{n}" in keys else n for n in names}
    if prefix and any(n.startswith(prefix + ".") for n in names) and \
            not any(k.startswith(prefix + ".") for k in keys):
        return {n: n[len(prefix) + 1:] if n.startswith(prefix + ".") else n for n in names}
    return {n: n for n in names}


def _ignored(model: nn.Module, attr: str) -> re.Pattern | None:
    """One regex of a model's `_keys_to_ignore_on_load_*` patterns (None when it has none)."""
    patterns = set(getattr(model, attr, None) or ())
    if attr.endswith("unexpected"):
        patterns |= {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def plan_load(model: nn.Module, entries: dict) -> tuple[dict, list[str]]:
    """Match checkpoint tensors to the model: (model tensor -> entry, missing names). Unexpected
    keys and wrong shapes raise an error naming them; nothing has been written then."""
    rename = _rename(list(entries), model)
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    for name, buf in model.named_buffers(remove_duplicate=False):
        if name in model.state_dict(keep_vars=True):  # persistent buffers only
            aliases.setdefault(id(buf), []).append(name)
            tensors[id(buf)] = buf
    owner = {name: key for key, names in aliases.items() for name in names}
    ignore = _ignored(model, "_keys_to_ignore_on_load_unexpected")
    unexpected = sorted(n for n in entries if rename[n] not in owner
                        and not (ignore is not None and ignore.search(n)))
    plan, wrong = {}, []
    for name, entry in entries.items():
        key = owner.get(rename[name])
        if key is None or key in plan:
            continue
        shape = tuple(full_shape(tensors[key]))
        if tuple(entry.shape) != shape:
            wrong.append(f"{name}: checkpoint {list(entry.shape)}, model {list(shape)}")
        plan[key] = (tensors[key], entry)
    if unexpected or wrong:
        raise ValueError(
            f"from_pretrained: the checkpoint does not fit {type(model).__name__}; nothing was "
            f"loaded. Unexpected keys ({len(unexpected)}): {unexpected[:8]}. Wrong shapes "
            f"({len(wrong)}): {wrong[:8]}. Check model_class= and the config.")
    ignore_missing = _ignored(model, "_keys_to_ignore_on_load_missing")
    missing = sorted(names[0] for key, names in aliases.items() if key not in plan
                     and not (ignore_missing is not None and ignore_missing.search(names[0])))
    return plan, missing


@torch.no_grad()
def stream_weights(plan: dict) -> None:
    """Copy each planned tensor in: this rank's slice only for a parameter partitioned at
    construction, the whole tensor otherwise (small: buffers and frozen parameters)."""
    for tensor, entry in plan.values():
        owner = getattr(tensor, INIT_ATTR, None)
        if owner is None:
            tensor.data.copy_(entry.read().view(entry.shape))
        else:
            unit, comm = owner
            lo, hi = unit.shard_bounds(comm.rank)
            for slot in unit.slots:
                if slot.param is not tensor:
                    continue
                start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
                if start < end:
                    part = to_device(entry.read(start - slot.offset, end - slot.offset),
                                     unit.shard.device)
                    unit.shard[start - lo:end - lo].copy_(part)
        setattr(tensor, HF_FLAG, True)


def from_pretrained(name_or_path, config=None, model_class=None, allow_pickle: bool = False,
                    **hf_kwargs):
    """A pretrained Hugging Face model; at stage 3 built partitioned and loaded slice by slice
    (module docstring), below it transformers' own `from_pretrained(name_or_path, **hf_kwargs)`.

    At stage 3, `dtype` / `torch_dtype` choose the parameters' dtype ("auto" by default),
    `hf_config` replaces the directory's config.json, and the other keyword arguments go to the
    model's construction (`_from_config`).
    """
    import transformers
    if _stage(config) != 3:
        cls = model_class or transformers.AutoModelForCausalLM
        return cls.from_pretrained(name_or_path, **hf_kwargs)
    from transformers import initialization
    entries = _entries(os.fspath(name_or_path), allow_pickle)
    hf_config = hf_kwargs.pop("hf_config", None) or \
        transformers.AutoConfig.from_pretrained(name_or_path)
    dtype = hf_kwargs.pop("dtype", hf_kwargs.pop("torch_dtype", "auto"))
    dtype = _resolve_dtype(dtype, hf_config, entries)
    # The weights keep the dtype asked for (Hugging Face's rule), not the config's precision as
    # Init's own default would: an fp32 checkpoint's values reach the fp32 masters unrounded.
    kept = dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else None
    with Init(config=config, dtype=kept) as init_ctx:
        with initialization.no_init_weights():
            model = _build(_model_class(hf_config, model_class), hf_config,
                           dict(hf_kwargs, dtype=dtype))
        model.tie_weights()
        plan, missing = plan_load(model, entries)
        stream_weights(plan)
        # As transformers does after loading: only what is not flagged as loaded is initialized.
        initialize_gathered(init_ctx, model)
    model.eval()  # as transformers' from_pretrained returns it
    return model
