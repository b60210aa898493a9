"""`zeroshard convert`: a DeepSpeed checkpoint into a zeroshard one and back
(`checkpoint/convert.py`)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    """The `convert` subcommand's options, on the top-level parser's subparsers `sub`."""
    con = sub.add_parser(
        "convert", help="turn a DeepSpeed checkpoint into a zeroshard one, or back",
        description="Convert a checkpoint offline, in one process: --from deepspeed reads a "
        "DeepSpeed 0.19 ZeRO checkpoint and writes a zeroshard one (any world size and stage "
        "loads it); --to deepspeed writes a zeroshard checkpoint as DeepSpeed's files for "
        "--world-size ranks at --stage, which DeepSpeed's load_checkpoint resumes from. DST "
        "must not exist or be empty; it is written whole or not at all.")
    way = con.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["deepspeed"], help="zeroshard SRC -> DeepSpeed DST")
    way.add_argument("--from", dest="from_", choices=["deepspeed"],
                     help="DeepSpeed SRC -> zeroshard DST")
    con.add_argument("src", help="the save_dir of the checkpoint (holds 'latest' and the tags)")
    con.add_argument("dst", help="the new save_dir to write")
    con.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    con.add_argument("--world-size", type=int, default=None,
                     help="--to deepspeed: the ranks DeepSpeed will load it on (default: the "
                     "world size that saved it); DeepSpeed resumes only at this world size")
    con.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None,
                     help="--to deepspeed: the ZeRO stage of the DeepSpeed run (default: the "
                     "config's, else the saved one)")
    con.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                     help="--to deepspeed: the DeepSpeed run's precision (default: the config's, "
                     "else fp32); bf16 names the files bf16_zero_pp_rank_*")
    con.add_argument("--config", default=None, metavar="DS_CONFIG_JSON",
                     help="--to deepspeed: the DeepSpeed config that will load it (stage, "
                     "precision, fp16 loss scaling, sub_group_size are taken from it)")
    return con


def run(args) -> int:
    """Run `zeroshard convert` with parsed `args`; prints the written directory."""
    from ..checkpoint import CheckpointError
    from ..checkpoint.convert import convert
    from .launch import UsageError

    if args.from_ is not None and any(v is not None for v in
                                      (args.world_size, args.stage, args.dtype, args.config)):
        raise UsageError("--world-size, --stage, --dtype and --config go with --to deepspeed "
                         "(a zeroshard checkpoint loads at any world size and stage)")
    try:
        out = convert(args.src, args.dst, to=args.to, from_=args.from_, tag=args.tag,
                      world_size=args.world_size, stage=args.stage, dtype=args.dtype,
                      ds_config=args.config)
    except (CheckpointError, ValueError) as err:
        raise UsageError(str(err)) from None
    print(out)
    return 0
