"""Every code block of the README and the documentation site runs, or says why not.

A page's fenced blocks are read in order. The HTML comment on the line before a block says what
it is (invisible on the rendered page):

- ``<!-- norun: REASON -->``: not run (a GPU, several machines, a scheduler, the user's own
  script); counted, and the reason may not be empty;
- ``<!-- file: NAME -->``: written to NAME in the page's scratch directory before anything runs;
- ``<!-- fixture -->``: the getting-started block whose names every page's snippets may use;
- ``<!-- argv: ARGS -->``: a python block run with ``sys.argv = ["train.py", *ARGS]``;
- nothing: ``python`` blocks run in one process (a world of one), the fixture first, then the
  page's blocks in order sharing their names, in the page's scratch directory; ``bash`` /
  ``console`` / ``sh`` blocks run there with ``bash -e`` (``zeroshard run`` jobs at 1-2 ranks).

Blocks in other languages (``json`` fragments, ``text``, unlabelled output) are not code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = {"python", "py", "bash", "console", "sh", "shell"}
SETUP_COMMANDS = ("pip install -c constraints.txt -e . && zeroshard demo\n"
                  "pip install -c constraints.txt -e '.[test]' && python -m pytest\n")
MARKER = re.compile(r"^<!--\s*(norun|file|fixture|argv)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    kind: str = "run"            # run | norun | file | fixture
    arg: str = ""


@dataclass
class Page:
    path: str
    blocks: list[Block] = field(default_factory=list)


def pages() -> list[Page]:
    files = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [read_page(p) for p in files]


def read_page(path: Path) -> Page:
    rel = str(path.relative_to(ROOT))
    page, lines = Page(rel), path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```\s*([\w+-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang not in RUNNABLE and lang != "json":
            continue
        block = Block(rel, start + 1, lang, "\n".join(body) + "\n")
        mark = _marker(lines, start)
        if lang == "json" and not mark:
            block.kind = "config"
        elif mark:
            block.kind, block.arg = mark.group(1), (mark.group(2) or "").strip()
            if block.kind == "argv":
                block.kind = "run"
        page.blocks.append(block)
    return page


def _marker(lines: list[str], start: int):
    j = start - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    return MARKER.match(lines[j].strip()) if j >= 0 else None


HOW_TO_FIX = ("\nA documentation code block failed. Fix the block (python blocks may use the names of the "
              "<!-- fixture --> block in docs/getting-started.md and write files with "
              "<!-- file: NAME -->), or, if it cannot run on 1-2 CPU ranks, put "
              "<!-- norun: the reason --> on the line before it (tests/test_docs_snippets.py).")

ALL = pages()
FIXTURE = [b for p in ALL for b in p.blocks if b.kind == "fixture"]


def _is_python(b: Block) -> bool:
    return b.lang in ("python", "py")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(ZEROSHARD_QUIET="1", PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


# -- the inventory --------------------------------------------------------------------------------
def test_every_code_block_runs_or_says_why_not():
    run = [b for p in ALL for b in p.blocks if b.kind == "run"]
    norun = [b for p in ALL for b in p.blocks if b.kind == "norun"]
    files = [b for p in ALL for b in p.blocks if b.kind == "file"]
    assert len(FIXTURE) == 1, "exactly one <!-- fixture --> block (docs/getting-started.md)"
    empty = [f"{b.page}:{b.line}" for b in norun if not b.arg]
    assert not empty, f"<!-- norun: --> needs a reason: {empty}"
    configs = [b for p in ALL for b in p.blocks if b.kind == "config"]
    print(f"\ndocs code blocks: {len(run)} run, {len(files)} files written, {len(configs)} JSON "
          f"config fragments loaded, {len(norun)} marked norun:")
    for b in norun:
        print(f"  {b.page}:{b.line} ({b.lang}): {b.arg}")
    assert run


def test_readme_keeps_the_two_setup_commands_that_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"```bash\n{SETUP_COMMANDS}```" in readme
    assert len(readme.splitlines()) <= 150, "the README stays short (issue 30); move text to docs/"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert SETUP_COMMANDS.splitlines()[1].replace("pip install", "pip install -q") in ci


JSON_BLOCKS = [b for p in ALL for b in p.blocks if b.lang == "json" and b.kind != "norun"]


def _not_kept(given: dict, loaded: dict, path: str = "") -> list[str]:
    """The keys of `given` whose value `loaded` (the config as loaded, by its JSON names) does not
    hold at the same place."""
    out = []
    for key, value in given.items():
        where = f"{path}{key}"
        if not isinstance(loaded, dict) or key not in loaded:
            out.append(f"{where}: absent")
        elif isinstance(value, dict) and isinstance(loaded[key], dict):
            out += _not_kept(value, loaded[key], where + ".")
        elif loaded[key] != value:
            out.append(f"{where}: {value!r} loaded as {loaded[key]!r}")
    return out


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=[f"{b.page}:{b.line}" for b in JSON_BLOCKS])
def test_json_block_is_a_config_zeroshard_loads(block):
    """Config files and fragments (`"zero_optimization": {...}`) load through the schema with
    every value they give kept as given; `"auto"` values are first resolved as initialize() does
    without a model (config/auto.py's defaults)."""
    from zeroshard.config.auto import resolve_auto
    from zeroshard.config.schema import load_config

    text = block.code.strip()
    value = resolve_auto(json.loads(text if text.startswith("{") else "{" + text + "}"))
    assert "auto" not in json.dumps(value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # notices (no batch size given, ...)
        loaded = load_config(value).model_dump(by_alias=True)
    assert not _not_kept(value, loaded), _not_kept(value, loaded)


# -- python blocks: one process, a world of one ---------------------------------------------------
DRIVER = textwrap.dedent("""
    import json, os, sys, traceback
    jobs, out = json.load(open(sys.argv[1])), sys.argv[2]
    results = {}
    for job in jobs:
        os.chdir(job["dir"])
        ns = {"__name__": "__main__"}
        try:
            for b in [job["fixture"], *job["blocks"]]:
                where = b["where"]
                sys.argv = ["train.py", *b["argv"]]
                exec(compile(b["code"], where, "exec"), ns)
            results[job["page"]] = "ok"
        except BaseException:
            results[job["page"]] = where + "\\n" + traceback.format_exc()[-4000:]
    json.dump(results, open(out, "w"))
""")

PY_PAGES = [p for p in ALL if any(b.kind == "run" and _is_python(b) for b in p.blocks)]
SH_BLOCKS = [b for p in ALL for b in p.blocks if b.kind == "run" and not _is_python(b)]


def _scratch(page: Page, root: Path) -> Path:
    d = root / re.sub(r"[^\w]+", "_", page.path)
    d.mkdir(parents=True, exist_ok=True)
    for b in page.blocks:
        if b.kind == "file":
            (d / b.arg).parent.mkdir(parents=True, exist_ok=True)
            (d / b.arg).write_text(b.code, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def python_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs_py")
    fixture = FIXTURE[0]
    jobs = []
    for p in PY_PAGES:
        blocks = [{"where": f"{b.page}:{b.line}", "code": b.code,
                   "argv": b.arg.split() if b.arg else []}
                  for b in p.blocks if b.kind == "run" and _is_python(b)]
        jobs.append({"page": p.path, "dir": str(_scratch(p, root)), "blocks": blocks,
                     "fixture": {"where": f"{fixture.page}:{fixture.line}", "code": fixture.code,
                                 "argv": []}})
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "driver.py").write_text(DRIVER)
    res = subprocess.run([sys.executable, str(root / "driver.py"), str(root / "jobs.json"),
                          str(root / "out.json")], capture_output=True, text=True, timeout=300,
                         env=_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads((root / "out.json").read_text())


@pytest.mark.parametrize("page", [p.path for p in PY_PAGES])
def test_python_blocks_of_page_run(page, python_results):
    assert python_results[page] == "ok", python_results[page] + HOW_TO_FIX


# -- shell blocks: the commands as written, in the page's scratch directory ----------------------
@pytest.mark.parametrize("block", SH_BLOCKS, ids=[f"{b.page}:{b.line}" for b in SH_BLOCKS])
def test_shell_block_runs(block, tmp_path):
    page = next(p for p in ALL if p.path == block.page)
    d = _scratch(page, tmp_path)
    res = subprocess.run(["bash", "-e", "-c", block.code], cwd=d, capture_output=True, text=True,
                         timeout=240, env=_env())
    assert res.returncode == 0, (f"{block.page}:{block.line}\n{block.code}\n"
                                 + res.stdout[-3000:] + res.stderr[-5000:] + HOW_TO_FIX)
