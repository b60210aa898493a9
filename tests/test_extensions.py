"""core/extensions.py, the registry through which compat/ installs per-engine extras: a finder is
asked when first needed (None: asked again later), each kind reaches every found extension, an
install that fails undoes those before it, `remove()` undoes in reverse order once, and an
optimizer attribute nobody has is an AttributeError naming it. The registry's state is swapped
out for each test, so zeroshard's own extensions (compat/) stay registered."""

from __future__ import annotations

import types

import pytest

from zeroshard.core import extensions


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(extensions, "_finders", [])
    monkeypatch.setattr(extensions, "_found", [])
    monkeypatch.setattr(extensions, "_hooks", {kind: [] for kind in extensions._KINDS})
    return extensions


def _extension(log: list, name: str, fail: bool = False):
    def install(view):
        if fail:
            raise RuntimeError(f"{name} failed")
        log.append(("install", name, view))
        return lambda: log.append(("undo", name))

    def optimizer_attribute(optimizer, attr):
        if attr != name:
            raise AttributeError(attr)
        return f"{name}.{attr}"

    return types.SimpleNamespace(
        install=install, optimizer_attribute=optimizer_attribute,
        unit_status=lambda unit, status: log.append(("status", name, unit, status)))


def test_found_lazily_and_asked_again_until_available(registry):
    log, asked = [], []
    ready = {"now": False}
    ext = _extension(log, "a")

    def find():
        asked.append(1)
        return ext if ready["now"] else None

    registry.register(find)
    registry.register(find)  # once
    assert asked == []  # registering imports nothing
    registry.unit_status("u", 1)
    assert log == [] and len(asked) == 1
    ready["now"] = True
    registry.unit_status("u", 2)
    registry.unit_status("u", 3)
    assert log == [("status", "a", "u", 2), ("status", "a", "u", 3)] and len(asked) == 2


def test_install_remove_and_a_failing_install(registry):
    log = []
    registry.register(lambda: _extension(log, "a"))
    registry.register(lambda: _extension(log, "b"))
    done = registry.install("view")
    assert log == [("install", "a", "view"), ("install", "b", "view")]
    done.remove()
    done.remove()  # once
    assert log[2:] == [("undo", "b"), ("undo", "a")]
    log.clear()
    registry.register(lambda: _extension(log, "c", fail=True))
    with pytest.raises(RuntimeError, match="c failed"):
        registry.install("view")
    assert log == [("install", "a", "view"), ("install", "b", "view"), ("undo", "b"),
                   ("undo", "a")]


def test_optimizer_attribute(registry):
    registry.register(lambda: _extension([], "a"))
    registry.register(lambda: _extension([], "b"))
    assert registry.optimizer_attribute(object(), "b") == "b.b"
    with pytest.raises(AttributeError, match="'object' object has no attribute 'c'"):
        registry.optimizer_attribute(object(), "c")


def test_zeroshard_registers_the_compat_surface():
    """`import zeroshard` registers compat/'s extensions; the first need finds them."""
    extensions._functions("install")
    names = {getattr(e, "__name__", "") for e in extensions._found}
    assert {"zeroshard.compat.deepspeed.surface", "zeroshard.compat.hf.generation"} <= names
