"""`zeroshard demo`: train one small GPT at several ZeRO stages; print the memory each one measured.

The launcher half (`cli_main`) starts the ranks through the same torchrun front door as
`zeroshard run` (module mode: `-m zeroshard.cli.demo --worker ...`). The worker half (`worker_main`)
trains a character-level decoder-only transformer on Python standard-library source that ships
with the interpreter (no download), once per variant in `VARIANTS`, with the same seed, initial
weights and data order each time, and rank 0 prints one table: final loss, median step time, and
the bytes of parameters / gradients / optimizer state this rank holds according to
`engine.memory_report()`, then the bytes one step moved according to `engine.comm_report()`,
split into intra-host and inter-host (torchrun's node layout). torchrun options the demo does not
know (`--nnodes`, `--rdzv-*`, ...) go to `zeroshard run`, so the demo also runs across machines.
Because every variant does the same arithmetic, their losses must agree; the last line checks it.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .launch import UsageError, build_run_parser, run_command

# One entry per row of the table: label -> the `zero_optimization` section that selects it.
# Adding a variant (offload, ...) is one line here.
VARIANTS: dict[str, dict] = {
    "0": {"stage": 0},
    "1": {"stage": 1},
    "2": {"stage": 2},
    # Every parameter sharded (the default threshold, 1e5 elements, would keep this small model's
    # parameters whole); nothing kept gathered between uses, so the table shows 1/N parameters.
    "3": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
    # ZeRO-Offload: fp32 masters and Adam state in CPU memory, stepped there.
    "2+cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    # ZeRO-Infinity: parameter shards, masters and Adam state in swap files (a temporary directory).
    "3+nvme": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
               "offload_optimizer": {"device": "nvme", "nvme_path": "", "pipeline_read": True,
                                     "pipeline_write": True},
               "offload_param": {"device": "nvme", "nvme_path": ""}},
}
DEFAULT_STAGES = "0,1,2,3,2+cpu,3+nvme"
DEFAULT_STEPS = 30
LOSS_TOLERANCE = 1e-5  # fp32: every variant does the same arithmetic up to summation order
CORPUS_CHARS = 200_000
MB = 1e6

# Read in this order; any that are missing are replaced by the rest of the stdlib, sorted by name.
_CORPUS_FILES = (
    "textwrap.py", "argparse.py", "difflib.py", "heapq.py", "fractions.py", "statistics.py",
    "calendar.py", "string.py", "bisect.py", "functools.py", "dataclasses.py", "enum.py",
    "shlex.py", "fnmatch.py", "queue.py", "contextlib.py", "inspect.py",
)


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of the demo model (about 1.3 M parameters)."""

    vocab_size: int = 128
    """ASCII; other characters are mapped to '?'."""
    block_size: int = 64
    """Context length in characters."""
    d_model: int = 160
    """Width of the residual stream."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only earlier positions."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the sequence causally; shape (B, T, C) in and out."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to a (B, T, C) residual stream."""
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Decoder-only transformer language model: token + position embedding, blocks, untied head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, T, vocab) for token ids of shape (B, T)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def load_corpus(n_chars: int = CORPUS_CHARS) -> str:
    """The first `n_chars` of a fixed sequence of standard-library source files (no download)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = list(_CORPUS_FILES)
    if stdlib.is_dir():
        names += sorted(p.name for p in stdlib.glob("*.py") if p.name not in _CORPUS_FILES)
    parts, total = [], 0
    for name in names:
        try:
            text = (stdlib / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= n_chars:
            break
    if total < n_chars:  # an interpreter without .py sources: docstrings are always there
        import builtins

        for name in sorted(dir(builtins)):
            doc = getattr(getattr(builtins, name), "__doc__", None) or ""
            parts.append(doc + "\n")
    text = "".join(parts)
    while len(text) < n_chars:
        text += text
    return text[:n_chars]


def encode(text: str) -> torch.Tensor:
    """Character ids (ASCII codes, '?' for anything else) as a 1-D int64 tensor."""
    raw = text.encode("ascii", errors="replace")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def batch_for_step(data: torch.Tensor, step: int, rank: int, world: int, micro: int,
                   block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of `step`: identical for every variant."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - block - 1, (world * micro,), generator=gen)
    mine = starts[rank * micro:(rank + 1) * micro]
    x = torch.stack([data[s:s + block] for s in mine.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block] for s in mine.tolist()])
    return x, y


def ds_config(zero_section: dict, micro_batch: int, lr: float) -> dict:
    """The DeepSpeed-format config the demo passes to `zeroshard.initialize`."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,  # the demo draws its own progress line
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "zero_optimization": {"reduce_bucket_size": 5e5, **zero_section},
    }


@dataclass
class VariantResult:
    """What one variant measured: loss curve, step times and bytes per rank by kind."""

    name: str
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    on_device: int = 0
    estimate: dict[str, float] = field(default_factory=dict)
    """`zeroshard.estimate.model_states` for the same configuration, bytes per kind."""
    comm: dict[str, int] = field(default_factory=dict)
    """Bytes this rank moved in the last step: "total", "intra_host", "inter_host"."""
    hosts: tuple[int, int] = (1, 1)
    """(hosts, ranks per host), from the node layout the comm ledger uses."""
    tokens_per_step: int = 0
    """Tokens one optimizer step trains on, over all ranks."""

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state, in bytes, wherever they are."""
        return sum(self.memory.get(k, 0) for k in ("params", "grads", "optimizer"))


def _held_bytes(report: dict) -> dict[str, int]:
    """Bytes per kind, summed over placements (device / cpu / nvme)."""
    return {kind: int(sum(by_place.values())) for kind, by_place in report.items()
            if isinstance(by_place, dict)}


def _device_bytes(report: dict) -> int:
    """Model-state bytes on the compute device (what offload moves away)."""
    return sum(report[k]["device"] for k in ("params", "grads", "optimizer"))


def train_variant(name: str, args: argparse.Namespace, data: torch.Tensor,
                  progress) -> VariantResult:
    """Train a fresh model under one variant and return what it measured."""
    import torch.distributed as dist

    import zeroshard

    from ..sizing.estimate import model_states

    torch.manual_seed(args.seed)
    model = TinyGPT(GPTConfig())
    psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    # For the NVMe variant's swap files; removed however the variant ends.
    with tempfile.TemporaryDirectory(prefix="zeroshard-demo-",
                                     ignore_cleanup_errors=True) as swap_dir:
        zero = {k: dict(v, nvme_path=swap_dir) if isinstance(v, dict) and "nvme_path" in v else v
                for k, v in VARIANTS[name].items()}
        cfg = ds_config(zero, args.micro_batch, args.lr)
        engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
        result = VariantResult(name)
        zero = VARIANTS[name]
        expected = model_states(psi, engine.world_size, zero["stage"], "fp32", "adamw",
                                zero.get("offload_optimizer", {}).get("device", "none"),
                                zero.get("offload_param", {}).get("device", "none"))
        result.estimate = {kind: sum(by_place.values()) for kind, by_place in expected.items()}
        block = model.cfg.block_size
        result.tokens_per_step = engine.world_size * args.micro_batch * block
        for step in range(args.steps):
            x, y = batch_for_step(data, step, engine.rank, engine.world_size, args.micro_batch,
                                  block, args.seed)
            x, y = x.to(engine.device), y.to(engine.device)
            comm_before = engine.comm_report()
            start = time.perf_counter()
            logits = engine(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            engine.backward(loss)
            if step == args.steps - 1:  # gradients are at their largest between backward and step
                paused = time.perf_counter()
                report = engine.memory_report()
                after_backward, device_backward = _held_bytes(report), _device_bytes(report)
                start += time.perf_counter() - paused  # not part of the step time
            engine.step()
            if engine.device.type == "cuda":  # kernels run asynchronously: wait for them
                torch.cuda.synchronize(engine.device)
            result.step_ms.append((time.perf_counter() - start) * 1e3)
            comm_after = engine.comm_report()
            result.comm = {k: comm_after[k] - comm_before[k]
                           for k in ("total", "intra_host", "inter_host")}
            mean_loss = loss.detach().float().clone()
            dist.all_reduce(mean_loss)
            result.losses.append(mean_loss.item() / engine.world_size)
            progress(name, step + 1, args.steps, result.losses[-1],
                     statistics.median(result.step_ms), result.tokens_per_step)
        report = engine.memory_report()
        after_step = _held_bytes(report)
        result.memory = {k: max(after_backward.get(k, 0), after_step.get(k, 0))
                         for k in after_backward.keys() | after_step.keys()}
        result.on_device = max(device_backward, _device_bytes(report))
        per_host = engine.comm.layout.ranks_per_host
        result.hosts = (max(1, engine.world_size // per_host), min(per_host, engine.world_size))
        engine.destroy()  # removes the swap files
    del engine, model, logits, loss
    gc.collect()
    dist.barrier()
    return result


class Progress:
    """One updating line per variant on a terminal; one final line per variant otherwise."""

    def __init__(self, enabled: bool, stream=sys.stdout):
        self.enabled = enabled
        self.stream = stream
        self.tty = enabled and stream.isatty()

    def __call__(self, name: str, step: int, steps: int, loss: float, ms: float,
                 tokens_per_step: int = 0) -> None:
        """Report that `step` of `steps` finished with this loss and median step time."""
        if not self.enabled:
            return
        line = f"stage {name:<6} step {step:>4}/{steps:<4} loss {loss:.4f}  {ms:7.1f} ms/step"
        if tokens_per_step and ms > 0:
            line += f"  {tokens_per_step / ms * 1e3:9,.0f} tokens/s"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == steps else ""))
            self.stream.flush()
        elif step == steps:
            print(line, file=self.stream, flush=True)


def format_table(results: list[VariantResult]) -> list[str]:
    """The result table and the loss-agreement line, as printed by rank 0."""
    base = next((r for r in results if r.name == "0"), results[0])
    header = (f"{'stage':<7}{'final loss':>11}{'ms/step':>9}{'params MB':>11}{'grads MB':>10}"
              f"{'optim MB':>10}{'total MB':>10}{'device MB':>11}  device saving vs stage {base.name}")
    lines = [header, "-" * len(header)]
    for r in results:
        ratio = base.on_device / r.on_device if r.on_device else math.inf
        change = r.on_device / base.on_device - 1 if base.on_device else 0.0
        saving = f"{ratio:.2f}x ({change:+.0%})" if r.on_device else "all off the device"
        lines.append(
            f"{r.name:<7}{r.losses[-1]:>11.5f}{statistics.median(r.step_ms):>9.1f}"
            f"{r.memory.get('params', 0) / MB:>11.3f}{r.memory.get('grads', 0) / MB:>10.3f}"
            f"{r.memory.get('optimizer', 0) / MB:>10.3f}{r.model_states / MB:>10.3f}"
            f"{r.on_device / MB:>11.3f}  {saving}")
    lines.append(loss_agreement(results))
    lines.append(estimate_agreement(results))
    return lines


def throughput_table(results: list[VariantResult], n_params: int, world: int,
                     device: torch.device) -> list[str]:
    """Tokens/s over all ranks at the median step time, model TFLOPS per device (6 x parameters
    per token) and MFU where the device's peak is known (zeroshard.monitor.throughput)."""
    from ..monitor.throughput import mfu, model_flops_per_token, peak_flops

    peak = peak_flops(device, None)  # the demo trains in fp32
    per_token = model_flops_per_token(n_params)
    header = f"{'stage':<7}{'tokens/s':>12}{'TFLOPS/device':>15}{'MFU':>8}"
    lines = [header, "-" * len(header)]
    for r in results:
        rate = r.tokens_per_step / statistics.median(r.step_ms) * 1e3
        util = mfu(rate / world, per_token, peak)
        lines.append(f"{r.name:<7}{rate:>12,.0f}{rate / world * per_token / 1e12:>15.4f}"
                     f"{'n/a' if util is None else f'{util:.1%}':>8}")
    lines.append("tokens/s: all ranks, at the median step time; MFU needs the device's peak "
                 "FLOP/s (known GPUs only, n/a on CPU)")
    return lines


def comm_table(results: list[VariantResult]) -> list[str]:
    """Bytes one step moved per rank, intra-host and inter-host, as printed by rank 0."""
    hosts, per_host = results[0].hosts
    lines = [f"communication per step and rank (engine.comm_report(), ring model; {hosts} "
             f"host{'s' if hosts > 1 else ''} x {per_host} rank{'s' if per_host > 1 else ''}):",
             f"{'stage':<7}{'total MB':>10}{'intra-host MB':>15}{'inter-host MB':>15}"]
    for r in results:
        lines.append(f"{r.name:<7}{r.comm.get('total', 0) / MB:>10.3f}"
                     f"{r.comm.get('intra_host', 0) / MB:>15.3f}"
                     f"{r.comm.get('inter_host', 0) / MB:>15.3f}")
    return lines


def estimate_agreement(results: list[VariantResult]) -> str:
    """One line: the largest difference between measured and estimated model-state bytes."""
    diffs = [(abs(r.memory.get(k, 0) - r.estimate[k]), r.name, k)
             for r in results for k in r.estimate]
    worst, name, kind = max(diffs)
    return (f"estimate (zeroshard estimate's formulas) vs measured: largest difference "
            f"{worst:,.0f} bytes ({kind} of {name}; padding of flat buffers and 4 KiB swap "
            "files)")


def loss_agreement(results: list[VariantResult]) -> str:
    """One line saying whether the final losses of all variants agree within LOSS_TOLERANCE."""
    if len(results) < 2:
        return "losses: only one stage ran, nothing to compare"
    finals = [r.losses[-1] for r in results]
    diff = max(finals) - min(finals)
    verdict = "agree" if diff <= LOSS_TOLERANCE else "DISAGREE"
    return (f"losses {verdict} across stages: max |difference| of final losses = {diff:.2e} "
            f"(tolerance {LOSS_TOLERANCE:.0e}, fp32)")


def save_plot(results: list[VariantResult], path: str) -> None:
    """Loss curves and memory per variant, side by side, written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        ax_loss.plot(range(1, len(r.losses) + 1), r.losses, label=f"stage {r.name}")
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss (curves overlap)")
    ax_loss.legend()
    positions = range(len(results))
    colors = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}
    for offset, source, hatch in ((-0.2, "measured", None), (0.2, "estimate", "//")):
        bottom = [0.0] * len(results)
        for kind in ("params", "grads", "optimizer"):
            values = [(r.memory.get(kind, 0) if source == "measured" else r.estimate.get(kind, 0))
                      / MB for r in results]
            ax_mem.bar([p + offset for p in positions], values, width=0.4, bottom=bottom,
                       color=colors[kind], hatch=hatch, edgecolor="white",
                       label=f"{kind} ({source})")
            bottom = [b + v for b, v in zip(bottom, values)]
    ax_mem.set_xticks(list(positions), [r.name for r in results])
    ax_mem.set(xlabel="variant (left: measured, right: estimate)", ylabel="MB per rank",
               title="model states per rank (all placements)")
    ax_mem.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard demo",
        description="Train a small GPT-style character model at several ZeRO stages on N ranks "
                    "and print the memory per rank each stage measured.",
        epilog="Other options are zeroshard run's (torchrun's), e.g. --nnodes 2 --rdzv-backend "
               "c10d --rdzv-endpoint HOST:PORT on each of two machines.")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"training steps per stage (default {DEFAULT_STEPS})")
    parser.add_argument("--stages", default=DEFAULT_STAGES,
                        help=f"comma-separated stages to run, from {', '.join(VARIANTS)} "
                             f"(default {DEFAULT_STAGES})")
    parser.add_argument("--nproc", type=int, default=None,
                        help="number of ranks (default: all CUDA GPUs, else 2 CPU processes)")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="also save loss curves and memory bars to PATH (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=1234, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, default=3e-3, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def _parse_stages(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"unknown stage {', '.join(unknown) or repr(text)}; "
                         f"choose from {', '.join(VARIANTS)}")
    return names


def worker_main(argv: list[str]) -> int:
    """One rank of the demo (started by torchrun); rank 0 prints; returns the exit code."""
    import torch.distributed as dist

    import zeroshard

    args = _parser().parse_args(argv)
    names = _parse_stages(args.stages)
    zeroshard.init_distributed()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        data = encode(load_corpus())
        if rank == 0:
            n_params = sum(p.numel() for p in TinyGPT(GPTConfig()).parameters())
            device = "cuda" if torch.cuda.is_available() else "cpu"
            print(f"zeroshard demo: training a {n_params / 1e6:.2f}M-parameter character-level GPT "
                  f"on Python's own source, {world} ranks ({dist.get_backend()}, {device}), fp32, "
                  f"{args.steps} steps at each ZeRO stage {', '.join(names)}", flush=True)
        progress = Progress(enabled=rank == 0)
        results = [train_variant(name, args, data, progress) for name in names]
        if rank != 0:
            return 0
        print()
        lines = format_table(results)
        print("\n".join(lines))
        print("MB = 10^6 bytes held by one rank, measured by engine.memory_report() "
              "(total = params + grads + optimizer state wherever they are; device = the part "
              "on the compute device, which +cpu / +nvme offload moves to CPU memory / swap "
              "files).", flush=True)
        print("\n" + "\n".join(comm_table(results)), flush=True)
        n_params = sum(p.numel() for p in TinyGPT(GPTConfig()).parameters())
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        print("\n" + "\n".join(throughput_table(results, n_params, world, device)), flush=True)
        if args.plot:
            save_plot(results, args.plot)
            print(f"plot written to {args.plot}")
        return 0 if not any("DISAGREE" in line for line in lines) else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def cli_main(argv: list[str]) -> int:
    """`zeroshard demo`: start the ranks through `zeroshard run` and return the exit code."""
    args, launcher = _parser().parse_known_args(argv)
    # Options the demo does not know must be zeroshard run's (torchrun's): check them here, so a
    # typo is reported as the demo's.
    unknown = build_run_parser().parse_known_args([*launcher, "-m", "zeroshard.cli.demo"])[1]
    if unknown or any(not a.startswith("-") for a in launcher[:1]):
        raise UsageError(f"unrecognized arguments: {' '.join(unknown or launcher)}")
    try:
        names = _parse_stages(args.stages)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.steps < 1:
        raise UsageError("--steps must be at least 1")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install zeroshard[plot])") from None
        args.plot = os.path.abspath(args.plot)
    launch = []
    if args.nproc is not None:
        launch += ["--nproc-per-node", str(args.nproc)]
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    # Share the cores between ranks (torchrun would force 1 thread and print a banner about it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc))))
    worker = ["--worker", "--steps", str(args.steps), "--stages", ",".join(names),
              "--seed", str(args.seed), "--micro-batch", str(args.micro_batch),
              "--lr", str(args.lr)]
    if args.plot:
        worker += ["--plot", args.plot]
    return run_command([*launch, *launcher, "--no_local_rank", "-m", "zeroshard.cli.demo", *worker])


def main(argv: list[str] | None = None) -> int:
    """`python -m zeroshard.cli.demo`: a worker when started with --worker, else the launcher."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        return worker_main(argv)
    try:
        return cli_main(argv)
    except UsageError as err:
        print(f"zeroshard demo: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
