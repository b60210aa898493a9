"""The config reference page (docs/reference/config-keys.md) is generated from the schema by
docs/gen_config_reference.py and committed; these tests fail when the two disagree, when a key
has no meaning written for it, or when the refusals moved without the page."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "run `python docs/gen_config_reference.py` (or `make config-reference`) and commit"


def _gen():
    spec = importlib.util.spec_from_file_location("gen_config_reference",
                                                  ROOT / "docs" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_key_has_a_meaning():
    gen = _gen()
    missing = gen.missing_meanings()
    assert not missing, (
        f"config keys without a meaning on the reference page: {missing}. Add a line for each to "
        "MEANING in docs/gen_config_reference.py (DeepSpeed's meaning, in our words), or a "
        "docstring under the field in src/zeroshard/config/schema.py; then " + REGENERATE)


def test_committed_page_matches_the_schema():
    gen = _gen()
    page = gen.PAGE.read_text(encoding="utf-8")
    assert page == gen.render(), "docs/reference/config-keys.md is out of date: " + REGENERATE


def test_page_lists_every_schema_and_ignored_key():
    gen = _gen()
    page = gen.PAGE.read_text(encoding="utf-8")
    keys = [k for k, *_ in gen.schema_keys()] + [k for k, _ in gen.inert_keys()]
    absent = [k for k in keys if f"| `{k}` |" not in page]
    assert not absent, f"keys missing from the page: {absent}; " + REGENERATE
    assert len(keys) > 100


def test_refusals_on_the_page_follow_config_refusals():
    gen = _gen()
    source = (ROOT / "src" / "zeroshard" / "config" / "refusals.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    functions = sorted(n.name for n in tree.body
                       if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))
    raises = sum(isinstance(n, ast.Raise) for n in ast.walk(tree))
    assert functions == sorted(gen.REFUSAL_FUNCTIONS), (
        f"config/refusals.py has the functions {functions}; REFUSAL_FUNCTIONS in "
        "docs/gen_config_reference.py lists " + str(sorted(gen.REFUSAL_FUNCTIONS))
        + ": say which keys each refuses (and in REFUSED what it refuses), then " + REGENERATE)
    assert raises == gen.REFUSAL_RAISES, (
        f"config/refusals.py now has {raises} raise statements, REFUSAL_RAISES says "
        f"{gen.REFUSAL_RAISES}: check REFUSED in docs/gen_config_reference.py against it, update "
        "the count, then " + REGENERATE)
    paths = {k for k, *_ in gen.schema_keys()}
    for name, keys in gen.REFUSAL_FUNCTIONS.items():
        for key in keys:
            assert key in paths, f"{key} (refused by {name}) is not a schema key"
            assert key in gen.REFUSED, f"{key} is refused by {name} but has no REFUSED text"
    assert set(gen.REFUSED) == {k for keys in gen.REFUSAL_FUNCTIONS.values() for k in keys}


def test_a_new_key_without_a_meaning_is_named(monkeypatch):
    gen = _gen()
    monkeypatch.delitem(gen.MEANING, "aio.queue_depth")
    assert gen.missing_meanings() == ["aio.queue_depth"]


def test_accepted_keys_are_schema_keys():
    gen = _gen()
    paths = {k for k, *_ in gen.schema_keys()}
    stale = [k for k in gen.ACCEPTED if k not in paths]
    assert not stale, f"ACCEPTED in docs/gen_config_reference.py names keys the schema lacks: {stale}"
