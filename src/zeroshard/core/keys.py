"""The keys of a zeroshard checkpoint's tensors, made and taken apart here only.

- `model.<param>`: a trained parameter, flat (its fp32 master; stage 3's frozen units: the
  compute-dtype parameter);
- `optim.<state>.<param>`: one optimizer state of it (e.g. Adam's `exp_avg`), flat;
- `frozen.<param>`: a parameter no optimizer steps, saved whole (stages 0-2);
- `buffer.<name>`: a module buffer, whole.

The optimizer's state (`state.py`, `muon_exchange.py`) writes them; checkpoint/ saves, reads,
converts and consolidates them. This sits in core because core writes them and must not import
checkpoint/.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

MODEL, OPTIM, FROZEN, BUFFER = "model", "optim", "frozen", "buffer"


def model_key(param: str) -> str:
    """`model.<param>`."""
    return f"{MODEL}.{param}"


def optim_key(state: str, param: str) -> str:
    """`optim.<state>.<param>`."""
    return f"{OPTIM}.{state}.{param}"


def frozen_key(param: str) -> str:
    """`frozen.<param>`."""
    return f"{FROZEN}.{param}"


def buffer_key(name: str) -> str:
    """`buffer.<name>`."""
    return f"{BUFFER}.{name}"


def flat_key(what: str, param: str) -> str:
    """The key of a flat entry: `model.<param>` for "model", else `optim.<what>.<param>`."""
    return model_key(param) if what == MODEL else optim_key(what, param)


def split_key(key: str) -> tuple[str, str | None, str]:
    """(kind, optimizer state or None, name): `optim.exp_avg.w` -> ("optim", "exp_avg", "w")."""
    kind, _, rest = key.partition(".")
    if kind == OPTIM:
        state, _, name = rest.partition(".")
        return kind, state, name
    return kind, None, rest


def name_of(key: str, kind: str) -> str | None:
    """The parameter or buffer name of `key` if it is a `kind` ("model", "frozen", "buffer")
    key, else None."""
    prefix = f"{kind}."
    return key[len(prefix):] if key.startswith(prefix) else None


def named(keys: Iterable[str], kind: str) -> Iterator[tuple[str, str]]:
    """(name, key) of each of `keys` that is a `kind` key, in order."""
    for key in keys:
        name = name_of(key, kind)
        if name is not None:
            yield name, key
