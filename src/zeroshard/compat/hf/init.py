"""Hugging Face's weight initialization under `zeroshard.Init`, on gathered parameters.

A transformers `PreTrainedModel` initializes its weights at the end of its constructor
(`post_init` -> `init_weights` -> `initialize_weights`), walking the model itself (children
first, each sub-model with its own `_initialize_weights`) rather than through `Module.apply`; by
then most of its modules are already partitioned, so writes would land in empty tensors. While
Init is active, `PreTrainedModel.initialize_weights` is replaced by the same walk in the same
order, with each module's own parameters and its direct children's (a model's `_init_weights`
writes `module.c_proj.weight` from the parent) gathered around the call: every rank runs the
init on the whole tensors (so the random generator advances exactly as in a normal
construction), rank 0's values are broadcast, and each rank keeps its slice. Weights are thus
bitwise those of a normal construction under the same seed.

A model built so also gets instance methods for stage 3 (`attach_stage3_methods`): `generate`
keeps the model gathered across decode steps while stage3_max_live_parameters allows, and
`resize_token_embeddings` resizes partitioned embeddings.

transformers is never imported here: the class is found in `sys.modules` (a model cannot be
built without it being imported first). Core's Init reaches this module only through
`core.init.register_library_hooks` (zeroshard/__init__.py registers it): `patch_init` and
`model_built` below are its LibraryHooks, so core depends neither on transformers nor on compat.
"""

from __future__ import annotations

import functools
import inspect
import sys
from contextlib import nullcontext

import torch
from torch import nn

from ...core.gathered import GatheredParameters
from ...core.init_units import leave_init_unit, partition_new_parameters
from ...core.layout import INIT_ATTR, ZeroParamStatus, full_shape, set_status
from ...core.owners import is_managed

HF_FLAG = "_is_hf_initialized"


def pretrained_base():
    """transformers' `PreTrainedModel` if transformers is imported, else None."""
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "PreTrainedModel", None)


def patch_initialize_weights(init_ctx):
    """Replace `PreTrainedModel.initialize_weights` by the gathered walk; returns an undo callable
    (a no-op when transformers is not imported or has no such method)."""
    base = pretrained_base()
    if base is None or "initialize_weights" not in base.__dict__:
        return lambda: None
    original = base.__dict__["initialize_weights"]

    def initialize_weights(model):
        """`initialize_weights` on gathered parameters (zeroshard.Init is active)."""
        initialize_gathered(init_ctx, model)

    base.initialize_weights = initialize_weights

    def undo():
        base.initialize_weights = original

    return undo


def _guard():
    """transformers' guard making torch.nn.init skip `_is_hf_initialized` tensors, if it has one."""
    init_module = sys.modules.get("transformers.initialization")
    guard = getattr(init_module, "guard_torch_init_functions", None)
    return guard() if guard is not None else nullcontext()


def _caller(fn, model):
    """`fn(module)` with `is_custom_code` passed where this transformers version takes it."""
    try:
        takes_flag = len(inspect.signature(fn).parameters) >= 2
    except (TypeError, ValueError):
        takes_flag = False
    if not takes_flag:
        return fn
    probe = getattr(model, "is_custom_code", None) or getattr(model, "is_remote_code", None)
    custom = bool(probe()) if probe is not None else False
    return lambda module: fn(module, custom)


@torch.no_grad()
def initialize_gathered(init_ctx, model: nn.Module) -> None:
    """Run `model`'s Hugging Face weight init module by module, children first (the order of
    transformers' own walk), each call on gathered parameters (see the module docstring)."""
    base = pretrained_base()

    def walk(module: nn.Module, fn) -> None:
        for child in module.children():
            walk(child, _caller(child._initialize_weights, child)
                 if isinstance(child, base) else fn)
        params = list(module.parameters(recurse=False))
        for child in module.children():
            if not isinstance(child, base):
                params.extend(child.parameters(recurse=False))
        run_gathered(init_ctx, module, params, fn)

    with _guard():
        walk(model, _caller(model._initialize_weights, model))


def run_gathered(init_ctx, module: nn.Module, params: list[nn.Parameter], fn) -> None:
    """`fn(module)` with the construction-partitioned `params` whole; rank 0's writes are kept.

    A module transformers will skip (flagged initialized, or every parameter flagged: loaded from
    a checkpoint) is not gathered; a write it makes anyway would be lost, so it is refused.
    """
    held = [p for p in params if hasattr(p, INIT_ATTR)]
    if getattr(module, HF_FLAG, False) or all(getattr(p, HF_FLAG, False) for p in held):
        versions = {id(p): p._version for p in held}
        fn(module)
        written = [p for p in held if p._version != versions[id(p)]]
        if written:
            raise RuntimeError(
                f"zeroshard.Init: the weight init of {type(module).__name__} wrote to a partitioned "
                "parameter flagged as already initialized; the write would be lost. Wrap it in "
                "zeroshard.GatheredParameters(params, modifier_rank=0).")
        return
    units, seen = [], set()
    for param in held:
        unit, comm = getattr(param, INIT_ATTR)
        if id(unit) not in seen and not unit.is_gathered:  # an outer gather keeps its own
            seen.add(id(unit))
            units.append((unit, comm))
    for unit, comm in units:
        comm.all_gather(unit.allocate(), unit.shard)
        set_status(unit, ZeroParamStatus.AVAILABLE)
    try:
        fn(module)
        for unit, comm in units:
            if comm.world_size > 1:
                comm.broadcast(unit.flat, src=0)  # every rank keeps rank 0's values
            unit.shard.copy_(unit.flat[slice(*unit.shard_bounds(comm.rank))])
    finally:
        for unit, _ in units:
            unit.release()
            for slot in unit.slots:  # these writes were kept
                init_ctx._versions[id(slot.param)] = slot.param._version


# -- Init's LibraryHooks (core/init.py) -----------------------------------------------------------
def patch_init(init_ctx):
    """Init's hook: transformers' weight init on gathered parameters; returns the undo."""
    return patch_initialize_weights(init_ctx)


def model_built(model: nn.Module) -> None:
    """Init's hook: a model built partitioned gets its stage-3 methods."""
    attach_stage3_methods(model)


# -- methods of a partitioned Hugging Face model ---------------------------------------------------
def attach_stage3_methods(model: nn.Module) -> None:
    """Give a Hugging Face model built partitioned a `generate` that keeps the model gathered
    across decode steps and a `resize_token_embeddings` that works on partitioned embeddings
    (instance attributes; a model that is not a transformers PreTrainedModel is left alone)."""
    base = pretrained_base()
    if base is None or not isinstance(model, base):
        return
    # transformers 5 gives generate() only to generative models (not BertForSequenceClassification).
    generate = getattr(model, "generate", None)
    if generate is not None:
        model.generate = functools.wraps(generate)(
            lambda *args, **kwargs: generate_gathered(model, generate, *args, **kwargs))
    resize = getattr(model, "resize_token_embeddings", None)
    if resize is not None:
        model.resize_token_embeddings = functools.wraps(resize)(
            lambda *args, **kwargs: resize_partitioned(model, resize, *args, **kwargs))


def generate_gathered(model: nn.Module, generate, *args, **kwargs):
    """`generate` on a model built partitioned and not yet wrapped: there are no per-unit gathers
    before initialize(), so the model is gathered whole for the call. Once an engine manages it,
    the engine's own stage-3 `generate` (compat/hf/generation.py, installed over this one)
    decides."""
    params = list(model.parameters())
    if any(is_managed(p) for p in params) or not any(hasattr(p, INIT_ATTR) for p in params):
        return generate(*args, **kwargs)
    with GatheredParameters(params):
        return generate(*args, **kwargs)


def resize_partitioned(model: nn.Module, resize, *args, **kwargs):
    """Hugging Face's `resize_token_embeddings` on gathered embeddings; the new embedding (and
    untied head) it builds are partitioned as Init would, with rank 0's values."""
    if any(is_managed(p) for p in model.parameters()):
        raise RuntimeError(
            "resize_token_embeddings on a model already wrapped by zeroshard.initialize(): its "
            "units are fixed by then. Resize before initialize() (as the Hugging Face Trainer "
            "does), then wrap the model.")
    embeddings = list({id(m.weight): m.weight for m in (model.get_input_embeddings(),
                                                        model.get_output_embeddings())
                       if isinstance(getattr(m, "weight", None), nn.Parameter)}.values())
    with GatheredParameters(embeddings):
        out = resize(*args, **kwargs)
        # transformers swaps the resized values into the old embedding parameter (`.data`):
        # keep them from the release below, which would empty that parameter again.
        resized = {id(p): p.data for p in embeddings
                   if hasattr(p, INIT_ATTR) and tuple(p.shape) != tuple(full_shape(p))}
    for param in embeddings:
        if id(param) in resized:
            leave_init_unit(param)
            param.data = resized[id(param)]
    partition_new_parameters(model)
    return out
