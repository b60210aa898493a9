"""DeepSpeed's launcher flags for `zeroshard run`, each mapped onto torchrun (zeroshard never ssh-es).

  --num_gpus / --num_accelerators N   --nproc-per-node N      (cli/launch.py adds it)
  --num_nodes N                       --nnodes N (the first N hosts of a --hostfile)
  --master_addr, --master_port, --node_rank, --module, --no_python: torchrun's own options
  -i/--include, -e/--exclude SPEC     this node's device ids ("localhost:0,2", DeepSpeed's
                                      NODE[:ids]@NODE... syntax): CUDA_VISIBLE_DEVICES and as
                                      many ranks; other hosts are an error (run each node itself)
  -H/--hostfile FILE                  "host slots=N" lines: one local host gives the rank count;
                                      several hosts need --no_ssh --node_rank R --master_addr A on
                                      each (DeepSpeed's no-ssh mode, i.e. torchrun's static
                                      rendezvous); otherwise an error showing the torchrun and
                                      Slurm command lines
  --bind_cores_to_rank, --bind_core_list L   each rank pinned to its share of the cores (the
                                      cores of L, else one per physical core this process may
                                      use) and OMP_NUM_THREADS set to that share (cli/bind.py)
  --enable_each_rank_log DIR          torchrun's --log-dir DIR --redirects 3
  --no_ssh, --no_ssh_check, --log_level, -q/--quiet   accepted; nothing to change
DeepSpeed-only options (--launcher, --autotuning, ...) are errors that say what to do instead.
Problems raise ValueError; cli/launch.py reports them as one usage line.
"""

from __future__ import annotations

import argparse
import os
import re
import socket

__all__ = ["add_arguments", "apply", "core_assignment", "imports_deepspeed", "read_hostfile"]

_IMPORTS_DEEPSPEED = re.compile(
    r"^\s*(?:import\s+deepspeed\b|from\s+deepspeed\b|import\s+zeroshard\s+as\s+deepspeed\b)",
    re.MULTILINE)
_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")
_DS_ONLY = {
    "launcher": "zeroshard runs torchrun on each node; start it there yourself (see --hostfile)",
    "launcher_args": "there is no multi-node launcher to pass arguments to (see --hostfile)",
    "force_multi": "there is no multi-node launcher (see --hostfile)",
    "ssh_port": "zeroshard does not ssh (see --hostfile)",
    "venv_script": "activate the environment before zeroshard run on each node",
    "autotuning": "autotuning is not supported; zeroshard plan recommends a config instead",
    "elastic_training": "use torchrun's --nnodes MIN:MAX with --rdzv-backend c10d and "
                        "--max-restarts",
    "min_elastic_nodes": "use torchrun's --nnodes MIN:MAX",
    "max_elastic_nodes": "use torchrun's --nnodes MIN:MAX",
    "save_pid": "the launcher's pid is this process's (e.g. $! in the shell that started it)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add DeepSpeed's launcher options (besides --num_gpus/--num_nodes) to `parser`."""
    group = parser.add_argument_group("DeepSpeed launcher options (mapped onto torchrun)")
    group.add_argument("-i", "--include", default="", metavar="SPEC",
                       help="this node's device ids to use, e.g. localhost:0,1")
    group.add_argument("-e", "--exclude", default="", metavar="SPEC",
                       help="this node's device ids not to use, e.g. localhost:0")
    group.add_argument("-H", "--hostfile", default=None, metavar="FILE",
                       help="'host slots=N' lines; see the epilog for several hosts")
    group.add_argument("--bind_cores_to_rank", "--bind-cores-to-rank", action="store_true",
                       help="pin each rank to its share of the CPU cores; OMP_NUM_THREADS = share")
    group.add_argument("--bind_core_list", "--bind-core-list", default=None, metavar="LIST",
                       help="cores to share out, e.g. 0-7,16-23 (implies --bind_cores_to_rank)")
    group.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                       help="each rank's output into files under DIR (torchrun's --log-dir "
                            "--redirects 3)")
    for flag in ("--no_ssh", "--no_ssh_check", "-q", "--quiet"):
        group.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--log_level", default=None, help=argparse.SUPPRESS)
    for name in _DS_ONLY:
        group.add_argument(f"--{name}", dest=f"ds_only_{name}", nargs="?", const=True,
                           default=None, help=argparse.SUPPRESS)


def imports_deepspeed(source: str) -> bool:
    """Whether a script's source imports deepspeed (so it was written for DeepSpeed's launcher,
    which always passes --local_rank=<n>)."""
    return bool(_IMPORTS_DEEPSPEED.search(source))


def apply(args: argparse.Namespace, argv: list[str], cuda_devices: int) -> dict[str, str]:
    """Translate DeepSpeed's flags in `args` into torchrun's (in place); returns environment
    variables the workers need. `cuda_devices` is the number of visible GPUs (0 on a CPU host)."""
    for name, advice in _DS_ONLY.items():
        if getattr(args, f"ds_only_{name}") is not None:
            raise ValueError(f"--{name} is a DeepSpeed launcher option with no equivalent in "
                             f"zeroshard run: {advice}")
    if args.enable_each_rank_log:
        args.log_dir, args.redirects = args.enable_each_rank_log, "3"
    env: dict[str, str] = {}
    given = _given(argv, args.training_script)
    slots = None
    if args.hostfile:
        slots = _apply_hostfile(args, given)
    if args.include or args.exclude:
        if args.include and args.exclude:
            raise ValueError("--include and --exclude cannot be combined (as in DeepSpeed)")
        if given & {"--nproc-per-node", "--nproc_per_node", "--num_gpus", "--num-gpus",
                    "--num_accelerators"}:
            raise ValueError("--num_gpus/--nproc-per-node cannot be combined with "
                             "--include/--exclude (as in DeepSpeed): the device list sets both")
        available = list(range(slots if slots is not None else
                               cuda_devices or int(args.nproc_per_node or 2)))
        chosen = _filter_devices(args.include, args.exclude, available, checked=slots is None and
                                 cuda_devices > 0 and "CUDA_VISIBLE_DEVICES" not in os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in chosen)
        args.nproc_per_node = str(len(chosen))
    elif slots is not None and args.nproc_per_node is None:
        args.nproc_per_node = str(slots)
    return env


def _given(argv: list[str], script: str) -> set[str]:
    """The option names written on the command line before the script."""
    out = set()
    for arg in argv:
        if arg == script:
            break
        if arg.startswith("-"):
            out.add(arg.split("=")[0])
    return out


def _local_names() -> set[str]:
    host = socket.gethostname()
    return {"localhost", "127.0.0.1", "::1", host, host.split(".")[0], socket.getfqdn()}


def read_hostfile(path: str) -> dict[str, int]:
    """{host: slots} from DeepSpeed's hostfile lines ("worker-1 slots=4"; # comments)."""
    hosts: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            match = _HOSTFILE_LINE.match(line)
            if not match:
                raise ValueError(f"--hostfile {path}, line {number}: expected 'hostname slots=N', "
                                 f"got {line!r}")
            if match.group(1) in hosts:
                raise ValueError(f"--hostfile {path}: host {match.group(1)} is listed twice")
            hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise ValueError(f"--hostfile {path}: no 'hostname slots=N' lines")
    return hosts


def _apply_hostfile(args: argparse.Namespace, given: set[str]) -> int | None:
    """Local slots from the hostfile, or the no-ssh mapping onto torchrun's static rendezvous."""
    if not os.path.isfile(args.hostfile):
        print(f"zeroshard run: hostfile {args.hostfile} not found; running on this node only "
              "(as DeepSpeed does)", flush=True)
        return None
    hosts = read_hostfile(args.hostfile)
    if args.nnodes not in ("1:1", None) and ":" not in str(args.nnodes):
        hosts = dict(list(hosts.items())[:int(args.nnodes)])  # DeepSpeed's --num_nodes: the first N
    names = list(hosts)
    if len(names) == 1 and names[0] in _local_names():
        return hosts[names[0]]
    if not args.no_ssh:
        first, slots = names[0], hosts[names[0]]
        raise ValueError(
            f"--hostfile {args.hostfile} lists {len(names)} host(s) ({', '.join(names)}) and "
            "zeroshard run does not ssh to other hosts. Start it on every host, e.g. on host R: "
            f"'zeroshard run --hostfile {args.hostfile} --no_ssh --node_rank R --master_addr "
            f"{first} --master_port 29500 train.py ...' (the same as 'torchrun --nnodes "
            f"{len(names)} --node-rank R --nproc-per-node {slots} --master-addr {first} "
            "--master-port 29500 train.py ...'), or under Slurm: 'srun --nodes "
            f"{len(names)} --ntasks-per-node 1 zeroshard run --nnodes {len(names)} "
            f"--nproc-per-node {slots} --rdzv-backend c10d --rdzv-endpoint {first}:29500 "
            "train.py ...'")
    if not given & {"--node_rank", "--node-rank"}:
        raise ValueError("--hostfile with --no_ssh needs --node_rank R (this host's index in the "
                         "hostfile, as DeepSpeed requires)")
    if not given & {"--master_addr", "--master-addr"}:
        raise ValueError(f"--hostfile with --no_ssh needs --master_addr (the address of "
                         f"{names[0]}, the first host)")
    if not 0 <= args.node_rank < len(names):
        raise ValueError(f"--node_rank {args.node_rank}: the hostfile lists {len(names)} hosts")
    args.nnodes = str(len(names))
    return hosts[names[args.node_rank]]


def _filter_devices(include: str, exclude: str, available: list[int], checked: bool) -> list[int]:
    """This node's devices after DeepSpeed's --include / --exclude `NODE[:ids]@NODE...` spec."""
    spec = include or exclude
    flag = "--include" if include else "--exclude"
    local = _local_names()
    named: dict[str, list[int]] = {}
    for part in spec.split("@"):
        host, _, ids = part.partition(":")
        if host not in local:
            raise ValueError(f"{flag} {spec!r} names host {host!r}: zeroshard run starts ranks "
                             "on this machine only (it does not ssh). Run it on each node with "
                             "that node's ids, e.g. --include localhost:0,1")
        try:
            named.setdefault(host, []).extend(int(i) for i in ids.split(",") if ids)
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: device ids are whole numbers, e.g. "
                             "localhost:0,2") from None
    ids = sorted({i for values in named.values() for i in values})
    whole_host = any(not values for values in named.values())
    if checked:
        bad = [i for i in ids if i not in available]
        if bad:
            raise ValueError(f"{flag} {spec!r}: no device {bad[0]} on this node "
                             f"(devices {available})")
    if include:
        chosen = available if whole_host else ids
    else:
        chosen = [] if whole_host else [i for i in available if i not in ids]
    if not chosen:
        raise ValueError(f"{flag} {spec!r} leaves no device to run on")
    return chosen


def core_assignment(core_list: str | None, nproc: int) -> str:
    """bind.py's per-rank core lists ("0-3;4-7"): the cores of `core_list` (DeepSpeed's syntax),
    else one logical CPU per physical core this process may use, split evenly in order."""
    from ...cli.bind import parse_cores

    if core_list:
        try:
            cores = parse_cores(core_list)
        except ValueError as err:
            raise ValueError(f"--bind_core_list {core_list!r}: {err}; write e.g. 0-7,16-23") from None
    else:
        cores = _physical_cores()
    per_rank = len(cores) // nproc
    if per_rank < 1:
        raise ValueError(f"--bind_cores_to_rank: {len(cores)} core(s) for {nproc} ranks; each "
                         "rank needs at least one (fewer ranks, or a longer --bind_core_list)")
    return ";".join(",".join(str(c) for c in cores[r * per_rank:(r + 1) * per_rank])
                    for r in range(nproc))


def _physical_cores() -> list[int]:
    """The CPUs this process may run on, keeping the first hyper-thread of each physical core."""
    seen, out = set(), []
    for cpu in sorted(os.sched_getaffinity(0)):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as a, open(f"{base}/core_id") as b:
                key = (a.read().strip(), b.read().strip())
        except OSError:
            key = ("cpu", str(cpu))
        if key not in seen:
            seen.add(key)
            out.append(cpu)
    return out
