"""`zeroshard run`: a thin front door onto torchrun.

`zeroshard run [torchrun options] script.py [script args]` parses its options with torchrun's own
parser (`torch.distributed.run.get_args_parser`) and hands the result to `torch.distributed.run.run`
in this process, so every torchrun option, elastic restarts and c10d rendezvous behave exactly as
under `torchrun`. What it adds is defaults, DeepSpeed's launcher flags and Accelerate's config
file, each mapped onto torchrun options (compat/deepspeed/launcher_flags.py), and nothing else:

* `--nproc-per-node` defaults to the number of CUDA devices, or 2 on a machine without CUDA;
* with no rendezvous / master options on a single node, `--standalone` is implied (a c10d store on a
  free port, so two jobs on one machine never fight over port 29500);
* `--num_gpus` / `--num_nodes` are accepted for `--nproc-per-node` / `--nnodes`;
* across nodes, the rendezvous host, `--local-addr` and GLOO_SOCKET_IFNAME come from the route to
  the rendezvous endpoint when not given (cli/nodes.py);
* `--local_rank=<n>` is appended to each worker's arguments when the script's source declares such
  an option or imports deepspeed (DeepSpeed's launcher always passes it; torchrun never does);
* `import deepspeed` in the workers loads zeroshard when DeepSpeed is not installed
  (compat/deepspeed/alias.py; `--alias-deepspeed` when it is), deepspeed's package metadata
  answers there, and on a host without GPUs accelerate's workers form one gloo group: DEEPSPEED
  when DeepSpeed is asked for, else MULTI_CPU as with `Accelerator(cpu=True)` (accelerate alone
  would run each worker as a world of one; rank 0 says so; compat/accelerate/worker_hooks.py);
* a launch handed a DeepSpeed config in which no worker built an engine fails (`--no-zero-check`);
* on Linux the workers die with the launcher, even when it is SIGKILLed (a parent-death signal:
  `workers_die_with_launcher`), so no orphan goes on training and saving;
* `--config_file accelerate.yaml` takes ranks, nodes and rendezvous from an `accelerate config`
  file and gives the workers what `accelerate launch --config_file` gives them (its DeepSpeed
  environment), plus the file for `zeroshard.Accelerator`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from ..compat.deepspeed import launcher_flags as deepspeed_flags
from ..dist.process_group import ENGAGED_DIR
from ..compat.deepspeed.alias import real_deepspeed_installed
from .nodes import announce, apply_node_defaults

#: The directory whose deepspeed.py makes `import deepspeed` load zeroshard in the workers.
SHIM = Path(__file__).resolve().parent.parent / "compat" / "deepspeed" / "_deepspeed_shim"
#: Run by path to pin each worker to its cores (--bind_cores_to_rank).
BIND = Path(__file__).resolve().parent / "bind.py"

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
DeepSpeed launcher flags (each mapped onto torchrun; zeroshard never ssh-es):
  --num_gpus N / --num_nodes N      --nproc-per-node N / --nnodes N
  --master_addr, --master_port, --node_rank, --module, --no_python: torchrun's own
  --include localhost:0,1 / --exclude localhost:0   this node's devices (CUDA_VISIBLE_DEVICES)
  --bind_cores_to_rank [--bind_core_list 0-7]   each rank on its share of the cores,
                                    OMP_NUM_THREADS = that share
  --hostfile FILE                   one local host: its slots are the rank count; several hosts:
                                    run on each with --no_ssh --node_rank R --master_addr A
                                    (torchrun's static rendezvous), or see the error for the
                                    torchrun / Slurm command lines
  --enable_each_rank_log DIR        torchrun's --log-dir DIR --redirects 3
import deepspeed:
  when DeepSpeed is not installed, a script's 'import deepspeed' and 'from deepspeed.X import Y'
  load zeroshard's modules in the workers (only under zeroshard run; 'python script.py' still
  needs 'import zeroshard as deepspeed'). --alias-deepspeed does it even when DeepSpeed is
  installed; --no-alias-deepspeed never.
local rank:
  torchrun gives each worker LOCAL_RANK in its environment. A script that declares a
  '--local_rank' (or '--local-rank') option, or imports deepspeed (DeepSpeed's launcher always
  passes it), also gets '--local_rank=<n>' before its own arguments. --no_local_rank turns this
  off.
Accelerate:
  --config_file accelerate.yaml     an 'accelerate config' file: num_processes, num_machines,
                                    machine_rank, main_process_ip/port; with distributed_type:
                                    DEEPSPEED the workers get accelerate launch's DeepSpeed
                                    environment (the real accelerate drives zeroshard) and the
                                    file (zeroshard.Accelerator reads it)
  without GPUs, accelerate in 2+ workers forms one gloo group (DEEPSPEED when asked for, else
  MULTI_CPU as with Accelerator(cpu=True)) where alone it would run each worker as a world of one
ZeRO engaged or an error:
  a launch given a DeepSpeed config (that YAML, or --deepspeed / --deepspeed_config x.json among
  the script's arguments) in which no worker built a ZeRO engine exits 1 saying so;
  --no-zero-check for an evaluation-only job
"""

# Options that, when given, mean the user chose the rendezvous: leave it to torchrun untouched.
_RDZV_DEFAULTS = {"rdzv_backend": "static", "rdzv_endpoint": "", "master_port": None,
                  "master_addr": "127.0.0.1", "node_rank": 0}

_LOCAL_RANK_DECL = re.compile(r"""(["'])(--local[_-]rank)\1""")


class UsageError(Exception):
    """A command-line mistake reported as one line and exit code 2."""


def build_run_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser, renamed, with DeepSpeed's launcher flags and --config_file."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "zeroshard run"
    parser.description = ("Launch a training script on N ranks through torchrun "
                          "(torch.distributed.run); all torchrun options are accepted.")
    parser.epilog = _RUN_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    # No abbreviations: the script's own arguments come after it, and one that is a prefix of
    # two launcher options ("--a", "--b") would otherwise stop the launch as ambiguous.
    parser.allow_abbrev = False
    if "PET_NPROC_PER_NODE" not in os.environ:
        parser.set_defaults(nproc_per_node=None)  # None: fill in from the hardware later
    group = parser.add_argument_group("zeroshard additions")
    group.add_argument("--num_gpus", "--num-gpus", "--num_accelerators", dest="nproc_per_node",
                       default=argparse.SUPPRESS, metavar="N",
                       help="DeepSpeed launcher spelling of --nproc-per-node")
    group.add_argument("--num_nodes", "--num-nodes", dest="nnodes", default=argparse.SUPPRESS,
                       metavar="N", help="DeepSpeed launcher spelling of --nnodes")
    group.add_argument("--no_local_rank", "--no-local-rank", action="store_true",
                       help="never append --local_rank=<n> to the script's arguments")
    group.add_argument("--alias-deepspeed", "--alias_deepspeed", action="store_true",
                       help="'import deepspeed' loads zeroshard even though DeepSpeed is installed")
    group.add_argument("--no-alias-deepspeed", "--no_alias_deepspeed", action="store_true",
                       help="never make 'import deepspeed' load zeroshard")
    group.add_argument("--no-zero-check", "--no_zero_check", action="store_true",
                       help="do not fail a job that was given a DeepSpeed config but built no "
                            "ZeRO engine (an evaluation-only script)")
    group.add_argument("--config_file", "--config-file", default=None, metavar="YAML",
                       help="an 'accelerate config' file (accelerate launch's --config_file)")
    deepspeed_flags.add_arguments(parser)
    return parser


def prepare_run_args(argv: list[str]) -> argparse.Namespace:
    """Parse `zeroshard run` arguments and apply zeroshard's defaults and translations; the
    environment the workers need is `args.zeroshard_env`. Raises UsageError."""
    args = build_run_parser().parse_args(argv)
    env: dict[str, str] = {}
    try:
        if args.config_file:
            env.update(_apply_accelerate_config(args, argv))
        env.update(deepspeed_flags.apply(args, argv, _cuda_count()))
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.nproc_per_node is None:
        args.nproc_per_node = str(_default_nproc(env))
    _check_script(args)
    if not args.standalone and _single_node(args) and all(
            getattr(args, k) == v for k, v in _RDZV_DEFAULTS.items()):
        args.standalone = True
    args.node_notes, args.node_env = [], {}
    if not args.standalone and not _single_node(args):
        args.node_notes, args.node_env = apply_node_defaults(args)
    source = script_source(args.training_script, module=args.module)
    if not args.no_local_rank:
        flag = declared_local_rank_flag(args.training_script, module=args.module) or \
            ("--local_rank" if deepspeed_flags.imports_deepspeed(source) else None)
        given = any(a.split("=")[0] in ("--local_rank", "--local-rank")
                    for a in args.training_script_args)
        if flag and not given:
            from torch.distributed.elastic.utils.api import macros

            # torchrun's agent replaces the ${local_rank} macro with each worker's local rank.
            args.training_script_args = [f"{flag}={macros.local_rank}",
                                         *args.training_script_args]
    env.update(_alias_env(args, source))
    env.update(_deepspeed_env(args))
    args.zero_expected = None if args.no_zero_check or "ZEROSHARD_WORKER_HOOKS" not in env else \
        _asks_for_zero(args, env)
    if args.bind_cores_to_rank or args.bind_core_list:
        _bind_cores(args)
    args.zeroshard_env = env
    return args


def run_command(argv: list[str]) -> int:
    """`zeroshard run`: launch through torch.distributed.run in this process; return exit code."""
    args = prepare_run_args(argv)
    os.environ.update(args.node_env)  # inherited by the workers
    announce(args.node_notes, args.rdzv_endpoint or args.master_addr)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    os.environ.update(args.zeroshard_env)  # the workers inherit this process's environment
    workers_die_with_launcher()
    with tempfile.TemporaryDirectory(prefix="zeroshard-engaged-") as engaged:
        os.environ[ENGAGED_DIR] = engaged  # initialize() leaves a mark there (mark_engaged)
        try:
            run(args)
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            print(f"zeroshard run: {err.name} failed on rank {rank} "
                  f"(exit code {failure.exitcode}); its output is above.", file=sys.stderr)
            code = failure.exitcode
            return code if isinstance(code, int) and code > 0 else 1
        except SignalException as err:
            # torchrun forwarded the signal to the workers and stopped them: a preemption, not a
            # crash. If every worker then exited 0 (a script that saves on SIGTERM and returns),
            # so does the launcher; otherwise it exits as a process stopped by that signal does
            # (SIGTERM 143, SIGINT 130), so that a scheduler can tell the two apart.
            name = signal.Signals(err.sigval).name
            codes = _worker_exit_codes()
            if codes and all(code == 0 for code in codes):
                print(f"zeroshard run: stopped by {name}, which the workers were sent too; "
                      f"all {len(codes)} exited 0", file=sys.stderr)
                return 0
            print(f"zeroshard run: stopped by {name}, which the workers were sent too"
                  + (f" (their exit codes: {codes})" if codes else ""), file=sys.stderr)
            return 128 + int(err.sigval)
        if args.zero_expected and not os.listdir(engaged):
            print(f"zeroshard run: {args.zero_expected}, but no worker built a ZeRO engine: the "
                  "job trained without ZeRO, or did nothing. Check that the script hands that "
                  "config to deepspeed.initialize (transformers: TrainingArguments(deepspeed=...); "
                  "accelerate: Accelerator() without cpu=True). A job that is not meant to "
                  "train with it (evaluation only) can pass --no-zero-check.", file=sys.stderr)
            return 1
    return 0


#: The worker processes of the current attempt (recorded where the parent-death signal is set).
_WORKERS: list = []


def _worker_exit_codes(timeout: float = 10.0) -> list[int]:
    """The exit codes of the current attempt's workers, once they have ended (torchrun has
    signalled them); [] where they were not recorded or one is still running."""
    import subprocess

    codes = []
    for proc in _WORKERS:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            return []
    return codes


def workers_die_with_launcher() -> bool:
    """Linux: start every torchrun worker with a parent-death signal (SIGKILL), so that a
    launcher killed outright (SIGKILL, OOM killer) takes its workers with it instead of leaving
    orphans that go on training and saving. Set in the child between fork and exec (it survives
    exec, also bind.py's); a launcher that died before that leaves the child to exit at once.
    Whether it is in place."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import \
            subprocess_handler as handler
    except ImportError:  # another torch layout: workers are started as before
        return False
    if getattr(handler.Popen, "zeroshard_pdeathsig", False):
        return True
    import ctypes
    import subprocess

    libc = ctypes.CDLL(None, use_errno=True)
    launcher = os.getpid()
    pr_set_pdeathsig = 1

    def die_with_launcher() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the signal was armed
            os._exit(1)

    def popen(*args, **kwargs):
        if kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = die_with_launcher
        proc = subprocess.Popen(*args, **kwargs)
        # The workers of this attempt (an elastic restart's earlier ones have exited).
        _WORKERS[:] = [p for p in _WORKERS if p.poll() is None] + [proc]
        return proc

    popen.zeroshard_pdeathsig = True
    handler.Popen = popen
    return True


def _asks_for_zero(args: argparse.Namespace, env: dict[str, str]) -> str | None:
    """Why this launch expects a ZeRO engine (an accelerate config with DeepSpeed, or a DeepSpeed
    config file among the script's arguments), or None."""
    if env.get("ACCELERATE_USE_DEEPSPEED") == "true":
        return f"the accelerate config {args.config_file} says distributed_type: DEEPSPEED"
    script_args = list(args.training_script_args)
    for i, arg in enumerate(script_args):
        flag, _, value = arg.partition("=")
        if flag in ("--deepspeed", "--deepspeed_config", "--deepspeed-config"):
            value = value or (script_args[i + 1] if i + 1 < len(script_args) else "")
            if value.endswith(".json") or (value and os.path.isfile(value)):
                return f"the script was given the DeepSpeed config {value} ({flag})"
    return None


def _alias_env(args: argparse.Namespace, source: str) -> dict[str, str]:
    """PYTHONPATH with the `import deepspeed` shim first, unless DeepSpeed itself should load."""
    if args.alias_deepspeed and args.no_alias_deepspeed:
        raise UsageError("--alias-deepspeed and --no-alias-deepspeed contradict each other")
    if args.no_alias_deepspeed:
        return {}
    if real_deepspeed_installed() and not args.alias_deepspeed:
        if deepspeed_flags.imports_deepspeed(source):
            print(f"zeroshard run: DeepSpeed is installed, so 'import deepspeed' in "
                  f"{args.training_script} loads DeepSpeed itself; pass --alias-deepspeed to run "
                  "it on zeroshard", file=sys.stderr)
        return {}
    path = os.environ.get("PYTHONPATH", "")
    # The shim directory also holds deepspeed's package metadata (for transformers', accelerate's
    # and TRL's availability checks) and a sitecustomize.py that runs
    # compat/accelerate/worker_hooks.py.
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(SHIM), path) if p),
            "ZEROSHARD_WORKER_HOOKS": "1"}


def _deepspeed_env(args: argparse.Namespace) -> dict[str, str]:
    """The node-level variables DeepSpeed's launcher sets besides torchrun's: LOCAL_SIZE (ranks
    on this node), CROSS_RANK (this node) and CROSS_SIZE (nodes), where they are fixed numbers."""
    env = {"CROSS_RANK": str(args.node_rank)}
    if str(args.nproc_per_node).isdigit():
        env["LOCAL_SIZE"] = str(args.nproc_per_node)
    if str(args.nnodes).split(":")[-1] == str(args.nnodes).split(":")[0].strip():
        env["CROSS_SIZE"] = str(args.nnodes).split(":")[0]
    return env


def _bind_cores(args: argparse.Namespace) -> None:
    """Start each worker through bind.py, which pins it to its cores and execs the real command."""
    from torch.distributed.elastic.utils.api import macros
    from torch.distributed.run import determine_local_world_size

    if args.run_path:
        raise UsageError("--bind_cores_to_rank cannot be combined with --run-path (the workers "
                         "would run inside this process)")
    try:
        nproc = determine_local_world_size(args.nproc_per_node)
        assignment = deepspeed_flags.core_assignment(args.bind_core_list, nproc)
    except ValueError as err:
        raise UsageError(str(err)) from None
    python = os.getenv("PYTHON_EXEC", sys.executable)
    if args.no_python:
        inner = [args.training_script]
    else:
        inner = [python, "-u", *(["-m"] if args.module else []), args.training_script]
    args.training_script_args = ["-u", str(BIND), assignment, macros.local_rank, "--", *inner,
                                 *args.training_script_args]
    args.training_script, args.no_python, args.module = python, True, False


def _apply_accelerate_config(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    """Ranks, nodes and rendezvous from an `accelerate config` file (command-line options win);
    the workers' Accelerator reads the file through ZEROSHARD_ACCELERATE_CONFIG."""
    from ..compat.accelerate.config import ENV, launch_env, read_accelerate_config
    from ..compat.accelerate.worker_hooks import ACCELERATE_DEEPSPEED

    cfg = read_accelerate_config(args.config_file)
    for notice in cfg.notices:
        print(f"zeroshard run: {notice}", file=sys.stderr)
    given = {a.split("=")[0] for a in argv[:argv.index(args.training_script)] if a.startswith("-")} \
        if args.training_script in argv else set()

    def unset(*flags: str) -> bool:
        return not given & set(flags)

    if cfg.num_processes and args.nproc_per_node is None:
        if cfg.num_processes % cfg.num_machines:
            raise ValueError(f"accelerate config {cfg.path}: num_processes {cfg.num_processes} is "
                             f"not a multiple of num_machines {cfg.num_machines}")
        args.nproc_per_node = str(cfg.num_processes // cfg.num_machines)
    if cfg.num_machines > 1 and unset("--nnodes", "--num_nodes", "--num-nodes"):
        args.nnodes = str(cfg.num_machines)
    if unset("--node-rank", "--node_rank"):
        args.node_rank = cfg.machine_rank
    if cfg.rdzv_backend == "c10d" and cfg.num_machines > 1 and unset("--rdzv-backend", "--rdzv_backend"):
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = f"{cfg.main_process_ip}:{cfg.main_process_port or 29500}"
    else:
        if cfg.main_process_ip and unset("--master-addr", "--master_addr"):
            args.master_addr = cfg.main_process_ip
        if cfg.main_process_port and unset("--master-port", "--master_port"):
            args.master_port = cfg.main_process_port
    for key, flag in (("deepspeed_inclusion_filter", "include"),
                      ("deepspeed_exclusion_filter", "exclude"), ("deepspeed_hostfile", "hostfile")):
        value = cfg.deepspeed.get(key)
        if value and not getattr(args, flag):
            setattr(args, flag, str(value))
    env = {ENV: cfg.path, **launch_env(cfg)}
    if cfg.distributed_type == "DEEPSPEED":
        env[ACCELERATE_DEEPSPEED] = cfg.path
    if cfg.use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif cfg.gpu_ids and cfg.gpu_ids != "all":
        env["CUDA_VISIBLE_DEVICES"] = cfg.gpu_ids
    return env


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _default_nproc(env: dict[str, str]) -> int:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # chosen by --include/--exclude or the accelerate config
        return len([d for d in visible.split(",") if d]) or 2
    return _cuda_count() or 2


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


def script_source(script: str, module: bool = False) -> str:
    """The script's (or module's) source text, "" when it cannot be read."""
    path = _module_origin(script) if module else script
    if not path or not os.path.isfile(path):
        return ""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


def declared_local_rank_flag(script: str, module: bool = False) -> str | None:
    """The `--local_rank`/`--local-rank` spelling the script's source declares, or None."""
    source = script_source(script, module)
    found = {m.group(2) for m in _LOCAL_RANK_DECL.finditer(source)}
    if "--local_rank" in found:
        return "--local_rank"
    if "--local-rank" in found:
        return "--local-rank"
    return None

