"""Run DeepSpeed's own unit tests against real DeepSpeed and against zeroshard, side by side.

DeepSpeed's `tests/` directory (from its repository; pass `--tests`) is run twice with pytest in
an environment where `deepspeed==0.19.8` and zeroshard are both installed (DeepSpeed's fixtures
need pytest < 9):

* `deepspeed`: plain, so `import deepspeed` is DeepSpeed itself;
* `zeroshard`: with zeroshard's `_deepspeed_shim` first on PYTHONPATH, exactly as under
  `zeroshard run`, so `import deepspeed` is zeroshard.

Both run on CPU (`DS_ACCELERATOR=cpu`, gloo, `LOCAL_SIZE=2` so that 2-rank tests run), with the
`ds_pool_guard` plugin (this folder): DeepSpeed's pool harness otherwise stalls for good after a
test that fails through a pytest outcome such as "DID NOT RAISE" (that module says why), and with
`DEEPSPEED_TIMEOUT=10` unless set (DeepSpeed's default; zeroshard reads it too), so a rank left
waiting in a collective by a peer that failed gives up. Each
test's outcome is read from a JUnit XML file and the table printed (and, with `--markdown FILE`,
written) counts the tests DeepSpeed passes, of those the ones zeroshard passes, and lists each
test zeroshard fails with the first line of its error.

    python bench/conformance/run_deepspeed_unit_tests.py --python /work/dsvenv/bin/python \
        --tests /path/to/DeepSpeed/tests unit/runtime/zero/test_zero_leaf_module.py ...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SHIM = Path(__file__).resolve().parents[2] / "src/zeroshard/compat/deepspeed/_deepspeed_shim"
#: This folder: it holds ds_pool_guard, the plugin that keeps a failing test from stalling the pool.
HERE = Path(__file__).resolve().parent


def run(engine: str, python: str, tests: Path, files: list[str], out: Path, timeout: int,
        local_size: int) -> dict:
    """Run `files` under `engine`; returns {test id: (outcome, first line of the message)}."""
    # DeepSpeed's CPU accelerator counts LOCAL_SIZE devices: without it every multi-rank test
    # is skipped as "not enough GPUs".
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE=str(local_size))
    env.setdefault("DEEPSPEED_TIMEOUT", "10")
    paths = [str(SHIM)] if engine == "zeroshard" else []
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, str(HERE), env.get("PYTHONPATH")]))
    xml = out / f"{engine}.xml"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ds_pool_guard",
           f"--junitxml={xml}",
           "-o", "junit_family=xunit1", *files]
    with open(out / f"{engine}.log", "w") as log:
        subprocess.run(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT,
                       timeout=timeout, check=False)
    return outcomes(xml)


def outcomes(xml: Path) -> dict:
    """{classname::name: (passed | failed | skipped, message)} from a JUnit XML file."""
    result = {}
    for case in ET.parse(xml).iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        state, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                state = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or "").strip().splitlines()[:1]
                message = message[0][:160] if message else ""
                if state == "failed":
                    break
        result[key] = (state, message)
    return result


def table(ds: dict, zs: dict) -> str:
    """The markdown summary: counts, then each DeepSpeed-passing test that zeroshard fails."""
    passed = [k for k, (s, _) in ds.items() if s == "passed"]
    both = [k for k in passed if zs.get(k, ("missing",))[0] == "passed"]
    lines = [f"DeepSpeed 0.19.8 passes {len(passed)} of {len(ds)} "
             f"({sum(s == 'skipped' for s, _ in ds.values())} skipped on CPU); "
             f"zeroshard passes {len(both)} of those {len(passed)}.", "",
             "| test | zeroshard | why |", "|---|---|---|"]
    for key in passed:
        state, message = zs.get(key, ("missing", ""))
        if state != "passed":
            lines.append(f"| `{key}` | {state} | {message.replace('|', '/')} |")
    return "\n".join(lines)


def main() -> None:
    """Run both engines over the chosen files and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="test files or node ids, relative to --tests")
    parser.add_argument("--tests", type=Path, required=True, help="DeepSpeed's tests/ directory")
    parser.add_argument("--python", default=sys.executable,
                        help="a Python with deepspeed==0.19.8, zeroshard and pytest<9")
    parser.add_argument("--out", type=Path, default=Path("ds_unit_results"))
    parser.add_argument("--engines", default="deepspeed,zeroshard")
    parser.add_argument("--timeout", type=int, default=4 * 3600)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--local-size", type=int, default=2,
                        help="devices DeepSpeed's CPU accelerator reports: the largest world run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # An engine left out of --engines is read from the XML of an earlier run in --out.
    results = {engine: run(engine, args.python, args.tests, args.files, args.out, args.timeout,
                           args.local_size)
               for engine in args.engines.split(",") if engine}
    missing = [e for e in ("deepspeed", "zeroshard")
               if e not in results and not (args.out / f"{e}.xml").exists()]
    if missing:
        print(f"ran {', '.join(results)}; no {', '.join(missing)} results in {args.out} to compare")
        return
    ds = results.get("deepspeed") or outcomes(args.out / "deepspeed.xml")
    zs = results.get("zeroshard") or outcomes(args.out / "zeroshard.xml")
    text = table(ds, zs)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
