"""One job across simulated hosts, started by tests/test_multihost.py on every host as

    zeroshard run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 10.213.0.1:29400 --rdzv-id ID tests/multihost_script.py --out DIR

1. TinyLM (tests/models.py) at stages 1, 2 and 3, and at stage 3 with ZeRO++ hpZ (secondary
   shards inside each host: "3hpz"): rank 0 writes the final parameters to DIR/stage<S>.pt for
   the test to compare with its single-process reference.
2. The link: per stage, a few steps of a larger model between barriers; every rank writes
   DIR/link_rank<R>.json with its node (GROUP_RANK), its comm_report() for those steps and the
   bytes its host's interface (GLOO_SOCKET_IFNAME) sent and received meanwhile (/proc/net/dev is
   the host's own here: each host is a network namespace); the same for three all-reduces.
3. examples/train_elastic.py's loop, uninterrupted (`--elastic-ckpt`): the result a killed and
   restarted run must equal, bitwise.

It ends by returning from main: the process groups are left to zeroshard's own clean exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import zeroshard  # noqa: E402
from zeroshard.dist import Comm  # noqa: E402
from tests.models import lm_loss, make_batches, make_model, micro_slice  # noqa: E402

STEPS, MICRO, LR = 4, 2, 1e-2
LINK_STEPS = 3
LEAN = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0}


def zero_section(stage) -> dict:
    """Stage 3 with every parameter sharded and nothing kept gathered: exactly 3 x Psi a step;
    "3hpz" adds hpZ with the ranks of one host as its group."""
    if stage == "3hpz":
        return {**zero_section(3), "zero_hpz_partition_size": int(os.environ["LOCAL_WORLD_SIZE"])}
    return {"stage": stage, "reduce_bucket_size": 10**9, **(LEAN if stage == 3 else {})}


def train_tiny(stage, rank: int, world: int) -> dict:
    """TinyLM with Adam on the global batches of make_batches; the final parameters (rank 0)."""
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR),
        config={"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
                "zero_optimization": {**zero_section(stage), "reduce_bucket_size": 100}})
    for batch in make_batches(STEPS, world * MICRO):
        tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
    state = engine.consolidated_state_dict()
    engine.destroy()
    return state


def link_bytes() -> tuple[int, int]:
    """(sent, received) bytes of this host's inter-host interface."""
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == ifname:
            values = fields.split()
            return int(values[8]), int(values[0])
    raise KeyError(ifname)


def measure_link(stage) -> dict:
    """comm_report() and the interface's byte counters over LINK_STEPS steps of a 1 MB model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero_section(stage)})
    x = torch.randn(4, 256)

    def step():
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    step()  # connections, the stage-3 trace: outside the window
    dist.barrier()
    before, (sent0, recv0) = engine.comm_report(), link_bytes()
    for _ in range(LINK_STEPS):
        step()
    dist.barrier()
    after, (sent1, recv1) = engine.comm_report(), link_bytes()
    engine.destroy()
    psi = sum(p.numel() for p in model.parameters())
    return {"psi": psi, "sent": sent1 - sent0, "received": recv1 - recv0,
            **{k: after[k] - before[k] for k in after}}


def measure_ring() -> dict:
    """comm_report() and the interface's counters over three 4 MiB all-reduces: gloo runs those
    as a ring in rank order, the ledger's own model."""
    comm = Comm()
    data = torch.ones(1 << 20)
    dist.barrier()
    sent0, recv0 = link_bytes()
    for _ in range(3):
        comm.all_reduce(data)
    dist.barrier()
    sent1, recv1 = link_bytes()
    return {"sent": sent1 - sent0, "received": recv1 - recv0, **comm.report()}


def main() -> None:
    """Train, measure, write the results; see the module docstring."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--elastic-ckpt", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    zeroshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    for stage in (1, 2, 3, "3hpz"):
        state = train_tiny(stage, rank, world)
        if rank == 0:
            torch.save(state, out / f"stage{stage}.pt")
    link = {"rank": rank, "node": int(os.environ["GROUP_RANK"]),
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "stages": {stage: measure_link(stage) for stage in (1, 2, 3, "3hpz")},
            "ring": measure_ring()}
    (out / f"link_rank{rank}.json").write_text(json.dumps(link))
    if args.elastic_ckpt:
        import train_elastic

        train_elastic.train(train_elastic.parse_args(
            ["--ckpt", args.elastic_ckpt, "--out", str(out / "elastic.pt")]))


if __name__ == "__main__":
    main()
