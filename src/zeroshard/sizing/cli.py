"""`zeroshard estimate` and `zeroshard plan`: argument parsing and printing around
`estimate.py` and `plan.py`."""

from __future__ import annotations

import argparse
import json
import os

from .estimate import OFFLOADS, PRECISIONS, STATE_BYTES, Shape, describe_model, estimate, \
    model_from_spec, parse_count
from .hierarchy import hpz_row, quantized_row
from .plan import plan, write_config


def _size(text: str) -> float:
    """`80GB`, `80GiB`, `512G`, `1.5T` or bytes -> bytes."""
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "k": 1e3, "m": 1e6,
             "g": 1e9, "t": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    raw = text.strip().lower()
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 80GB or 40GiB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, cluster and shape options `estimate` and `plan` share."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="parameter count: 7.5e9, 7B, 1.3B, 350M")
    what.add_argument("--model", metavar="MODULE:FACTORY",
                      help="build the model on the meta device (no memory) and count it")
    parser.add_argument("--gpus", type=_positive, default=None,
                        help="data-parallel GPUs in all (default: gpus-per-node x nodes, or 1)")
    parser.add_argument("--gpus-per-node", type=_positive, default=None)
    parser.add_argument("--nodes", type=_positive, default=None)
    parser.add_argument("--precision", choices=list(PRECISIONS), default="mixed",
                        help="mixed/bf16/fp16: 2+2 bytes + fp32 master (K=12 with Adam); "
                             "fp32: 4+4 bytes, the parameter is the master (K=8 with Adam); "
                             "bf16-master: bf16 with bf16 master weights and optimizer state "
                             "(K=6 with Adam)")
    parser.add_argument("--optimizer", choices=list(STATE_BYTES), default="adam")
    shape = parser.add_argument_group("model shape (for the modelled columns)")
    shape.add_argument("--hidden", type=_positive)
    shape.add_argument("--layers", type=_positive)
    shape.add_argument("--heads", type=_positive)
    shape.add_argument("--seq", type=_positive)
    shape.add_argument("--micro-batch", type=_positive, default=1)
    shape.add_argument("--vocab", type=_positive)


def _resolve(args) -> tuple[float, int, int, Shape]:
    """Parameter count, GPUs, GPUs per node and shape from parsed arguments."""
    shape = Shape(hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq,
                  micro_batch=args.micro_batch, vocab=args.vocab)
    if args.model:
        params, found = describe_model(model_from_spec(args.model))
        for key in ("hidden", "layers", "heads", "vocab", "largest_unit"):
            if getattr(shape, key) is None:
                setattr(shape, key, getattr(found, key))
    else:
        params = parse_count(args.params)
    per_node = args.gpus_per_node
    gpus = args.gpus
    if gpus is None:
        gpus = (per_node or 1) * (args.nodes or 1)
    elif per_node and args.nodes and per_node * args.nodes != gpus:
        raise ValueError(f"--gpus {gpus} contradicts --gpus-per-node {per_node} x --nodes "
                         f"{args.nodes}; give two of them")
    if per_node is None:
        per_node = -(-gpus // args.nodes) if args.nodes else min(gpus, 8)
    return params, gpus, per_node, shape


def estimate_main(argv: list[str]) -> int:
    """`zeroshard estimate ...`; returns the exit code (ValueError for bad values)."""
    parser = argparse.ArgumentParser(
        prog="zeroshard estimate",
        description="Per-GPU memory of plain data parallelism and ZeRO stages 1-3 (the ZeRO "
                    "paper's formulas), with offload variants, comm volume and, with "
                    "--with-buffers, modelled buffers and activations.")
    add_model_arguments(parser)
    parser.add_argument("--offload", choices=OFFLOADS, default=None,
                        help="offload the optimizer (stages 1-3) and parameters (stage 3)")
    parser.add_argument("--offload-optimizer", choices=OFFLOADS, default="none")
    parser.add_argument("--offload-param", choices=OFFLOADS, default="none")
    parser.add_argument("--with-buffers", action="store_true",
                        help="add comm buckets, gathered stage-3 units and activations")
    parser.add_argument("--bucket", type=float, default=5e8, help="reduce_bucket_size (elements)")
    parser.add_argument("--live-units", type=_positive, default=2,
                        help="stage-3 units gathered at once (the largest one times this)")
    parser.add_argument("--hpz", type=_positive, default=1, metavar="P",
                        help="add a stage-3 row with ZeRO++ hpZ (zero_hpz_partition_size=P): "
                             "secondary parameter shards in groups of P GPUs, usually a node's")
    parser.add_argument("--qwz", action="store_true",
                        help="add a stage-3 row (with hpZ if --hpz) with ZeRO++ qwZ "
                             "(zero_quantized_weights): int8 weight all-gathers")
    parser.add_argument("--qgz", action="store_true",
                        help="add a stage-3 row (with hpZ if --hpz, qwZ if --qwz) with ZeRO++ "
                             "qgZ (zero_quantized_gradients): int8 gradients across nodes")
    parser.add_argument("--json", action="store_true", help="print the structured result")
    args = parser.parse_args(argv)
    params, gpus, per_node, shape = _resolve(args)
    opt = args.offload or args.offload_optimizer
    par = args.offload or args.offload_param
    est = estimate(params, gpus, per_node, args.precision, args.optimizer, opt, par, shape,
                   args.bucket, args.live_units)
    p = PRECISIONS[args.precision][0]
    if args.hpz > 1:
        est.rows.append(hpz_row(est.row(3), params, gpus, p, args.hpz))
    if args.qwz or args.qgz:
        est.rows.append(quantized_row(est.rows[-1] if args.hpz > 1 else est.row(3), params, gpus,
                                      per_node, p, args.qwz, args.qgz))
    if args.json:
        print(json.dumps({"params": est.params, "gpus": est.gpus,
                          "gpus_per_node": est.gpus_per_node, "precision": est.precision,
                          "optimizer": est.optimizer,
                          "rows": [vars(r) for r in est.rows]}, indent=2))
    else:
        print(est.table(args.with_buffers))
    return 0


def plan_main(argv: list[str]) -> int:
    """`zeroshard plan ...`; returns the exit code (1 when nothing fits)."""
    parser = argparse.ArgumentParser(
        prog="zeroshard plan",
        description="Recommend the least-communication ZeRO configuration that fits, explain "
                    "why each cheaper one does not, and write its DeepSpeed-format JSON.")
    add_model_arguments(parser)
    parser.set_defaults(precision="bf16")
    parser.add_argument("--gpu-mem", type=_size, required=True, help="memory per GPU, e.g. 80GB")
    parser.add_argument("--cpu-mem", type=_size, default=None, help="CPU memory per node")
    parser.add_argument("--nvme-free", type=_size, default=None, help="free NVMe space per node")
    parser.add_argument("--nvme-path", default="/local_nvme", help="nvme_path written to the config")
    parser.add_argument("--reserve", type=float, default=0.1,
                        help="fraction of GPU and CPU memory kept free (default 0.1)")
    parser.add_argument("--inter-node-gbps", type=float, default=None, metavar="GBPS",
                        help="a node's inter-node bandwidth in Gbit/s (all its NICs): on a slow "
                             "link a stage-3 choice gets ZeRO++ hpZ (zero_hpz_partition_size)")
    parser.add_argument("--out", default=None,
                        help="where the recommended config goes (default ds_config.plan.json)")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    args = parser.parse_args(argv)
    params, gpus, per_node, shape = _resolve(args)
    result = plan(params, args.gpu_mem, gpus, per_node, args.cpu_mem, args.nvme_free,
                  args.precision, args.optimizer, shape, args.reserve, args.nvme_path,
                  args.inter_node_gbps)
    print(result.report())
    if result.config is None:
        return 1
    chosen = args.out is not None
    args.out = os.path.abspath(args.out or "ds_config.plan.json")
    if os.path.exists(args.out) and not args.force:
        raise ValueError(f"--out {args.out} exists; pass --force to overwrite it or choose "
                         "another path")
    write_config(result.config, args.out)
    print(f"config written to {args.out}" +
          ("" if chosen else " (the default; --out PATH writes it elsewhere)"))
    return 0
