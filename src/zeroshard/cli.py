"""The `zeroshard` command: `run` (a thin front door onto torchrun), `demo`, `estimate`, `plan`,
`consolidate`.

`zeroshard run [torchrun options] script.py [script args]` parses its options with torchrun's own
parser (`torch.distributed.run.get_args_parser`) and hands the result to `torch.distributed.run.run`
in this process, so every torchrun option, elastic restarts and c10d rendezvous behave exactly as
under `torchrun`. What it adds is defaults and DeepSpeed-launcher spellings, nothing else:

* `--nproc-per-node` defaults to the number of CUDA devices, or 2 on a machine without CUDA;
* with no rendezvous / master options on a single node, `--standalone` is implied (a c10d store on a
  free port, so two jobs on one machine never fight over port 29500);
* `--num_gpus` / `--num_nodes` are accepted for `--nproc-per-node` / `--nnodes`;
* `--local_rank=<n>` is appended to each worker's arguments only when the script's source declares
  such an option (torchrun itself never passes it), mirroring the DeepSpeed launcher.

`zeroshard script.py ...` is shorthand for `zeroshard run script.py ...`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

from zeroshard import __version__

COMMANDS = ("run", "demo", "estimate", "plan", "consolidate")
_TOP_LEVEL_FLAGS = ("-h", "--help", "--version", "-V")
_RUN_EPILOG = """\
defaults added by zeroshard (everything else is torchrun's):
  --nproc-per-node   number of CUDA GPUs when CUDA is available, else 2
  --standalone       implied on a single node when no --rdzv-*/--master-* option is given,
                     so that concurrent jobs on one machine each get a free port
DeepSpeed launcher spellings:
  --num_gpus N       same as --nproc-per-node N
  --num_nodes N      same as --nnodes N
local rank:
  torchrun gives each worker LOCAL_RANK in its environment. If the script's source declares a
  '--local_rank' (or '--local-rank') option, each worker also gets '--local_rank=<n>' (in the
  spelling the script declares) before the script's own arguments, as under DeepSpeed's
  launcher; a script that does not declare it never receives it. --no_local_rank turns this off.
"""

# Options that, when given, mean the user chose the rendezvous: leave it to torchrun untouched.
_RDZV_DEFAULTS = {"rdzv_backend": "static", "rdzv_endpoint": "", "master_port": None,
                  "master_addr": "127.0.0.1", "node_rank": 0}

_LOCAL_RANK_DECL = re.compile(r"""(["'])(--local[_-]rank)\1""")


class UsageError(Exception):
    """A command-line mistake reported as one line and exit code 2."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zeroshard` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and _is_script_shorthand(argv):
        argv = ["run", *argv]
    try:
        if argv and argv[0] == "run":
            return run_command(argv[1:])
        if argv and argv[0] == "demo":
            from zeroshard import demo

            return demo.cli_main(argv[1:])
        if argv and argv[0] in ("estimate", "plan"):
            from zeroshard import sizing_cli

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
    if not argv:
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        return _consolidate(args)
    parser.print_help()
    return 2


def _consolidate(args) -> int:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.consolidate import consolidate

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


# ----------------------------------------------------------------------------------------- run


def build_run_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser, renamed, with the DeepSpeed-launcher spellings added."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "zeroshard run"
    parser.description = ("Launch a training script on N ranks through torchrun "
                          "(torch.distributed.run); all torchrun options are accepted.")
    parser.epilog = _RUN_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if "PET_NPROC_PER_NODE" not in os.environ:
        parser.set_defaults(nproc_per_node=None)  # None: fill in from the hardware later
    group = parser.add_argument_group("zeroshard additions")
    group.add_argument("--num_gpus", "--num-gpus", dest="nproc_per_node", default=argparse.SUPPRESS,
                       metavar="N", help="DeepSpeed launcher spelling of --nproc-per-node")
    group.add_argument("--num_nodes", "--num-nodes", dest="nnodes", default=argparse.SUPPRESS,
                       metavar="N", help="DeepSpeed launcher spelling of --nnodes")
    group.add_argument("--no_local_rank", "--no-local-rank", action="store_true",
                       help="never append --local_rank=<n> to the script's arguments")
    return parser


def prepare_run_args(argv: list[str]) -> argparse.Namespace:
    """Parse `zeroshard run` arguments and apply zeroshard's defaults; raises UsageError."""
    args = build_run_parser().parse_args(argv)
    if args.nproc_per_node is None:
        args.nproc_per_node = str(_default_nproc())
    _check_script(args)
    if not args.standalone and _single_node(args) and all(
            getattr(args, k) == v for k, v in _RDZV_DEFAULTS.items()):
        args.standalone = True
    if not args.no_local_rank:
        flag = declared_local_rank_flag(args.training_script, module=args.module)
        given = any(a.split("=")[0] in ("--local_rank", "--local-rank")
                    for a in args.training_script_args)
        if flag and not given:
            from torch.distributed.elastic.utils.api import macros

            # torchrun's agent replaces the ${local_rank} macro with each worker's local rank.
            args.training_script_args = [f"{flag}={macros.local_rank}",
                                         *args.training_script_args]
    return args


def run_command(argv: list[str]) -> int:
    """`zeroshard run`: launch through torch.distributed.run in this process; return exit code."""
    args = prepare_run_args(argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(f"zeroshard run: {err.name} failed on rank {rank} "
              f"(exit code {failure.exitcode}); its output is above.", file=sys.stderr)
        return failure.exitcode if isinstance(failure.exitcode, int) and failure.exitcode > 0 else 1
    return 0


def _default_nproc() -> int:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    return 2


def _single_node(args: argparse.Namespace) -> bool:
    from torch.distributed.run import parse_min_max_nnodes

    try:
        return parse_min_max_nnodes(args.nnodes)[1] == 1
    except (RuntimeError, ValueError) as err:
        raise UsageError(f"bad --nnodes {args.nnodes!r}: {err}") from None


def _check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module:
        if _module_origin(script) is None:
            raise UsageError(f"module not found: {script}")
    elif args.no_python and not args.run_path:
        if not (os.path.exists(script) or shutil.which(script)):
            raise UsageError(f"program not found: {script}")
    elif not os.path.isfile(script):
        raise UsageError(f"script not found: {script}")


def _module_origin(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package: `python -m pkg` runs pkg/__main__.py
        try:
            spec = importlib.util.find_spec(f"{name}.__main__")
        except (ImportError, ValueError):
            return None
    return spec.origin if spec is not None else None


def declared_local_rank_flag(script: str, module: bool = False) -> str | None:
    """The `--local_rank`/`--local-rank` spelling the script's source declares, or None."""
    path = _module_origin(script) if module else script
    if not path or not os.path.isfile(path):
        return None
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    found = {m.group(2) for m in _LOCAL_RANK_DECL.finditer(source)}
    if "--local_rank" in found:
        return "--local_rank"
    if "--local-rank" in found:
        return "--local-rank"
    return None


if __name__ == "__main__":
    sys.exit(main())
