"""The `zero_optimization.leaf_module` section (DeepSpeed 0.18): modules stage 3 gathers whole at
their forward, chosen by class, by name or by name suffix (core/leaf.py applies it at
`initialize()`). The defaults are DeepSpeed's: Hugging Face's mixture-of-experts blocks, whose
experts run in data-dependent order."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

#: DeepSpeed 0.19.8's default leaf classes (fully qualified: a model without them matches none).
DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


def _strings(v: Any) -> list[str]:
    # One string stands for a list of one, as in DeepSpeed; duplicates are dropped, order kept.
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a string or a list of strings")
    return list(dict.fromkeys(v))


_Names = Annotated[list[str], BeforeValidator(_strings)]


class LeafModuleConfig(BaseModel):
    """Modules stage 3 gathers whole at their forward (DeepSpeed's ZeRO-3 leaf modules)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    classes: _Names = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Module classes, by `__name__` or fully qualified `module.qualname` (subclasses do not
    match a name); the default is Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse MoE blocks."""
    names: _Names = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    """Module names as `model.named_modules()` gives them (e.g. "model.layers.0.mlp")."""
    name_suffixes: _Names = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))
    """Every module whose name ends with one of these (e.g. "mlp.experts")."""

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, data: Any) -> Any:
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ValueError("expected a mapping with classes / names / name_suffixes")
        return data
