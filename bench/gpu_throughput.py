"""The side-by-side sections of bench/gpu_check.py (run them through it: `--sections generate`).

  throughput  training on one Llama-style model: plain torch vs FSDP2 vs zeroshard stage 3, with
              and without CPU offload (tokens/s, MFU, peak memory, last loss).
  generate    greedy `generate()` of a Hugging Face Llama (transformers, when installed) at batch 1,
              plain torch vs a zeroshard stage-3 engine without an optimizer, paired rounds.
"""

from __future__ import annotations

import os
import statistics
import time

from gpu_check import device, failure, init_world, loss_of

def _llama_classes():
    """The Llama-style model's classes, built on first use (this script imports torch lazily)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Attention(nn.Module):
        """Causal multi-head attention with rotary position embedding."""

        def __init__(self, dim: int, heads: int):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

        def forward(self, x, cos, sin):
            b, t, c = x.shape
            q, k, v = (proj(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
                       for proj in (self.q, self.k, self.v))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, t, c))

    class LlamaBlock(nn.Module):
        """Pre-norm block: RMSNorm, attention, RMSNorm, SwiGLU MLP, residuals."""

        def __init__(self, dim: int, heads: int, ffn: int):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
            self.attn = Attention(dim, heads)
            self.gate = nn.Linear(dim, ffn, bias=False)
            self.up = nn.Linear(dim, ffn, bias=False)
            self.down = nn.Linear(ffn, dim, bias=False)

        def forward(self, x, cos, sin):
            x = x + self.attn(self.norm1(x), cos, sin)
            h = self.norm2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class LlamaLike(nn.Module):
        """Token embedding, blocks, final RMSNorm, untied head (plain torch)."""

        def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int, seq: int):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(LlamaBlock(dim, heads, ffn) for _ in range(layers))
            self.norm = nn.RMSNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
            half = dim // heads // 2
            freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
            angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
            self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
            self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)

        def forward(self, tokens):
            t = tokens.shape[1]
            x = self.embed(tokens)
            # The tables follow the activations (FSDP2's CPU offload leaves buffers on the CPU).
            cos, sin = (table[:t].to(device=x.device, dtype=x.dtype) for table in (self.cos, self.sin))
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.head(self.norm(x))

    return LlamaLike


# Shapes of the throughput model: on the GPU about 220 M parameters; under --cpu a toy that only
# checks the script.
TPUT_SHAPE = {"vocab": 32000, "dim": 1024, "layers": 12, "heads": 16, "ffn": 2816, "seq": 1024}
TPUT_SHAPE_CPU = {"vocab": 256, "dim": 64, "layers": 2, "heads": 4, "ffn": 172, "seq": 64}
TPUT_VARIANTS = ("torch", "fsdp2", "fsdp2+cpu", "zeroshard3", "zeroshard3+cpu")


def _optimizer_step(model, opt, autocast: str | None = None):
    """`step(x, y) -> loss` with a torch optimizer (under bf16 autocast on device `autocast`)."""
    import contextlib

    import torch

    def step(x, y):
        with (torch.autocast(autocast, dtype=torch.bfloat16) if autocast
              else contextlib.nullcontext()):
            loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _tput_build(name: str, shape: dict, micro: int):
    """One variant: a `step(x, y) -> loss` closure and something to release afterwards."""
    import torch

    dev = device()
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = _llama_classes()(**shape)
    if name == "torch":
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=cuda)
        return _optimizer_step(model, opt, autocast=dev.type), (model, opt)
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        options = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float32)}
        if name == "fsdp2+cpu":
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
        else:
            model = model.to(dev)
        for layer in model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        return _optimizer_step(model, opt), (model, opt)
    import zeroshard

    zero: dict = {"stage": 3}
    if name == "zeroshard3+cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
        "bf16": {"enabled": True}, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}})

    def step(x, y):
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss
    return step, (engine,)


def section_throughput(quick: bool) -> dict:
    """Tokens/s, MFU and peak memory of plain torch, FSDP2 and zeroshard stage 3 on one model."""
    import gc

    import torch

    from zeroshard.monitor.throughput import mfu, model_flops_per_token, peak_flops

    dev = device()
    cuda = dev.type == "cuda"
    if os.environ.get("GPU_CHECK_CPU") != "1" and not torch.cuda.is_available():
        return {"skipped": "no CUDA device (run with --cpu to check the script)"}
    init_world()
    shape = TPUT_SHAPE if cuda else TPUT_SHAPE_CPU
    micro = 8 if cuda else 4
    warmup, measured = (1, 3) if quick or not cuda else (3, 10)
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, shape["vocab"], (warmup + measured, micro, shape["seq"] + 1), generator=gen)
    n_params = sum(p.numel() for p in _llama_classes()(**shape).parameters())
    per_token = model_flops_per_token(n_params)
    peak = peak_flops(dev, torch.bfloat16)
    rows = {}
    for name in TPUT_VARIANTS:
        step = held = loss = None
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            step, held = _tput_build(name, shape, micro)
            times, loss = [], None
            for i, sample in enumerate(data):
                x, y = sample[:, :-1].to(dev), sample[:, 1:].to(dev)
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                loss = step(x, y)
                if cuda:
                    torch.cuda.synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            rate = micro * shape["seq"] / seconds
            util = mfu(rate, per_token, peak)
            rows[name] = {"tokens_per_s": round(rate, 1), "step_ms": round(seconds * 1e3, 2),
                          "mfu": None if util is None else round(util, 4),
                          "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)
                          if cuda else None,
                          "last_loss": round(float(loss), 4)}
        except Exception as err:  # noqa: BLE001 - one variant failing is a row of the report
            rows[name] = {"error": failure(err)}
        finally:
            for obj in held or ():
                if hasattr(obj, "destroy"):
                    obj.destroy(keep_parameters=False)
            step = held = loss = None  # the next variant's peak memory starts from nothing
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    lines = [f"{'variant':<16}{'tokens/s':>12}{'ms/step':>10}{'MFU':>8}{'peak GiB':>10}{'loss':>9}"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"{name:<16}error: {row['error'][:150]}")
            continue
        util = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        mem = "n/a" if row["peak_mem_gib"] is None else f"{row['peak_mem_gib']:.2f}"
        lines.append(f"{name:<16}{row['tokens_per_s']:>12,.0f}{row['step_ms']:>10.1f}{util:>8}"
                     f"{mem:>10}{row['last_loss']:>9.4f}")
    return {"params": n_params, "shape": shape, "micro_batch": micro, "steps": measured,
            "peak_tflops": None if peak is None else peak / 1e12, "rows": rows,
            "table": "\n".join(lines)}


# The generate section's Llama: bf16 on the GPU, about 220 M parameters; a toy on the CPU.
GEN_SHAPE = {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 12,
             "num_attention_heads": 16, "intermediate_size": 2816}
GEN_SHAPE_CPU = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "intermediate_size": 172}
GEN_TOKENS = (32, 128)


def section_generate(quick: bool) -> dict:
    """Tokens/s of greedy generate() at stage 3 (the model gathered once per call) next to plain
    torch on the same weights: in turn, a synchronize around each, median of paired ratios."""
    import copy

    import torch

    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed (pip install transformers)"}
    import zeroshard

    dev = device()
    cuda = dev.type == "cuda"
    if os.environ.get("GPU_CHECK_CPU") != "1" and not cuda:
        return {"skipped": "no CUDA device (run with --cpu to check the script)"}
    init_world()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(GEN_SHAPE if cuda else GEN_SHAPE_CPU))
    plain = transformers.LlamaForCausalLM(config).to(dev, dtype).eval()
    engine, *_ = zeroshard.initialize(model=copy.deepcopy(plain), config={
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": cuda},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.eval()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=gen).to(dev)
    rounds = 3 if quick or not cuda else 8

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    rows = {}
    for tokens in GEN_TOKENS:
        kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        try:
            same = torch.equal(plain.generate(prompt, **kwargs), engine.generate(prompt, **kwargs))
            plain_s, engine_s = [], []
            for _ in range(rounds):
                plain_s.append(timed(lambda: plain.generate(prompt, **kwargs)))
                engine_s.append(timed(lambda: engine.generate(prompt, **kwargs)))
            gathered = sum(p.numel() for p in engine.module.parameters())
            plain_rate, rate = (tokens / statistics.median(s) for s in (plain_s, engine_s))
            rows[tokens] = {"plain_tokens_per_s": round(plain_rate, 1),
                            "zeroshard_tokens_per_s": round(rate, 1),
                            "paired_ratio": round(statistics.median(
                                p / z for p, z in zip(plain_s, engine_s)), 3),
                            "same_tokens": same, "gathered_after": gathered}
        except Exception as err:  # noqa: BLE001 - one length failing is a row of the report
            rows[tokens] = {"error": failure(err)}
    lines = [f"{'new tokens':>10}{'plain tok/s':>13}{'zeroshard tok/s':>17}{'ratio':>8}{'same':>6}"]
    for tokens, row in rows.items():
        if "error" in row:
            lines.append(f"{tokens:>10}  error: {row['error'][:150]}")
            continue
        lines.append(f"{tokens:>10}{row['plain_tokens_per_s']:>13,.1f}"
                     f"{row['zeroshard_tokens_per_s']:>17,.1f}{row['paired_ratio']:>7.2f}x"
                     f"{str(row['same_tokens']):>6}")
    return {"params": sum(p.numel() for p in plain.parameters()), "dtype": str(dtype),
            "rounds": rounds, "rows": rows, "table": "\n".join(lines)}
