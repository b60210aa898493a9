"""`zeroshard run`: a thin front door onto torchrun.

`zeroshard run [torchrun options] script.py [script args]` parses its options with torchrun's own
parser (`torch.distributed.run.get_args_parser`) and hands the result to `torch.distributed.run.run`
in this process, so every torchrun option, elastic restarts and c10d rendezvous behave exactly as
under `torchrun`. What it adds is defaults and DeepSpeed-launcher spellings, nothing else:

* `--nproc-per-node` defaults to the number of CUDA devices, or 2 on a machine without CUDA;
* with no rendezvous / master options on a single node, `--standalone` is implied (a c10d store on a
  free port, so two jobs on one machine never fight over port 29500);
* `--num_gpus` / `--num_nodes` are accepted for `--nproc-per-node` / `--nnodes`;
* across nodes, the rendezvous host, `--local-addr` and GLOO_SOCKET_IFNAME come from the route to
  the rendezvous endpoint when not given (cli/nodes.py);
* `--local_rank=<n>` is appended to each worker's arguments only when the script's source declares
  such an option (torchrun itself never passes it), mirroring the DeepSpeed launcher.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

from .nodes import announce, apply_node_defaults

_RUN_EPILOG = """\
defaults added by zeroshard (everything else is torchrun's):
  --nproc-per-node   number of CUDA GPUs when CUDA is available, else 2
  --standalone       implied on a single node when no --rdzv-*/--master-* option is given,
                     so that concurrent jobs on one machine each get a free port
across nodes (--nnodes > 1), unless given:
  --rdzv-conf is_host=1   on the node whose own address is the --rdzv-endpoint host
  --local-addr            this node's address on the route to the rendezvous endpoint
  GLOO_SOCKET_IFNAME      the interface holding that address
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   (c10d) a fresh store for each restarted attempt
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
    args.node_notes, args.node_env = [], {}
    if not args.standalone and not _single_node(args):
        args.node_notes, args.node_env = apply_node_defaults(args)
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
    os.environ.update(args.node_env)  # inherited by the workers
    announce(args.node_notes, args.rdzv_endpoint or args.master_addr)
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

