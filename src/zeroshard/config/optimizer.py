"""Checks of the config's `optimizer.params`, per optimizer type the engine builds from a config.

`optimizer.params` is free-form in DeepSpeed's schema and ends up as keyword arguments of a torch
optimizer, which reports a bad value from deep inside (`betas: [0.9]` as an IndexError, `lr: "1e-3"`
as a failed `<=`). Here every key of the types `build_optimizer` makes (Adam, AdamW, SGD,
Adagrad, Lion, Muon) is checked when the config is read, and each problem names
`optimizer.params.<key>` and the bad value. Types zeroshard cannot build (Lamb, OneBitAdam, ...)
are refused when the optimizer is built, so their parameters are not checked here.
"""

from __future__ import annotations

import difflib
import json
from typing import Any


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _number(lo: float = 0.0, hi: float | None = None, hi_open: bool = False):
    def check(value: Any) -> str | None:
        if not _is_number(value):
            return "expected a number"
        if value < lo:
            return f"must be at least {lo:g}"
        if hi is not None and (value >= hi if hi_open else value > hi):
            return f"must be {'below' if hi_open else 'at most'} {hi:g}"
        return None
    return check


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "expected true or false"


def _betas(value: Any) -> str | None:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return "expected two numbers [beta1, beta2], e.g. [0.9, 0.999]"
    if not all(_is_number(b) and 0.0 <= b < 1.0 for b in value):
        return "each beta must be a number in [0, 1)"
    return None


def _bias_correction(value: Any) -> str | None:
    if not isinstance(value, bool):
        return "expected true or false"
    if not value:
        return "false is not available: torch's Adam always corrects the moment bias"
    return None


_LR = {"lr": _number()}
_TORCH_FLAGS = {k: _flag for k in ("maximize", "foreach", "fused", "capturable", "differentiable")}
_ADAM = {**_LR, "betas": _betas, "eps": _number(), "weight_decay": _number(),
         "amsgrad": _flag, "bias_correction": _bias_correction, "adam_w_mode": _flag,
         "torch_adam": _flag, **_TORCH_FLAGS}


def _ns_method(value: Any) -> str | None:
    return None if value in ("gram", "standard") else 'expected "gram" or "standard"'


def _ns_dtype(value: Any) -> str | None:
    return None if value in ("auto", "fp32", "fp16", "bf16") else \
        'expected "auto", "fp32", "fp16" or "bf16"'


def _fp32_states(value: Any) -> str | None:
    if not isinstance(value, bool):
        return "expected true or false"
    return None if value else "false is not available: the Adam half keeps fp32 state"


def _per_head(value: Any) -> str | None:
    if not isinstance(value, bool):
        return "expected true or false"
    return None if not value else ("true is not supported yet: zeroshard orthogonalises each "
                                   "matrix whole; drop per_head_muon (or set it false)")


# DeepSpeed 0.19.8's Muon keys (engine._configure_basic_optimizer): the Muon half takes lr,
# momentum, weight_decay, ns_method; the Adam half lr, betas, eps, weight_decay; muon_lr /
# adam_lr set one half's lr. zeroshard_ns_dtype is zeroshard's own (core/muon.py).
_MUON = {**_LR, "muon_lr": _number(), "adam_lr": _number(),
         "momentum": _number(hi=1.0, hi_open=True), "weight_decay": _number(),
         "ns_method": _ns_method, "betas": _betas, "eps": _number(), "adam_w_mode": _flag,
         "torch_adam": _flag, "foreach": _flag, "fp32_optimizer_states": _fp32_states,
         "per_head_muon": _per_head, "zeroshard_ns_dtype": _ns_dtype}

SCHEMAS: dict[str, dict[str, Any]] = {
    "Adam": _ADAM,
    "AdamW": _ADAM,
    "SGD": {**_LR, "momentum": _number(), "dampening": _number(), "weight_decay": _number(),
            "nesterov": _flag, **_TORCH_FLAGS},
    "Adagrad": {**_LR, "lr_decay": _number(), "weight_decay": _number(), "eps": _number(),
                "initial_accumulator_value": _number(), **_TORCH_FLAGS},
    "Muon": _MUON,
    "Lion": {**_LR, "betas": _betas, "weight_decay": _number()},
}


def optimizer_param_problems(kind: str, params: dict) -> list[str]:
    """One line per bad `optimizer.params` key of a `kind` optimizer (empty when all are fine)."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        return []
    problems = []
    for key, value in params.items():
        where = f"optimizer.params.{key}"
        check = schema.get(key)
        if check is None:
            close = difflib.get_close_matches(str(key), list(schema), n=2, cutoff=0.6)
            hint = (" — did you mean " + " or ".join(f"'{c}'" for c in close) + "?") if close \
                else "; valid keys: " + ", ".join(schema)
            problems.append(f"unknown key '{where}' for optimizer {kind}{hint}")
            continue
        if value == "auto":
            problems.append(f"{where} = \"auto\": 'auto' is resolved by zeroshard.initialize() "
                            "(and the Hugging Face integration), not by load_config(); give a "
                            "number")
            continue
        why = check(value)
        if why:
            problems.append(f"{where} = {_show(value)}: {why}")
    if params.get("nesterov") is True and kind == "SGD" and \
            not (_is_number(params.get("momentum")) and params["momentum"] > 0
                 and params.get("dampening", 0) == 0):
        problems.append("optimizer.params.nesterov = true needs momentum > 0 and dampening 0 "
                        f"(got momentum {_show(params.get('momentum', 0))}, dampening "
                        f"{_show(params.get('dampening', 0))})")
    return problems
