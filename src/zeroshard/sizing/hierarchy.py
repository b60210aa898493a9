"""Estimates across nodes: inter-node bytes per step and ZeRO++ hpZ's row, for `estimate`/`plan`.

Inter-node bytes follow the comm ledger's ring model (zeroshard.dist.comm): a collective over n
GPUs is a ring in rank order whose bytes cross nodes in proportion to the ring's hops between nodes
(1/G of them for the whole world on nodes of G GPUs; none for a group inside one node).

hpZ (`zero_hpz_partition_size` = P, stage 3): each GPU also holds a secondary parameter shard of
Psi / P elements in the compute dtype between forward and optimizer step, and the backward
all-gather runs within groups of P consecutive GPUs. Per step and GPU the forward all-gather and
the gradient reduce-scatter still move Psi (N-1)/N each over the world, the backward all-gather
Psi (P-1)/P inside its group. With P = the GPUs per node, stage 3's inter-node volume falls from
3 to 2 Psi (N-1)/N elements per ring, what stages 1-2 move, for Psi p / P more bytes per GPU.

qwZ (`zero_quantized_weights`) sends the all-gathers as int8 with one fp32 scale per
WEIGHT_BLOCK values: about 1.016 bytes per element instead of p (1-D parameters, ~1% of a
transformer, travel as fp32 and are left out of the model). qgZ (`zero_quantized_gradients`, H
nodes of G GPUs): the reduce-scatter runs in full precision inside each node (Psi p (G-1)/G per
GPU), then each GPU sends H-1 slots of Psi / N values across nodes at 1.0625 bytes each. Model
states are unchanged by either (the packed buffers are transient), except that hpZ under qwZ
keeps the packed rows as its secondary shard: Psi x 1.016 / P bytes instead of Psi p / P.
"""

from __future__ import annotations

import copy

from ..dist import HostLayout
from ..core.zeropp.quantize import GRADIENT_BLOCK, WEIGHT_BLOCK, packed_size

#: Bytes per element on the wire under qwZ / qgZ (int8 + one fp32 scale per block).
QWZ_BYTES = packed_size(WEIGHT_BLOCK * 1024, WEIGHT_BLOCK) / (WEIGHT_BLOCK * 1024)
QGZ_BYTES = packed_size(GRADIENT_BLOCK * 1024, GRADIENT_BLOCK) / (GRADIENT_BLOCK * 1024)

#: `plan` adds hpZ to a stage-3 choice when the inter-node bandwidth per GPU is below this
#: (Gbit/s). The ZeRO++ paper's low-bandwidth clusters (1-4 InfiniBand links of 100 Gbit/s per
#: node of 16 GPUs) have 6-25 Gbit/s per GPU; a DGX H100 (8 x 400 Gbit/s for 8 GPUs) has 400.
HPZ_BELOW_GBPS_PER_GPU = 100.0


def crossing_share(ranks: int, per_node: int) -> float:
    """The share of a ring over GPUs 0..ranks-1 (nodes of `per_node`) whose hops cross nodes."""
    return HostLayout(per_node).crossing_share(list(range(ranks)))


def stage3_bytes(row, params: float, gpus: int, per_node: int, p: int) -> tuple[float, float]:
    """(bytes sent, bytes crossing nodes) per GPU per step of a stage-3 row, with its hpZ / qwZ
    / qgZ flags (ring model; `p` bytes per element)."""
    ring, world = (gpus - 1) / gpus, crossing_share(gpus, per_node)
    gather = QWZ_BYTES if getattr(row, "qwz", False) else p
    size = getattr(row, "hpz", 1)
    forward = params * gather * ring
    if size > 1:  # inside groups of `size` GPUs
        backward = params * gather * (size - 1) / size
        backward_share = crossing_share(size, per_node)
    else:
        backward, backward_share = forward, world
    nodes = -(-gpus // per_node)
    if getattr(row, "qgz", False) and nodes > 1 and gpus % per_node == 0:
        across = params * (nodes - 1) / gpus * QGZ_BYTES
        reduce, reduce_inter = params * p * (per_node - 1) / per_node + across, across
    else:
        reduce = params * p * ring
        reduce_inter = reduce * world
    total = forward + backward + reduce
    return total, forward * world + backward * backward_share + reduce_inter


def inter_node_bytes(row, params: float, gpus: int, per_node: int, p: int) -> float:
    """Bytes per GPU per optimizer step that cross nodes (ring model; `p` bytes per element)."""
    if row.stage == 3:
        return stage3_bytes(row, params, gpus, per_node, p)[1]
    return 2 * params * p * (gpus - 1) / gpus * crossing_share(gpus, per_node)


def hpz_row(plain, params: float, gpus: int, p: int, size: int):
    """The stage-3 row `plain` with hpZ secondary shards in groups of `size` GPUs."""
    if plain.stage != 3 or plain.offload_param != "none":
        raise ValueError(f"hpZ applies to stage 3 without parameter offload, not {plain.label}")
    if size <= 1 or gpus % size:
        raise ValueError(f"--hpz {size}: must be more than 1 and divide --gpus {gpus}")
    row = copy.deepcopy(plain)
    row.hpz = size
    row.label = f"{plain.label} + hpZ {size}"
    row.states["params"]["device"] += p * params / size
    # Without qgZ (`quantized_row` adds it after hpZ) the total does not depend on the nodes.
    row.comm_bytes = stage3_bytes(row, params, gpus, gpus, p)[0]
    return row


def quantized_row(plain, params: float, gpus: int, per_node: int, p: int, qwz: bool,
                  qgz: bool):
    """The stage-3 row `plain` (hpZ or not) with ZeRO++ qwZ and/or qgZ."""
    if plain.stage != 3:
        raise ValueError(f"qwZ / qgZ apply to stage 3, not {plain.label}")
    row = copy.deepcopy(plain)
    row.qwz, row.qgz = qwz, qgz
    if qwz and row.hpz > 1:  # hpZ keeps the forward's packed int8 rows, not weights of p bytes
        row.states["params"]["device"] -= (p - QWZ_BYTES) * params / row.hpz
    row.label = plain.label + "".join(f" + {name}" for name, on in (("qwZ", qwz), ("qgZ", qgz))
                                      if on)
    row.comm_bytes = stage3_bytes(row, params, gpus, per_node, p)[0]
    return row


def hpz_advice(row, est, p: int, inter_node_gbps: float | None, judge):
    """Whether `plan` adds hpZ to its stage-3 choice `row`: `(verdict for the hpZ row or None,
    lines explaining it)`; `judge(row)` checks a row against the memory budgets."""
    if inter_node_gbps is None or row.stage != 3 or row.offload_param != "none":
        return None, []
    gpus, per_node = est.gpus, est.gpus_per_node
    if est.nodes < 2:
        return None, [f"  hpZ not needed: the {gpus} GPUs are on one node"]
    if gpus % per_node:
        return None, [f"  hpZ not considered: {gpus} GPUs do not fill nodes of {per_node}"]
    with_hpz = hpz_row(row, est.params, gpus, p, per_node)
    plain_node = inter_node_bytes(row, est.params, gpus, per_node, p) * per_node
    hpz_node = inter_node_bytes(with_hpz, est.params, gpus, per_node, p) * per_node
    seconds = 8 / (inter_node_gbps * 1e9)
    numbers = (f"inter-node bytes per step and node {plain_node / 1e9:.3g} GB "
               f"({plain_node * seconds:.3g} s at {inter_node_gbps:g} Gbit/s) without hpZ, "
               f"{hpz_node / 1e9:.3g} GB ({hpz_node * seconds:.3g} s) with it")
    per_gpu = inter_node_gbps / per_node
    if per_gpu >= HPZ_BELOW_GBPS_PER_GPU:
        return None, [f"  hpZ not needed: {per_gpu:.3g} Gbit/s of inter-node bandwidth per GPU "
                      f"is not below {HPZ_BELOW_GBPS_PER_GPU:g} ({numbers})"]
    verdict = judge(with_hpz)
    base = with_hpz if verdict.fits else row
    quantized = quantized_row(base, est.params, gpus, per_node, p, True, True)
    lossy = inter_node_bytes(quantized, est.params, gpus, per_node, p) * per_node
    more = (f"  not chosen, as they round weights and gradients to int8 (README: ZeRO++ "
            f"accuracy): adding qwZ + qgZ (zero_quantized_weights, zero_quantized_gradients) "
            f"would cut that to {lossy / 1e9:.3g} GB ({lossy * seconds:.3g} s) per step and node")
    if not verdict.fits:
        return None, [f"  hpZ would help ({numbers}) but its secondary shards do not fit: "
                      f"{'; '.join(verdict.reasons)}", more]
    return verdict, [
        f"  with hpZ (zero_hpz_partition_size={per_node}): the inter-node link is slow "
        f"({per_gpu:.3g} Gbit/s per GPU, below {HPZ_BELOW_GBPS_PER_GPU:g}), so backward "
        f"all-gathers stay inside each node: {numbers}; it costs "
        f"{p * est.params / per_node / 1e9:.3g} GB more per GPU (secondary parameter shards)",
        more]
