"""The `zeroshard` command: `run` (a thin front door onto torchrun, `launch.py`), `demo`
(`demo.py`), `estimate` and `plan` (`sizing/cli.py`), `consolidate`, `convert` (`convert.py`).

`zeroshard script.py ...` is shorthand for `zeroshard run script.py ...`.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from .launch import UsageError, run_command

COMMANDS = ("run", "demo", "estimate", "plan", "consolidate", "convert")
_TOP_LEVEL_FLAGS = ("-h", "--help", "--version", "-V")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zeroshard` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and _is_script_shorthand(argv):
        argv = ["run", *argv]
    try:
        if argv and argv[0] == "run":
            return run_command(argv[1:])
        if argv and argv[0] == "demo":
            from . import demo

            return demo.cli_main(argv[1:])
        if argv and argv[0] in ("estimate", "plan"):
            from ..sizing import cli as sizing_cli

            entry = sizing_cli.estimate_main if argv[0] == "estimate" else sizing_cli.plan_main
            try:
                return entry(argv[1:])
            except ValueError as err:
                raise UsageError(str(err)) from None
        return _top_level(argv)
    except UsageError as err:
        print(f"zeroshard: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:  # argparse's --help / usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def _is_script_shorthand(argv: list[str]) -> bool:
    """`zeroshard train.py ...`, or a launcher option first: `zeroshard --num_gpus 2 train.py`."""
    first = argv[0]
    if first.startswith("-"):
        return first.split("=")[0] not in _TOP_LEVEL_FLAGS
    return first.endswith(".py") or os.path.isfile(first)


def _top_level(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        description="ZeRO (Zero Redundancy Optimizer) for PyTorch.",
        epilog="'zeroshard script.py [args]' is the same as 'zeroshard run script.py [args]'.\n"
               "Run 'zeroshard <command> --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-V", "--version", action="version", version=_version_string())
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.add_parser("run", help="launch a training script on N ranks (torchrun options accepted)",
                   add_help=False)
    sub.add_parser("demo", help="train a small GPT at ZeRO stages 0-3 and with CPU / NVMe "
                   "offload; print the memory each one measured", add_help=False)
    sub.add_parser("estimate", help="per-GPU memory of each ZeRO stage and offload (the ZeRO "
                   "paper's formulas)", add_help=False)
    sub.add_parser("plan", help="the least-communication configuration that fits your hardware, "
                   "written as DeepSpeed JSON", add_help=False)
    con = sub.add_parser("consolidate", help="write a sharded checkpoint as safetensors, "
                         "one tensor in memory at a time")
    con.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint")
    con.add_argument("out_dir", help="where model.safetensors (or shards + index) go")
    con.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    con.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    con.add_argument("--max-shard-size", default=None,
                     help="split into Hugging Face style shards of at most this size (e.g. 5GB)")
    from . import convert

    convert.add_parser(sub)
    if not argv:
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        return _consolidate(args)
    if args.command == "convert":
        return convert.run(args)
    parser.print_help()
    return 2


def _consolidate(args) -> int:
    from ..checkpoint import CheckpointError
    from ..checkpoint.consolidate import consolidate

    try:
        files = consolidate(args.checkpoint_dir, args.out_dir, args.tag, args.dtype,
                            args.max_shard_size)
    except (CheckpointError, ValueError) as err:
        raise UsageError(str(err)) from None
    for file in files:
        print(file)
    return 0


def _version_string() -> str:
    import torch

    return f"zeroshard {__version__} (torch {torch.__version__})"


