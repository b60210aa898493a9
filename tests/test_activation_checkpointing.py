"""deepspeed.checkpointing (zeroshard.activations): checkpoint / configure / is_configured / reset
as Megatron-style scripts call them, and the activation_checkpointing section (cpu_checkpointing,
partition_activations), against plain torch without checkpointing.

One world of 2 gloo ranks runs every case; a ZeRO stage-3 engine whose blocks call
`deepspeed.checkpointing.checkpoint` (through the `import deepspeed` alias) equals the
single-process reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.activations import checkpointing as ckpt
from zeroshard.config import ConfigError
from tests.harness import run_world
from tests.models import TinyLM, lm_loss, make_batches, micro_slice, reference_run

MICRO = 2
STEPS = 3


def _block() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Dropout(0.5), nn.Linear(10, 6))


def _grads(block: nn.Module, x: torch.Tensor, run) -> list[torch.Tensor]:
    """Gradients of x and the block's parameters after run(block, x).square().sum().backward()."""
    x = x.clone().requires_grad_(True)
    block.zero_grad()
    run(block, x).square().sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(u, v, rtol=1e-6, atol=1e-7) for u, v in zip(a, b))


class _WorldMpu:
    """A Megatron-style mpu whose model-parallel group is the whole world (as tensor parallelism
    would be: every rank of the group sees the same activations)."""

    def get_model_parallel_group(self):
        return dist.group.WORLD

    def get_model_parallel_rank(self):
        return dist.get_rank()

    def get_model_parallel_world_size(self):
        return dist.get_world_size()


def _held_during(block, x) -> tuple[dict, list[torch.Tensor], dict]:
    """(bytes held after the checkpointed forward, gradients, bytes held after backward)."""
    x = x.clone().requires_grad_(True)
    block.zero_grad()
    torch.manual_seed(11)
    out = ckpt.checkpoint(block, x)
    during = ckpt.held_bytes()
    out.square().sum().backward()
    return during, [x.grad.clone()] + [p.grad.clone() for p in block.parameters()], ckpt.held_bytes()


def _standalone_cases(rank, world) -> dict:
    out = {}
    block = _block()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    nbytes = x.numel() * x.element_size()

    def plain(b, v):
        torch.manual_seed(11)
        return b(v)

    ref = _grads(block, x, plain)
    out["not_configured_at_start"] = not ckpt.is_configured()

    ckpt.configure(None)  # DeepSpeed's defaults: plain checkpointing
    during, grads, after = _held_during(block, x)
    out["plain"] = (_same(grads, ref), during, after)
    out["configured"] = ckpt.is_configured()

    ckpt.configure(None, deepspeed_config={"train_batch_size": 2, "activation_checkpointing": {
        "cpu_checkpointing": True}})
    during, grads, after = _held_during(block, x)
    out["cpu"] = (_same(grads, ref), during, after, nbytes)

    # partition_activations without model parallelism: nothing to split, each rank keeps all.
    ckpt.configure(None, partition_activations=True)
    during, grads, after = _held_during(block, x)
    out["partition_no_mpu"] = (_same(grads, ref), during, nbytes)

    ckpt.configure(_WorldMpu(), partition_activations=True, checkpoint_in_cpu=True)
    during, grads, after = _held_during(block, x)
    out["partition_mpu"] = (_same(grads, ref), during, after, nbytes)

    # reset() after eval forwards drops what they left held.
    with torch.no_grad():
        ckpt.checkpoint(block, x)
    x_grad = x.clone().requires_grad_(True)
    kept = ckpt.checkpoint(block, x_grad)  # a training forward without its backward yet
    ckpt.reset()
    out["after_reset"] = ckpt.held_bytes()
    try:
        kept.sum().backward()
        out["backward_after_reset"] = "no error"
    except RuntimeError as err:
        out["backward_after_reset"] = str(err)

    # The model-parallel RNG tracker: dropout under fork() is replayed in the recompute.
    def tracked(b, v):
        with ckpt.get_cuda_rng_tracker().fork():
            return b(v)

    ckpt.configure(None)
    ckpt.model_parallel_cuda_manual_seed(7)
    ref_tracked = _grads(block, x, tracked)
    ckpt.model_parallel_cuda_manual_seed(7)
    got = _grads(block, x, lambda b, v: ckpt.checkpoint(tracked, b, v))
    out["tracker"] = _same(got, ref_tracked) and not _same(ref_tracked, ref)
    ckpt.get_cuda_rng_tracker().reset()

    # Keyword arguments are passed through (DeepSpeed folds them into the inputs).
    scale = torch.tensor(2.0)

    def scaled(h, s=None):
        torch.manual_seed(11)
        return block(h) * s

    got = _grads(block, x, lambda b, v: ckpt.checkpoint(scaled, v, s=scale))
    ref_kw = _grads(block, x, lambda b, v: plain(b, v) * scale)
    out["kwargs"] = _same(got, ref_kw)
    return out


class _DeepSpeedCheckpointedLM(TinyLM):
    """TinyLM whose blocks run through deepspeed.checkpointing.checkpoint, as Megatron's do."""

    def forward(self, tokens):
        import deepspeed

        h = self.embed(tokens)
        for block in (self.block1, self.block2):
            h = h + deepspeed.checkpointing.checkpoint(block, h)
        return self.head(h)


def _engine_case(rank, world) -> dict:
    from zeroshard.compat.deepspeed.alias import install

    install()
    import deepspeed

    batches = make_batches(STEPS, MICRO * world)
    ref = reference_run(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), batches)
    torch.manual_seed(0)
    model = _DeepSpeedCheckpointedLM()
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config={
        "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": None, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "activation_checkpointing": {"cpu_checkpointing": True, "partition_activations": True}})
    held = []
    for batch in batches:
        tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
        loss = lm_loss(engine(tokens), targets)
        held.append(ckpt.held_bytes())
        engine.backward(loss)
        engine.step()
    engine.destroy()
    error = max(((p.detach() - ref[n]).abs().max() / ref[n].abs().max()).item()
                for n, p in model.named_parameters())
    width = model.embed.weight.shape[1]
    return {"error": error, "held": held, "after": ckpt.held_bytes(),
            "expected": 2 * MICRO * batches[0][0].shape[1] * width * 4,
            "configured": deepspeed.checkpointing.is_configured(),
            "same_function": deepspeed.checkpointing.checkpoint is ckpt.checkpoint}


def _all_cases(rank, world):
    engine = _engine_case(rank, world)  # first: configure() not called yet in this process
    return {"engine": engine, "standalone": _standalone_cases(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_world(2, _all_cases)


def test_plain_checkpoint_equals_torch_without_checkpointing(results):
    for r in results:
        s = r["standalone"]
        assert s["not_configured_at_start"] and s["configured"]
        same, during, after = s["plain"]
        assert same  # dropout included: the recompute replays the forward's RNG
        assert during == {} and after == {}  # torch holds the inputs; no hooks of ours


def test_cpu_checkpointing_keeps_inputs_in_host_memory(results):
    for r in results:
        same, during, after, nbytes = r["standalone"]["cpu"]
        assert same
        assert during == {"cpu": nbytes} and after == {}


def test_partition_activations_splits_over_the_model_parallel_group(results):
    for r in results:
        same, during, after, nbytes = r["standalone"]["partition_mpu"]
        assert same
        assert during == {"cpu": nbytes // 2} and after == {}  # 1/M per rank, M = 2


def test_partition_activations_without_model_parallelism_keeps_everything(results):
    for r in results:
        same, during, nbytes = r["standalone"]["partition_no_mpu"]
        assert same and during == {}  # plain checkpointing: torch keeps the whole inputs


def test_reset_releases_held_inputs_and_says_so_if_one_was_still_needed(results):
    for r in results:
        s = r["standalone"]
        assert s["after_reset"] == {}
        assert "reset()" in s["backward_after_reset"]


def test_rng_tracker_and_keywords(results):
    for r in results:
        assert r["standalone"]["tracker"]
        assert r["standalone"]["kwargs"]


def test_stage3_engine_with_deepspeed_checkpointing_equals_reference(results):
    for r in results:
        e = r["engine"]
        assert e["same_function"]
        assert e["error"] < 1e-5, e["error"]
        # initialize()'s section applies (cpu_checkpointing; no model parallelism to partition
        # over), without counting as configure() for Megatron's is_configured() check.
        assert all(h == {"cpu": e["expected"]} for h in e["held"]), (e["held"], e["expected"])
        assert e["after"] == {} and not e["configured"]


def test_configure_refuses_what_deepspeed_refuses():
    with pytest.raises(ValueError, match="contiguous_memory_optimization.*partition_activations"):
        ckpt.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="number_checkpoints"):
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="cpu_checkpointing"):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})
