"""Value types of the config schema: strict checks for the numbers, booleans, strings and names
that DeepSpeed JSON configs hold (integral floats such as 2e8 are whole numbers; "yes" is not a
boolean; 'auto' is left to `initialize()`), and the optimizer / scheduler names DeepSpeed knows.
"""

import difflib
import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

# -- Value checks. Own validators instead of pydantic's lax coercion: DeepSpeed JSON writes
# sizes as 2e8 (a float), but "yes" must not become True and 2.5 must not become 2.

def _auto_error(what: str) -> ValueError:
    return ValueError(f"'auto' is resolved by zeroshard.initialize() (and the Hugging Face "
                      f"integration), not by load_config(); give {what}")


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(lo: int | None = None, hi: int | None = None):
    def check(v: Any) -> int:
        if v == "auto":
            raise _auto_error("a number")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"expected a whole number, got {_show(v)}")
        if isinstance(v, float):
            if not v.is_integer():
                raise ValueError("expected a whole number (integral floats like 2e8 are fine)")
            v = int(v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise ValueError(f"must be {bound}")
        return v
    return Annotated[int, BeforeValidator(check)]


def _float(lo: float | None = None, *, above: bool = False, hi: float | None = None):
    def check(v: Any) -> float:
        if v == "auto":
            raise _auto_error("a number")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise ValueError(f"expected a number, got {_show(v)}")
        if lo is not None and (v <= lo if above else v < lo):
            raise ValueError(f"must be {'greater than' if above else 'at least'} {lo}")
        if hi is not None and v > hi:
            raise ValueError(f"must be at most {hi}")
        return float(v)
    return Annotated[float, BeforeValidator(check)]


def _check_bool(v: Any) -> bool:
    if v == "auto":
        raise _auto_error("true or false")
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false (a JSON boolean), got {_show(v)}")
    return v


def _check_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {_show(v)}")
    return v


def _check_names(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of module class names (strings)")
    return v


def _choice(*options: str, aliases: dict[str, str] | None = None):
    def check(v: Any) -> str:
        key = v.lower() if isinstance(v, str) else v
        key = (aliases or {}).get(key, key)
        if key not in options:
            raise ValueError("expected one of " + ", ".join(repr(o) for o in options))
        return key
    return BeforeValidator(check)


Bool = Annotated[bool, BeforeValidator(_check_bool)]
Str = Annotated[str, BeforeValidator(_check_str)]
AnyInt = _int()
NonNegInt = _int(0)
PosInt = _int(1)
NonNegFloat = _float(0.0)


def _check_period(v: Any) -> Any:
    # accelerate always writes steps_per_print: inf ("never"); DeepSpeed takes it.
    if v is None or (isinstance(v, float) and v == float("inf")) or \
            (isinstance(v, str) and v.lower() in ("inf", "infinity")):
        return None
    return v


#: A period in steps; `inf` (or null) means never.
Period = Annotated[PosInt | None, BeforeValidator(_check_period)]
PosFloat = _float(0.0, above=True)
Device = Annotated[Literal["none", "cpu", "nvme"], _choice("none", "cpu", "nvme")]
_DTYPE = _choice("fp32", "fp16", "bf16", aliases={"bfp16": "bf16"})

# Canonical spellings; DeepSpeed matches optimizer names case-insensitively.
DEEPSPEED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion", "OneBitAdam",
                        "ZeroOneAdam", "OneBitLamb", "MuAdam", "MuAdamW", "MuSGD", "Muon")
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _match_name(kind: str, names: tuple[str, ...]):
    by_lower = {n.lower(): n for n in names}

    def check(v: Any) -> str:
        if not isinstance(v, str):
            raise ValueError(f"expected a {kind} name (string), got {_show(v)}")
        if v.lower() in by_lower:
            return by_lower[v.lower()]
        close = difflib.get_close_matches(v.lower(), list(by_lower), n=3, cutoff=0.6)
        known = ", ".join(names)
        hint = (" — did you mean " + " or ".join(repr(by_lower[c]) for c in close)
                + f"? (known: {known})" if close else f"; known: {known}")
        raise ValueError(f"unknown {kind} type{hint}")
    return BeforeValidator(check)
