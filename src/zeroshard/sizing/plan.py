"""`zeroshard plan`: the least-communication configuration that fits the hardware, and why.

Candidates, cheapest first: plain data parallelism and stages 1 and 2 move 2 Psi per step, so
the lowest of them that fits wins; then stage 2 with the optimizer on the CPU (adds a CPU step
and (g + p) Psi / N of PCIe traffic), stage 3 (3 Psi), stage 3 with the optimizer on the CPU,
with parameters on the CPU too, then optimizer and parameters on NVMe. Within each class of
equal communication, every candidate is tried without activation checkpointing before any is
tried with it (it costs recomputation, not communication).

A candidate fits when, per GPU, model states + communication buckets + gathered stage-3 units +
activations stay within the GPU memory less a reserve (allocator fragmentation, CUDA context);
per node, the CPU-offloaded bytes stay within CPU memory less the same reserve; and the NVMe
swap files fit the NVMe free space.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .estimate import GB, Estimate, Row, Shape, bytes_per_param, estimate, parse_count
from .hierarchy import hpz_advice

#: (stage, offload_optimizer, offload_param), in classes of equal communication, cheapest first.
CLASSES = [
    [(0, "none", "none"), (1, "none", "none"), (2, "none", "none")],  # 2 Psi per step
    [(2, "cpu", "none")],  # 2 Psi + PCIe traffic and a CPU optimizer step
    [(3, "none", "none")],  # 3 Psi
    [(3, "cpu", "none")], [(3, "cpu", "cpu")], [(3, "nvme", "cpu")], [(3, "nvme", "nvme")]]


@dataclass
class Verdict:
    """One candidate, whether it fits, and the numbers behind that."""

    row: Row
    checkpointing: bool
    device_bytes: float
    cpu_node_bytes: float
    nvme_node_bytes: float
    reasons: list[str]

    @property
    def fits(self) -> bool:
        """Whether every budget holds."""
        return not self.reasons

    def describe(self) -> str:
        """`stage 2 + opt cpu (with activation checkpointing)`."""
        return self.row.label + (" with activation checkpointing" if self.checkpointing else "")


@dataclass
class Plan:
    """The recommendation and every cheaper candidate that was turned down."""

    choice: Verdict | None
    rejected: list[Verdict]
    config: dict | None
    estimate: Estimate
    notes: list[str] | None = None
    """Lines on what was added to the choice (hpZ on a slow inter-node link) and why."""

    def report(self) -> str:
        """What `zeroshard plan` prints."""
        gpus = self.estimate.gpus
        lines = [f"zeroshard plan: {self.estimate.params:,.0f} parameters on {gpus} "
                 f"GPU{'s' if gpus > 1 else ''}, precision {self.estimate.precision} "
                 "(GB = 10^9 bytes)"]
        if self.rejected and "activations" not in self.rejected[0].row.buffers or \
                self.choice and "activations" not in self.choice.row.buffers:
            lines.append("  (activations are not counted: give --hidden --layers --seq, or "
                         "--model, to include them and consider activation checkpointing)")
        for verdict in self.rejected:
            lines.append(f"  no:  {verdict.describe()}: {'; '.join(verdict.reasons)}")
        if self.choice is None:
            lines.append("nothing fits: even stage 3 with optimizer and parameters on NVMe and "
                         "activation checkpointing exceeds the budgets above. Add GPUs or "
                         "memory, lower the micro batch or sequence length, or free NVMe space.")
            return "\n".join(lines)
        c = self.choice
        lines.append(f"  yes: {c.describe()}: {c.device_bytes / GB:.3g} GB per GPU, "
                     f"{c.cpu_node_bytes / GB:.3g} GB CPU per node, "
                     f"{c.nvme_node_bytes / GB:.3g} GB NVMe per node")
        lines.extend(self.notes or [])
        if c.checkpointing:
            lines.append("  enable activation checkpointing in your model (e.g. "
                         "model.gradient_checkpointing_enable(), or torch.utils.checkpoint per "
                         "block); it is not a config key")
        return "\n".join(lines)


def _bucket(shape: Shape, params: float) -> int:
    """DeepSpeed's "auto" rule (h^2) when the width is known, else 1/8 of the model (<= 5e8)."""
    if shape.hidden:
        return int(shape.hidden ** 2)
    return int(min(5e8, max(params / 8, 1 << 20)))


def _judge(row: Row, est: Estimate, checkpointing: bool, gpu_mem: float, cpu_mem: float | None,
           nvme_free: float | None, reserve: float) -> Verdict:
    acts = row.buffers.get("activations (AC)" if checkpointing else "activations", 0.0)
    device = row.on("device") + row.buffers.get("comm buckets", 0.0) + \
        row.buffers.get("gathered units", 0.0) + acts
    cpu = row.on("cpu") * est.gpus_per_node
    nvme = row.on("nvme") * est.gpus_per_node
    reasons = []
    budget = gpu_mem * (1 - reserve)
    if device > budget:
        reasons.append(f"needs {device / GB:.3g} GB per GPU (model states "
                       f"{row.on('device') / GB:.3g}, buffers and activations "
                       f"{(device - row.on('device')) / GB:.3g}), budget {budget / GB:.3g}")
    if cpu > 0 and cpu_mem is not None and cpu > cpu_mem * (1 - reserve):
        reasons.append(f"needs {cpu / GB:.3g} GB of CPU memory per node, budget "
                       f"{cpu_mem * (1 - reserve) / GB:.3g}")
    if nvme > 0 and nvme_free is None:
        reasons.append("needs NVMe space; give --nvme-free")
    elif nvme > 0 and nvme > nvme_free:
        reasons.append(f"needs {nvme / GB:.3g} GB of NVMe per node, {nvme_free / GB:.3g} free")
    return Verdict(row, checkpointing, device, cpu, nvme, reasons)


def plan(params, gpu_mem: float, gpus: int = 1, gpus_per_node: int | None = None,
         cpu_mem: float | None = None, nvme_free: float | None = None, precision: str = "bf16",
         optimizer: str = "adam", shape: Shape | None = None, reserve: float = 0.1,
         nvme_path: str = "/local_nvme", inter_node_gbps: float | None = None) -> Plan:
    """Try the candidates cheapest first; return the first that fits with its DeepSpeed config.

    With `inter_node_gbps` (a node's inter-node bandwidth) a stage-3 choice on several nodes gets
    hpZ when that link is slow and the secondary shards fit (`hierarchy.py`)."""
    if gpu_mem <= 0:
        raise ValueError(f"--gpu-mem {gpu_mem}: must be positive")
    if not 0 <= reserve < 1:
        raise ValueError(f"--reserve {reserve}: a fraction in [0, 1)")
    shape = shape or Shape()
    bucket = _bucket(shape, parse_count(params))
    rejected = []
    est = None
    for candidates in CLASSES:
        for checkpointing in (False, True):
            for stage, opt, par in candidates:
                est = estimate(params, gpus, gpus_per_node, precision, optimizer, opt, par, shape,
                               bucket)
                row = est.row(stage, opt, par)
                if precision == "bf16-master" and (stage == 0 or opt == "nvme"):
                    continue  # bf16 masters: stages 1-3, on the device or in CPU memory
                if checkpointing and "activations (AC)" not in row.buffers:
                    continue  # activations not modelled (no shape): AC changes nothing
                verdict = _judge(row, est, checkpointing, gpu_mem, cpu_mem, nvme_free, reserve)
                if verdict.fits:
                    p = bytes_per_param(precision, optimizer)[0]
                    better, notes = hpz_advice(
                        row, est, p, inter_node_gbps, lambda r, c=checkpointing: _judge(
                            r, est, c, gpu_mem, cpu_mem, nvme_free, reserve))
                    verdict = better or verdict
                    return Plan(verdict, rejected, _config(verdict, est, shape, nvme_path), est,
                                notes)
                rejected.append(verdict)
    return Plan(None, rejected, None, est)


def _config(verdict: Verdict, est: Estimate, shape: Shape, nvme_path: str) -> dict:
    """The DeepSpeed-format config of a chosen candidate."""
    row = verdict.row
    zero: dict = {"stage": row.stage, "overlap_comm": True, "contiguous_gradients": True}
    bucket = _bucket(shape, est.params)
    if row.stage >= 1:
        zero["reduce_bucket_size"] = bucket
        zero["allgather_bucket_size"] = bucket
    if row.stage == 3:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * bucket)
        zero["stage3_param_persistence_threshold"] = int(10 * shape.hidden) if shape.hidden else 100_000
        zero["stage3_max_live_parameters"] = int(2 * (shape.largest_unit or bucket))
        zero["stage3_max_reuse_distance"] = int(shape.largest_unit or bucket)
        if row.hpz > 1:
            zero["zero_hpz_partition_size"] = row.hpz
    for key, where in (("offload_optimizer", row.offload_optimizer),
                       ("offload_param", row.offload_param)):
        if where == "cpu":
            zero[key] = {"device": "cpu", "pin_memory": True}
        elif where == "nvme":
            zero[key] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
            if key == "offload_optimizer":
                zero[key].update(pipeline_read=True, pipeline_write=True)
    config = {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": zero}
    if est.precision in ("bf16", "mixed"):
        config["bf16"] = {"enabled": True}
    elif est.precision == "bf16-master":
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True,
                          "bf16_optimizer_states": True}
    elif est.precision == "fp16":
        config["fp16"] = {"enabled": True}
    return config


def write_config(config: dict, path: str) -> None:
    """Write the recommended config as JSON."""
    with open(path, "w") as fh:
        json.dump(config, fh, indent=2)
        fh.write("\n")
