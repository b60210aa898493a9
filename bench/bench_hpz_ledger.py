"""hpZ's and MiCS's ledger figures: bytes per step, intra/inter-host, vs plain stage 3, 2 hosts x 2.

Four gloo ranks on this machine, laid out as two hosts of two (LOCAL_WORLD_SIZE=2, as torchrun
sets it), train the demo GPT (`zeroshard demo`'s TinyGPT, 1.3 M parameters) in bf16 at stage 3
without reuse or persistent parameters, plain, with `zero_hpz_partition_size: 2` and with `mics_shard_size: 2`. Prints one
markdown row per variant: comm ledger bytes of one optimizer step (the second), split intra/inter
host and into all-gather / reduce-scatter, and the parameter bytes the memory ledger shows right
after a forward (secondary shards held) and after the step. The figures are the ledger's ring
model, not wire measurements (the cluster bench measures those); no timing here.

    python bench/bench_hpz_ledger.py [--gas 1]
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, PER_HOST, MICRO = 4, 2, 4


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, gas: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % PER_HOST),
                      LOCAL_WORLD_SIZE=str(PER_HOST), ZEROSHARD_QUIET="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import zeroshard
    from zeroshard.cli.demo import GPTConfig, TinyGPT, ds_config

    rows = []
    for hpz, mics in ((1, -1), (PER_HOST, -1), (1, PER_HOST)):
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig())
        psi = sum(p.numel() for p in model.parameters())
        # A model this small fits whole under DeepSpeed's default reuse distance (nothing is
        # gathered again in backward): no reuse and no persistent parameters, as for a model
        # whose blocks are each larger than the reuse distance.
        zero = {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}
        if hpz > 1:
            zero["zero_hpz_partition_size"] = hpz
        if mics > 0:
            zero["mics_shard_size"] = mics
        config = {**ds_config(zero, MICRO, 1e-3), "bf16": {"enabled": True},
                  "gradient_accumulation_steps": gas}
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        gen = torch.Generator().manual_seed(rank)
        after_forward = 0
        for _ in range(2):
            engine.comm.reset()
            for _ in range(gas):
                idx = torch.randint(0, 128, (MICRO, 65), generator=gen)
                loss = torch.nn.functional.cross_entropy(
                    engine(idx[:, :-1]).float().flatten(0, 1), idx[:, 1:].flatten())
                after_forward = engine.memory_report()["params"]["device"]
                engine.backward(loss)
                engine.step()
        report = engine.comm_report()
        comm = engine.comm
        rows.append({"hpz": hpz, "mics": mics, "psi": psi,
                     "total": report["total"], "intra": report["intra_host"],
                     "inter": report["inter_host"], "all_gather": report["all_gather"],
                     "all_gather_inter": comm.inter_host_bytes.get("all_gather", 0),
                     "reduce_scatter": report["reduce_scatter"],
                     "all_reduce": report["all_reduce"],
                     "params_after_forward": after_forward,
                     "params_after_step": engine.memory_report()["params"]["device"]})
        engine.destroy()
    queue.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Run the four ranks and print rank 0's table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.gas, queue)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    rows = results[0]
    mb = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
    print(f"TinyGPT, {rows[0]['psi']:,} parameters, bf16, stage 3, {WORLD} ranks as 2 hosts x "
          f"{PER_HOST}, gradient accumulation {args.gas}; rank 0, MiB per optimizer step")
    print("| variant | total | intra-host | inter-host | all-gather (inter-host) | reduce-scatter "
          "| all-reduce | params after forward | params after step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        name = "stage 3" + (f" + hpZ {row['hpz']}" if row["hpz"] > 1 else "") + \
            (f" + MiCS {row['mics']}" if row["mics"] > 0 else "")
        print(f"| {name} | {mb(row['total'])} | {mb(row['intra'])} | {mb(row['inter'])} | "
              f"{mb(row['all_gather'])} ({mb(row['all_gather_inter'])}) | "
              f"{mb(row['reduce_scatter'])} | {mb(row['all_reduce'])} | "
              f"{mb(row['params_after_forward'])} | {mb(row['params_after_step'])} |")
    plain = rows[0]
    for row in rows[1:]:
        print(f"inter-host bytes / plain stage 3, hpZ {row['hpz']} MiCS {row['mics']}: "
              f"{row['inter'] / plain['inter']:.3f}")


if __name__ == "__main__":
    main()
