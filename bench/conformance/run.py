"""Run the conformance matrix through real DeepSpeed and through zeroshard, side by side.

    python bench/conformance/run.py --deepspeed-python /path/to/venv/bin/python [--cases z2-fp32 ...]

DeepSpeed runs from its own virtual environment (it is never a dependency of zeroshard):
`python -m venv ds && ds/bin/pip install torch==2.13.0 deepspeed==0.19.8`; on a CPU-only machine
it runs with DS_ACCELERATOR=cpu and gloo. zeroshard runs the same script under `zeroshard run`,
where `import deepspeed` is zeroshard. Each case is one launch per library (cases.py: the model,
the data, the matrix). Writes:

* `docs/benchmarks/conformance.md` (`--table`): one row per case, the largest difference per
  quantity, and the verdict against the case's tolerance;
* `tests/fixtures/conformance_deepspeed.json` (`--record`): DeepSpeed's records and final-weight
  summaries, which tests/test_conformance.py compares zeroshard with on every CI run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import cases  # noqa: E402
from compare import compare, summary  # noqa: E402

SCRIPT = os.path.join(HERE, "case_script.py")
TABLE = os.path.join(ROOT, "docs", "benchmarks", "conformance.md")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "conformance_deepspeed.json")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(library: str, name: str, world: int, out: str, ds_python: str) -> dict:
    """One case through one library: the result JSON (or the launch's failure)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", ZEROSHARD_QUIET="1")
    if library == "deepspeed":
        cmd = [ds_python, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(_free_port()), SCRIPT, name, out]
    else:
        cmd = [sys.executable, "-m", "zeroshard.cli", "run", "--nproc-per-node", str(world),
               "--master-port", str(_free_port()), SCRIPT, name, out]
    for _ in range(3 if library == "deepspeed" else 1):
        # DeepSpeed's CPU ranks now and then abort at start-up on a loaded machine (SIGABRT in
        # gloo's set-up); such a launch is tried again, a failure with a result is not.
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if not proc.returncode or "SIGABRT" not in proc.stdout + proc.stderr:
            break
    if proc.returncode or not os.path.exists(out):
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        return {"error": f"launch failed (rc {proc.returncode}): " + " | ".join(tail)[-400:]}
    with open(out, encoding="utf-8") as fh:
        return json.load(fh)


PAGE = """<!-- written by bench/conformance/run.py; do not edit by hand -->
# Side by side with DeepSpeed 0.19.8

One model (an MLP of 3,560 parameters with biases, inputs scaled so that the gradient norm is
well above 1) and one data stream, trained for 6 optimizer steps by real DeepSpeed 0.19.8 and by
zeroshard through the same JSON config, on CPU with gloo: `python bench/conformance/run.py
--deepspeed-python <venv with deepspeed==0.19.8>/bin/python` (the matrix:
`bench/conformance/cases.py`; DeepSpeed runs with `DS_ACCELERATOR=cpu`, zeroshard under
`zeroshard run`, where `import deepspeed` is zeroshard). Each cell is the largest difference over
the steps: relative for loss (mean over ranks and micro-batches), gradient norm, lr and loss scale;
absolute for the final weights, in the module's dtype and as fp32 masters
(`deepspeed.utils.safe_get_full_fp32_param`). Skipped steps must agree exactly. A quantity
DeepSpeed reports nothing for (its stage-0 fp32 engine keeps no gradient norm and no fp32 master)
is not judged. `tests/test_conformance.py` checks zeroshard against DeepSpeed's recorded results
(`tests/fixtures/conformance_deepspeed.json`) on every CI run.

**{equal} of {total} cases equal to DeepSpeed within tolerance** (relative / absolute: {tolerance}).
fp16 on this CPU: DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels; the
script tells it fp16 is supported (torch computes fp16 on the CPU), and nothing else is changed.

{table}
"""


def _fmt(value) -> str:
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.1e}"
    return str(value)


def table(rows: list[tuple[str, int, str, dict]]) -> str:
    """The markdown table of docs/benchmarks/conformance.md."""
    lines = ["| case | ranks | precision | loss | grad norm | lr | loss scale | skipped (zs / ds) "
             "| module weights | fp32 masters | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, world, prec, row in rows:
        if row["verdict"] == "error":
            lines.append(f"| {name} | {world} | {prec} | | | | | | | | DeepSpeed: "
                         f"{row['deepspeed'] or 'ran'}; zeroshard: {row['zeroshard'] or 'ran'} |")
            continue
        cells = [_fmt(row[k]) for k in ("loss", "grad_norm", "lr", "loss_scale", "skipped",
                                        "module", "master")]
        lines.append(f"| {name} | {world} | {prec} | " + " | ".join(cells)
                     + f" | {row['verdict']} |")
    return "\n".join(lines)


def main() -> int:
    """Run the chosen cases through both libraries and write the table / fixture."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-python", default=None,
                        help="python of a virtual environment with deepspeed==0.19.8")
    parser.add_argument("--cases", nargs="*", default=list(cases.CASES))
    parser.add_argument("--table", default=TABLE)
    parser.add_argument("--record", default=None,
                        help=f"write DeepSpeed's results as the suite's fixture (e.g. {FIXTURE}); "
                             "cases not run keep what the file had")
    parser.add_argument("--against", default=None,
                        help="judge zeroshard against DeepSpeed's results recorded in this file "
                             "instead of running DeepSpeed (final weights as summaries)")
    args = parser.parse_args()
    unknown = [c for c in args.cases if c not in cases.CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(cases.CASES)}")
    if not args.deepspeed_python and not args.against:
        parser.error("give --deepspeed-python (run DeepSpeed) or --against (its recorded results)")
    recorded = {}
    if args.record and os.path.exists(args.record):
        with open(args.record, encoding="utf-8") as fh:
            recorded = {k: v for k, v in json.load(fh).items() if not k.startswith("_")}
    against = None
    if args.against:
        with open(args.against, encoding="utf-8") as fh:
            against = json.load(fh)
    rows, ours_all, theirs_all = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            world, config = cases.CASES[name]
            start = time.time()
            theirs_all[name] = against.get(name, {"error": "not recorded"}) if against else \
                launch("deepspeed", name, world, os.path.join(tmp, f"{name}.ds.json"),
                       args.deepspeed_python)
            ours_all[name] = launch("zeroshard", name, world,
                                    os.path.join(tmp, f"{name}.zs.json"), args.deepspeed_python)
            print(f"{name:28s} {time.time() - start:5.1f}s", flush=True)
    for name in args.cases:
        world, config = cases.CASES[name]
        prec = cases.precision(config)
        theirs = theirs_all[name]
        skip = cases.NOT_JUDGED.get(name)
        row = compare(ours_all[name], theirs, cases.TOLERANCE[prec], summarized=bool(against),
                      not_judged=skip)
        row["ok"] = row["verdict"] == "equal"
        if skip:
            row["verdict"] += "; not judged: " + "; ".join(f"{k} ({v})" for k, v in skip.items())
        if name in cases.JUDGED_AGAINST and cases.JUDGED_AGAINST[name][0] in theirs_all:
            other, why = cases.JUDGED_AGAINST[name]
            row = compare(ours_all[name], theirs_all[other], cases.TOLERANCE[prec],
                          summarized=bool(against))
            row["ok"] = row["verdict"] == "equal"
            row["verdict"] = (f"documented: {why}. Against DeepSpeed's {other}: "
                              f"{row['verdict']}")
        rows.append((name, world, prec, row))
        print(f"{name:28s} {row['verdict']}")
        if against:
            continue
        if "error" not in theirs:
            recorded[name] = {"records": theirs["records"],
                              "weights": {k: summary(v) for k, v in theirs["weights"].items()}}
        else:
            recorded[name] = {"error": theirs["error"]}
    equal = sum(bool(r.get("ok")) for *_, r in rows)
    text = PAGE.format(equal=equal, total=len(rows), tolerance=", ".join(
        f"{p} {r:g} / {a:g}" for p, (r, a) in cases.TOLERANCE.items()), table=table(rows))
    if args.table:
        with open(args.table, "w", encoding="utf-8") as fh:
            fh.write(text)
    if args.record:
        with open(args.record, "w", encoding="utf-8") as fh:
            json.dump({"_about": "DeepSpeed 0.19.8's results of bench/conformance/cases.py, "
                                 "recorded by bench/conformance/run.py --record",
                       **recorded}, fh, indent=0, sort_keys=True)
            fh.write("\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
