"""`"auto"` config values (the Hugging Face convention), resolved before the config is validated.

What `initialize` knows decides each value; where it knows nothing, a documented default:

  train_micro_batch_size_per_gpu   the data loader's batch size (a DataLoader passed as
                                   training_data, or the HF integration's per-device batch), else 1
  gradient_accumulation_steps      the HF integration's value, else 1
  train_batch_size                 micro x accumulation x world size
  gradient_clipping                the HF integration's max_grad_norm, else 1.0 (HF's default)
  fp16.enabled / bf16.enabled      the model's parameter dtype (fp16 / bf16), else false
  zero_optimization.reduce_bucket_size                h^2         (h = the model's hidden size,
  zero_optimization.stage3_prefetch_bucket_size       0.9 h^2      from model.config.hidden_size,
  zero_optimization.stage3_param_persistence_threshold 10 h        n_embd or d_model)
                                   else DeepSpeed's defaults 5e8 / 5e7 / 1e5
Any other "auto" (optimizer or scheduler hyper-parameters, ...) can only come from an integration
that knows them; left unresolved it is an error naming the key. One log line says what each
"auto" became.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import torch

from .schema import ConfigError

log = logging.getLogger("zeroshard")

ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                 "stage3_param_persistence_threshold": 100_000}


def hidden_size(model: torch.nn.Module | None) -> int | None:
    """The model's hidden size from its config (HF: hidden_size / n_embd / d_model), or None."""
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _model_precision(model: torch.nn.Module | None) -> str | None:
    dtypes = {p.dtype for p in model.parameters()} if model is not None else set()
    if dtypes == {torch.bfloat16}:
        return "bf16"
    if dtypes == {torch.float16}:
        return "fp16"
    return None


def resolve_auto(raw: dict, *, model: torch.nn.Module | None = None, world_size: int = 1,
                 loader_batch: int | None = None, known: dict[str, Any] | None = None) -> dict:
    """A copy of the raw config dict with every "auto" replaced; `known` maps dotted keys
    (e.g. "optimizer.params.lr") to values an integration supplies. Raises ConfigError for an
    "auto" nothing can resolve."""
    if not isinstance(raw, dict) or "auto" not in json.dumps(raw):
        return raw
    cfg = copy.deepcopy(raw)
    known = dict(known or {})
    resolved: dict[str, Any] = {}
    micro = known.get("train_micro_batch_size_per_gpu", loader_batch or 1)
    gas = known.get("gradient_accumulation_steps", 1)
    h = hidden_size(model)
    precision = _model_precision(model)
    rules = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": known.get("gradient_clipping", 1.0),
        "fp16.enabled": known.get("fp16.enabled", precision == "fp16"),
        "bf16.enabled": known.get("bf16.enabled", precision == "bf16"),
        "zero_optimization.reduce_bucket_size":
            h * h if h else ZERO_DEFAULTS["reduce_bucket_size"],
        "zero_optimization.stage3_prefetch_bucket_size":
            int(0.9 * h * h) if h else ZERO_DEFAULTS["stage3_prefetch_bucket_size"],
        "zero_optimization.stage3_param_persistence_threshold":
            10 * h if h else ZERO_DEFAULTS["stage3_param_persistence_threshold"],
    }
    rules.update(known)
    rules["train_batch_size"] = known.get("train_batch_size", None)

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, dotted + ".")
            elif value == "auto" and dotted != "train_batch_size":
                if rules.get(dotted) is None:
                    raise ConfigError(
                        f"config key {dotted} is \"auto\", which only an integration that knows "
                        "it can fill in (e.g. zeroshard.integrations.hf); give a value")
                node[key] = rules[dotted]
                resolved[dotted] = node[key]

    walk(cfg, "")
    if cfg.get("train_batch_size") == "auto":
        cfg["train_batch_size"] = rules["train_batch_size"] or \
            cfg.get("train_micro_batch_size_per_gpu", micro) * \
            cfg.get("gradient_accumulation_steps", gas) * world_size
        resolved["train_batch_size"] = cfg["train_batch_size"]
    if resolved:
        where = f"hidden size {h}" if h else "no hidden size found"
        log.warning("zeroshard: \"auto\" resolved (%s): %s", where,
                    ", ".join(f"{k}={v}" for k, v in resolved.items()))
    return cfg
