"""Small models and data shared by the multi-rank tests, and the single-process reference loop."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn


class TinyLM(nn.Module):
    """Embedding -> two blocks -> tied head, plus a parameter no forward ever uses.

    Parameter sizes are deliberately odd so that flat buffers need padding at every world size.
    """

    def __init__(self, vocab: int = 23, width: int = 13, checkpoint: str | None = None,
                 reuse: bool = False, dict_io: bool = False):
        super().__init__()
        self.checkpoint = checkpoint  # None, "reentrant" or "plain" activation checkpointing
        self.reuse = reuse  # run block1 twice per forward (a module called several times)
        self.dict_io = dict_io  # take {"tokens": ...} and return {"logits": ...}
        self.embed = nn.Embedding(vocab, width)
        self.block1 = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.GELU(),
                                    nn.Linear(3 * width, width))
        self.block2 = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Tanh(),
                                    nn.Linear(2 * width, width))
        self.unused = nn.Parameter(torch.randn(5))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's lm_head / wte

    def forward(self, tokens=None, *, batch: dict | None = None):
        if batch is not None:
            tokens = batch["tokens"]
        h = self.embed(tokens)
        blocks = (self.block1, self.block1, self.block2) if self.reuse else (self.block1, self.block2)
        for block in blocks:
            if self.checkpoint is None:
                h = h + block(h)
            else:
                h = h + torch.utils.checkpoint.checkpoint(
                    block, h, use_reentrant=self.checkpoint == "reentrant")
        logits = self.head(h)
        return {"logits": logits} if self.dict_io else logits


def make_model(seed: int = 0, checkpoint: str | None = None, **options) -> TinyLM:
    """The same initial weights on every call with the same seed."""
    torch.manual_seed(seed)
    return TinyLM(checkpoint=checkpoint, **options)


def make_batches(steps: int, global_batch: int, seq: int = 6, vocab: int = 23, seed: int = 1):
    """`steps` global batches of (tokens, targets)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (steps, global_batch, seq + 1), generator=gen)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       targets.reshape(-1))


def micro_slice(batch, micro_index: int, rank: int, world: int, micro: int):
    """The part of a global batch that rank `rank` sees at micro-step `micro_index`."""
    start = (micro_index * world + rank) * micro
    return batch[0][start:start + micro], batch[1][start:start + micro]


def reference_run(make_optimizer, batches, clip: float = 0.0, seed: int = 0,
                  make_scheduler=None, **model_options) -> dict[str, torch.Tensor]:
    """Plain single-process training on the whole global batch; returns final parameters."""
    model = make_model(seed, **model_options)
    opt = make_optimizer(model)
    sched = make_scheduler(opt) if make_scheduler else None
    for tokens, targets in batches:
        opt.zero_grad()
        lm_loss(model(tokens), targets).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
