"""Memory and communication estimates: the ZeRO paper's formulas, exact on model states, with the
modelled parts (communication buffers, gathered stage-3 units, activations) reported apart.

Model states per rank, for Psi parameters on N data-parallel ranks, with p / g bytes per
parameter and gradient and K bytes of optimizer state (fp32 master + moments) per parameter:
    stage 0 (plain DP)  (p + g + K) Psi                 16 Psi for mixed-precision Adam (K = 12)
    stage 1             (p + g) Psi + K Psi / N          4 Psi + 12 Psi / N
    stage 2             p Psi + (g + K) Psi / N          2 Psi + 14 Psi / N
    stage 3             (p + g + K) Psi / N              16 Psi / N
Mixed precision (fp16/bf16): p = g = 2 and K = 4 (fp32 master) + the optimizer's state (8 for
Adam). Pure fp32: p = g = 4 and K = the state alone, because the master *is* the parameter; with
optimizer or parameter offload the two live apart, so K = 4 + state again. `bf16-master` is bf16
with DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states: master and state in bf16,
K = 2 + 4 = 6 with Adam (stages 1-3; the baseline DP row keeps fp32 masters, as the engine does).
`offload_optimizer` moves the K part to CPU memory or NVMe (and at stages 2-3 the gradient
shards to CPU memory, where the step reads them); `offload_param` (stage 3) the p part.
`bf16` and `fp16` count what zeroshard holds: at stages 2-3 its gradient shards are fp32 (g = 4
there; core/reduction.py); `mixed` keeps the paper's g = 2 (Table 1). These are exactly the bytes
zeroshard's memory ledger counts, up to the per-unit padding.

Communication per rank per optimizer step (ring, bytes of the compute dtype): 2 Psi (N-1)/N at
stages 0-2 (reduce-scatter or all-reduce, then all-gather), 3 Psi (N-1)/N at stage 3 (gather in
forward and again in backward, reduce-scatter). Under optimizer offload each rank also moves its
gradient shard to the CPU and the updated parameter shard back: (g + p) Psi / N (the ZeRO-Offload
paper's 4 Psi in fp16 for one GPU).
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field

from .hierarchy import inter_node_bytes

GB = 1e9
PLACES = ("device", "cpu", "nvme")
#: Bytes of optimizer state per parameter (fp32 moments), by optimizer name.
STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4, "adagrad": 4, "rmsprop": 4,
               "lion": 4}
#: (parameter bytes, gradient bytes, master bytes) per precision.
PRECISIONS = {"mixed": (2, 2, 4), "bf16": (2, 2, 4), "fp16": (2, 2, 4), "fp32": (4, 4, 0),
              "bf16-master": (2, 2, 2)}
#: Bytes per element of the optimizer state where it is not fp32 (STATE_BYTES counts fp32).
STATE_WIDTH = {"bf16-master": 2}
OFFLOADS = ("none", "cpu", "nvme")


def parse_count(text) -> float:
    """`7.5e9`, `7B`, `1.3b`, `350M`, `1T` or a number -> a positive parameter count."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*", str(text), re.I)
        if not match:
            raise ValueError(f"--params {text!r}: give a count such as 7.5e9, 7B, 1.3B or 350M")
        scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
        value = float(match.group(1)) * scale
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"--params {text}: the parameter count must be a positive number")
    return value


@dataclass
class Shape:
    """What the modelled columns need to know about the model (all optional)."""

    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    seq: int | None = None
    micro_batch: int = 1
    vocab: int | None = None
    largest_unit: float | None = None
    """Parameters of the largest stage-3 unit (a transformer block); default 12 h^2."""


@dataclass
class Row:
    """One configuration's bytes per rank (model states exact; buffers modelled)."""

    label: str
    stage: int
    offload_optimizer: str
    offload_param: str
    states: dict[str, dict[str, float]]
    """kind (params/grads/optimizer) -> placement (device/cpu/nvme) -> bytes per rank."""
    comm_bytes: float
    """Bytes this rank sends per optimizer step (ring model)."""
    offload_traffic: float
    """CPU <-> device bytes per rank per step under optimizer offload."""
    buffers: dict[str, float] = field(default_factory=dict)
    """Modelled device bytes: comm buckets, gathered units, activations (with / without AC)."""
    hpz: int = 1
    """Stage 3 with ZeRO++ hpZ secondary shards in groups of this many GPUs (`hierarchy.py`)."""
    qwz: bool = False
    """Stage 3 with ZeRO++ qwZ: int8 weight all-gathers (`hierarchy.py`)."""
    qgz: bool = False
    """Stage 3 with ZeRO++ qgZ: gradients reduced in the node, int8 across nodes."""

    def on(self, place: str) -> float:
        """Model-state bytes per rank at `place`."""
        return sum(kind[place] for kind in self.states.values())

    def kind(self, kind: str) -> float:
        """Bytes per rank of one kind (params/grads/optimizer), wherever they are."""
        return sum(self.states[kind].values())


@dataclass
class Estimate:
    """Every row for one model and cluster."""

    params: float
    gpus: int
    gpus_per_node: int
    precision: str
    optimizer: str
    rows: list[Row]

    @property
    def nodes(self) -> int:
        """Nodes the GPUs span."""
        return -(-self.gpus // self.gpus_per_node)

    def row(self, stage: int, offload_optimizer: str = "none", offload_param: str = "none",
            hpz: int = 1) -> Row:
        """The row of one configuration."""
        for row in self.rows:
            if (row.stage, row.offload_optimizer, row.offload_param, row.hpz) == \
                    (stage, offload_optimizer, offload_param, hpz):
                return row
        raise KeyError((stage, offload_optimizer, offload_param, hpz))

    def table(self, with_buffers: bool = False) -> str:
        """The human-readable table `zeroshard estimate` prints."""
        return format_table(self, with_buffers)


def bytes_per_param(precision: str, optimizer: str, offloaded: bool = False) -> tuple[int, int, int]:
    """(p, g, K) for a precision and optimizer; K includes a separate fp32 master if there is one."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    if optimizer not in STATE_BYTES:
        raise ValueError(f"--optimizer {optimizer!r}: choose from {', '.join(STATE_BYTES)}")
    p, g, master = PRECISIONS[precision]
    if offloaded and master == 0:
        master = 4  # the device keeps its fp32 parameters; the offloaded master is a copy
    return p, g, master + STATE_BYTES[optimizer] * STATE_WIDTH.get(precision, 4) // 4


def model_states(params: float, world: int, stage: int, precision: str = "mixed",
                 optimizer: str = "adam", offload_optimizer: str = "none",
                 offload_param: str = "none") -> dict[str, dict[str, float]]:
    """Bytes per rank of parameters, gradients and optimizer state, by placement."""
    if world < 1:
        raise ValueError(f"--gpus {world}: need at least one GPU (data-parallel rank)")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage {stage}: ZeRO stages are 0-3")
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value not in OFFLOADS:
            raise ValueError(f"{name} {value!r}: choose from {', '.join(OFFLOADS)}")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage 1-3")
    if offload_param != "none" and stage != 3:
        raise ValueError("parameter offload needs ZeRO stage 3")
    if precision == "bf16-master" and stage == 0:
        precision = "bf16"  # bf16 masters need a sharded optimizer (stages 1-3)
    # In fp32 the master is the parameter only while both live on the device.
    p, g, k = bytes_per_param(precision, optimizer,
                              offload_optimizer != "none" or offload_param != "none")
    if stage >= 2 and precision in ("bf16", "fp16"):
        g = 4  # zeroshard keeps gradient shards (micro-steps accumulate there) in fp32
    share = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    per_kind = {"params": p, "grads": g, "optimizer": k}
    where = {"params": "device" if offload_param == "none" else offload_param,
             # Sharded gradients live where the optimizer steps (CPU memory for cpu and nvme).
             "grads": "cpu" if offload_optimizer != "none" and stage >= 2 else "device",
             "optimizer": "device" if offload_optimizer == "none" else offload_optimizer}
    out = {}
    for kind, nbytes in per_kind.items():
        total = nbytes * params / (world if share[kind] else 1)
        out[kind] = {place: (total if where[kind] == place else 0.0) for place in PLACES}
    return out


def _buffers(params: float, stage: int, precision: str, shape: Shape, bucket: float,
             live_units: int) -> dict[str, float]:
    """Modelled device bytes besides model states."""
    p, g, _ = PRECISIONS[precision]
    out = {}
    # Stages 2-3: one unit-sized gradient buffer filling while another is reduce-scattered.
    unit = min(bucket, max(params / 8, 1 << 20))
    out["comm buckets"] = 2 * unit * g if stage >= 2 else 0.0
    if stage == 3:
        largest = shape.largest_unit or (12 * shape.hidden ** 2 if shape.hidden else unit)
        out["gathered units"] = min(params, largest * live_units) * p
    else:
        out["gathered units"] = 0.0
    if shape.hidden and shape.layers and shape.seq:
        heads = shape.heads or max(1, shape.hidden // 64)
        s, b, h = shape.seq, shape.micro_batch, shape.hidden
        width = p / 2  # the formulas count 16-bit activations
        layer = s * b * h * (34 + 5 * heads * s / h) * width
        logits = 4 * s * b * shape.vocab if shape.vocab else 0.0  # fp32 logits for the loss
        out["activations"] = shape.layers * layer + logits
        # Full activation checkpointing: each layer's input kept, one layer recomputed at a time.
        out["activations (AC)"] = shape.layers * 2 * s * b * h * width + layer + logits
    return out


def estimate(params, gpus: int = 1, gpus_per_node: int | None = None, precision: str = "mixed",
             optimizer: str = "adam", offload_optimizer: str = "none", offload_param: str = "none",
             shape: Shape | None = None, bucket: float = 5e8, live_units: int = 2) -> Estimate:
    """Estimates for baseline DP and stages 1-3, plus the offload rows asked for."""
    psi = parse_count(params)
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus {gpus}: need at least one GPU")
    per_node = gpus_per_node or min(gpus, 8)
    if per_node < 1:
        raise ValueError(f"--gpus-per-node {per_node}: need at least one")
    shape = shape or Shape()
    p, g, _ = bytes_per_param(precision, optimizer)
    configs = [(s, "none", "none") for s in range(4)]
    if offload_optimizer != "none" or offload_param != "none":
        if offload_optimizer != "none":
            configs += [(s, offload_optimizer, "none") for s in (1, 2, 3)]
        configs.append((3, offload_optimizer, offload_param))
    rows, seen = [], set()
    for stage, opt, par in configs:
        if (stage, opt, par) in seen:
            continue
        seen.add((stage, opt, par))
        states = model_states(psi, gpus, stage, precision, optimizer, opt, par)
        ring = (gpus - 1) / gpus
        comm = (3 if stage == 3 else 2) * psi * p * ring
        traffic = (g + p) * psi / gpus if opt != "none" else 0.0
        label = "baseline DP" if stage == 0 else f"stage {stage}"
        extras = [f"opt {opt}" if opt != "none" else "", f"param {par}" if par != "none" else ""]
        label += "".join(f" + {e}" for e in extras if e)
        rows.append(Row(label, stage, opt, par, states, comm, traffic,
                        _buffers(psi, stage, precision, shape, bucket, live_units)))
    return Estimate(psi, gpus, per_node, precision, optimizer, rows)


def model_from_spec(spec: str):
    """Build `module:factory` on the meta device (no memory); returns the model."""
    import importlib

    import torch

    if ":" not in spec:
        raise ValueError(f"--model {spec!r}: give module:factory, e.g. mypkg.models:build_gpt")
    module_name, _, attr = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a module beside the user's files
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {spec!r}: cannot import module {module_name!r} ({err})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: module {module_name!r} has no callable {attr!r}")
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec!r}: {attr}() returned {type(model).__name__}, "
                         "not a torch.nn.Module")
    return model


def describe_model(model) -> tuple[int, Shape]:
    """Trainable parameter count (tied weights once) and the shape the modelled columns use."""
    from ..core.partition import unit_modules

    params = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    units = unit_modules(model)
    largest = max((sum(p.numel() for p in m.parameters()) for _, m in units), default=None)
    config = getattr(model, "config", None)
    pick = lambda *names: next((getattr(config, n) for n in names  # noqa: E731
                                if isinstance(getattr(config, n, None), int)), None)
    shape = Shape(hidden=pick("hidden_size", "n_embd", "d_model"),
                  layers=pick("num_hidden_layers", "n_layer") or (len(units) or None),
                  heads=pick("num_attention_heads", "n_head"), vocab=pick("vocab_size"),
                  largest_unit=largest)
    return sum(params.values()), shape


def _gb(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value / GB:.3g}" if value / GB < 100 else f"{value / GB:,.0f}"


def format_table(est: Estimate, with_buffers: bool = False) -> str:
    """A markdown-style table: GB (10^9 bytes) per GPU, plus CPU and NVMe per node."""
    kinds = ("params", "grads", "optimizer")
    extra = sorted({k for r in est.rows for k in r.buffers}) if with_buffers else []
    head = (["configuration", "params", "grads", "optim", "model states / GPU"]
            + [f"{k} (modelled)" for k in extra]
            + ["CPU / node", "NVMe / node", "comm / step / GPU", "CPU<->GPU / step / GPU"]
            + (["inter-node / step / GPU"] if est.nodes > 1 else []))
    lines = [
        f"zeroshard estimate: {est.params:,.0f} parameters, {est.gpus} GPUs "
        f"({est.gpus_per_node} per node, {est.nodes} node{'s' if est.nodes > 1 else ''}), precision {est.precision}, "
        f"optimizer {est.optimizer}",
        "GB = 10^9 bytes, per GPU (data-parallel rank) unless marked per node. Model-state "
        "columns are exact (up to a few bytes of padding per unit); '(modelled)' columns are "
        "estimates.",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in est.rows:
        cells = [row.label] + [_gb(row.states[k]["device"]) for k in kinds] + [_gb(row.on("device"))]
        cells += [_gb(row.buffers.get(k, 0.0)) for k in extra]
        cells += [_gb(row.on("cpu") * est.gpus_per_node), _gb(row.on("nvme") * est.gpus_per_node),
                  _gb(row.comm_bytes), _gb(row.offload_traffic)]
        if est.nodes > 1:
            p = bytes_per_param(est.precision, est.optimizer)[0]
            cells.append(_gb(inter_node_bytes(row, est.params, est.gpus, est.gpus_per_node, p)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
