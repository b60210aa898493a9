"""Lightning's Trainer with ZeroShardStrategy: stages 0-3 equal a single-process reference.

One world of 2 gloo ranks (tests/harness.py) runs every two-rank case with `trainer.fit` inside
the ranks; alongside it one worker process runs `Trainer(devices=1)`, where Lightning creates the
process group itself. The model is a 2-layer MLP regression (fp32, AdamW from configure_optimizers)
on 32 samples, 4 per rank per micro-batch. Lightning shuffles through a DistributedSampler (seed 0
+ epoch), so a step's global batch is 8 consecutive entries of that epoch's permutation; the
reference takes the same 8 samples.
"""

from __future__ import annotations

import multiprocessing
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402

from tests.harness import run_world  # noqa: E402

IN, WIDTH, SAMPLES, MICRO, LR, WD = 5, 12, 32, 4, 0.02, 0.01
STEPS = 6
CLIP = 0.05  # small enough to clip on every step


def make_optimizer(params, kind: str) -> torch.optim.Optimizer:
    """AdamW, or SGD with momentum (scale-sensitive: a wrong loss or gradient scale shows)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def make_net(seed: int = 0) -> nn.Module:
    """The MLP with the same initial weights for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 1))


def make_data(samples: int = SAMPLES, seed: int = 7):
    """Inputs and regression targets."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, IN, generator=gen)
    return x, torch.sin(x.sum(1, keepdim=True)) + 0.1 * x[:, :1]


def epoch_order(epoch: int, samples: int = SAMPLES) -> torch.Tensor:
    """The sample order Lightning's DistributedSampler(shuffle=True, seed=0) uses in `epoch`."""
    return torch.randperm(samples, generator=torch.Generator().manual_seed(epoch))


def loader(batch: int = MICRO, seed: int = 7):
    """A plain DataLoader (Lightning gives it a shuffling DistributedSampler)."""
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(*make_data(seed=seed)), batch_size=batch, shuffle=False)


def rank_loader(rank: int, world: int):
    """Every epoch the same 4 of 8 samples on each rank: one step per epoch (for resuming)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(*make_data(2 * MICRO))
    return DataLoader(data, batch_size=MICRO, sampler=DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=False))


class Regressor(pl.LightningModule):
    """The MLP as a LightningModule: AdamW or SGD, optionally a per-step StepLR or manual
    optimization."""

    def __init__(self, seed: int = 0, sched: bool = False, manual: bool = False,
                 opt: str = "adamw"):
        super().__init__()
        self.net = make_net(seed)
        self.sched, self.opt = sched, opt
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        """MSE loss (manual optimization: its own zero_grad / backward / step)."""
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def validation_step(self, batch, batch_idx):
        """Log the MSE, averaged over ranks."""
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        """The optimizer, with a per-step StepLR when asked."""
        opt = make_optimizer(self.parameters(), self.opt)
        if not self.sched:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def config(stage: int, **extra) -> dict:
    """A DeepSpeed config; small buckets give several padded units, stage 3 shards everything."""
    zero = {"stage": stage, "reduce_bucket_size": 64}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.0, **extra}


def make_trainer(root: str, cfg, devices: int = 2, callbacks=(), **kwargs):
    """A quiet CPU Trainer on ZeroShardStrategy."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from zeroshard.integrations.lightning import ZeroShardStrategy

    callbacks = list(callbacks)
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=ZeroShardStrategy(config=cfg),
        default_root_dir=root, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), **kwargs)


def weights(trainer) -> dict[str, torch.Tensor]:
    """The whole model's weights (gathered at stage 3; all ranks call it), named as in make_net."""
    state = trainer.strategy.engine.consolidated_state_dict(rank0_only=False)
    return {k.removeprefix("net."): v.float().clone() for k, v in state.items()}


def fit(root: str, cfg, steps: int = STEPS, devices: int = 2, batch: int = MICRO, **kwargs):
    """Fit a fresh Regressor for `steps` optimizer steps; return its final weights."""
    module_kwargs = {k: kwargs.pop(k) for k in ("sched", "manual", "seed", "opt") if k in kwargs}
    trainer = make_trainer(root, cfg, devices=devices, max_steps=steps, **kwargs)
    trainer.fit(Regressor(**module_kwargs), loader(batch))
    assert trainer.global_step == steps
    return weights(trainer)


def engine_loop(rank: int, world: int, cfg: dict, steps: int) -> dict[str, torch.Tensor]:
    """The same training with zeroshard's own engine loop (no Lightning), on this rank's samples."""
    import zeroshard

    net = make_net()
    engine, _, _, _ = zeroshard.initialize(
        model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD),
        config=cfg)
    x, y = make_data()
    per_epoch = SAMPLES // (world * MICRO)
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        part = epoch_order(epoch)[rank::world][i * MICRO:(i + 1) * MICRO]  # this rank's share
        inputs, targets = x[part].to(engine.compute_dtype), y[part].to(engine.compute_dtype)
        engine.backward(F.mse_loss(engine(inputs), targets))
        engine.step()
    state = engine.consolidated_state_dict(rank0_only=False)
    return {k: v.float().clone() for k, v in state.items()}


def checkpoint_cases(root: str, rank: int, world: int) -> dict:
    """Stage 3: fit 8 steps saving at steps 4 and 8; resume at step 4 in fresh Trainers.

    Lightning 2.6 resuming from an epoch-end checkpoint with a plain DataLoader shifts its batch
    count (its own strategies do the same), so these runs take the same batch at every step: what
    is compared is what the strategy restores (weights, optimizer, LR schedule, counters).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    saves = os.path.join(root, "saves")
    newest = os.path.join(root, "newest")  # save_top_k=1: older checkpoint directories removed
    trainer = make_trainer(root, config(3), max_steps=8, use_distributed_sampler=False,
                           check_val_every_n_epoch=4, callbacks=[
                               ModelCheckpoint(dirpath=saves, every_n_epochs=4, save_top_k=-1),
                               ModelCheckpoint(dirpath=newest, every_n_epochs=2)])
    # validation inside fit too (after steps 4 and 8; every rank evaluates all 32 samples)
    trainer.fit(Regressor(sched=True), rank_loader(rank, world), loader(seed=8))
    out = {"full": weights(trainer), "full_lr": trainer.strategy.engine.get_lr(),
           "fit_val_loss": trainer.callback_metrics["val_loss"].item()}
    final = os.path.join(root, "final.ckpt")
    trainer.save_checkpoint(final)  # after fit: the engine is still there
    out["listing"] = {name: sorted(os.listdir(os.path.join(saves, name)))
                      for name in sorted(os.listdir(saves))}
    out["newest"] = sorted(os.listdir(newest))
    middle = os.path.join(saves, "epoch=3-step=4.ckpt")
    for stage in (3, 1):  # the same stage, and another one
        resumed = make_trainer(root, config(stage), max_steps=8, use_distributed_sampler=False)
        resumed.fit(Regressor(seed=1, sched=True), rank_loader(rank, world), ckpt_path=middle)
        out[f"resumed{stage}"] = weights(resumed)
        out[f"resumed{stage}_step"] = resumed.global_step
        out[f"resumed{stage}_lr"] = resumed.strategy.engine.get_lr()
    # validate a fresh module from the final checkpoint: eval forward on stage-3 shards
    metrics = make_trainer(root, config(3)).validate(Regressor(seed=2), loader(seed=8),
                                                     ckpt_path=final, verbose=False)
    out["val_loss"] = metrics[0]["val_loss"]
    return out


def _two_ranks(rank: int, world: int, root: str) -> dict:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    root = os.path.join(root, "world2")
    out = {f"stage{s}": fit(root, config(s)) for s in (0, 1, 2, 3)}
    # accumulation from the config with a per-step LR schedule; clipping from the Trainer
    out["accum"] = fit(root, config(1, gradient_accumulation_steps=2), steps=4, sched=True,
                       opt="sgd")
    clip_cfg = config(2)
    del clip_cfg["gradient_clipping"]  # the Trainer's gradient_clip_val sets it
    out["clip"] = fit(root, clip_cfg, opt="sgd", gradient_clip_val=CLIP,
                      gradient_clip_algorithm="norm")
    out["manual"] = fit(root, config(3), manual=True, opt="sgd")
    bf16 = config(2, bf16={"enabled": True})
    out["bf16"] = fit(root, bf16)
    out["bf16_engine"] = engine_loop(rank, world, bf16, STEPS)
    out.update(checkpoint_cases(root, rank, world))
    return out


def _one_device(root: str) -> dict:
    """Trainer(devices=1) in a process without a process group: Lightning starts one."""
    os.environ["ZEROSHARD_QUIET"] = "1"
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    root = os.path.join(root, "world1")
    out = {"stage3": fit(root, config(3), batch=2 * MICRO, devices=1)}
    fp16 = config(2, fp16={"enabled": True, "initial_scale_power": 8})
    out["fp16"] = fit(root, fp16, devices=1)
    out["fp16_engine"] = engine_loop(0, 1, fp16, STEPS)
    for name, kwargs in (("precision", {"precision": "bf16-mixed"}), ("clip_value", {
            "gradient_clip_val": 0.1, "gradient_clip_algorithm": "value"})):
        try:
            make_trainer(root, config(2), devices=1, max_steps=1, **kwargs).fit(
                Regressor(), loader())
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    return out


def reference(steps: int, batch: int, clip: float = 0.0, sched: bool = False,
              samples: int = SAMPLES, opt: str = "adamw") -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch on the same global batches."""
    net = make_net()
    x, y = make_data(samples)
    opt = make_optimizer(net.parameters(), opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    per_epoch = samples // batch
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        part = epoch_order(epoch, samples)[i * batch:(i + 1) * batch]
        opt.zero_grad()
        F.mse_loss(net(x[part]), y[part]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def rel_error(got: dict, expected: dict) -> float:
    """Largest |difference| / max |expected| over the tensors."""
    assert got.keys() == expected.keys()
    return max(((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item()
               for k, v in expected.items())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Rank 0's results of the two-rank world (rank 1's must agree) and the one-device worker's."""
    root = str(tmp_path_factory.mktemp("lightning"))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        single = pool.apply_async(_one_device, (root,))
        ranks = run_world(2, _two_ranks, root)
        one = single.get(timeout=600)
    for key, value in ranks[0].items():
        if isinstance(value, dict) and all(torch.is_tensor(v) for v in value.values()):
            assert rel_error(ranks[1][key], value) == 0.0, key
    return ranks[0], one


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_equals_single_process_reference(results, stage):
    """Two ranks at each stage reach the reference's weights (same global batch) within 1e-5."""
    assert rel_error(results[0][f"stage{stage}"], reference(STEPS, 2 * MICRO)) < 1e-5


def test_accumulation_and_scheduler(results):
    """Config gradient_accumulation_steps=2 (SGD, per-step StepLR) equals a global batch of 16."""
    assert rel_error(results[0]["accum"], reference(4, 4 * MICRO, sched=True, opt="sgd")) < 1e-5


def test_clipping(results):
    """Trainer(gradient_clip_val=) becomes the engine's global-norm clipping."""
    assert rel_error(results[0]["clip"], reference(STEPS, 2 * MICRO, clip=CLIP, opt="sgd")) < 1e-5


def test_manual_optimization(results):
    """manual_backward / optimizer.step() in training_step go through the engine too (stage 3)."""
    assert rel_error(results[0]["manual"], reference(STEPS, 2 * MICRO, opt="sgd")) < 1e-5


def test_bf16_equals_engine_loop(results):
    """bf16 from the config: Lightning's run is zeroshard's own loop, and it learns."""
    got = results[0]
    assert rel_error(got["bf16"], got["bf16_engine"]) < 1e-6
    initial = {k: v.detach() for k, v in make_net().state_dict().items()}
    assert rel_error(got["bf16"], initial) > 1e-2  # it moved
    assert rel_error(got["bf16"], reference(STEPS, 2 * MICRO)) < 2e-2  # towards fp32's result


def test_fp16_equals_engine_loop(results):
    """fp16 with loss scaling from the config (one device): Lightning's run is the engine loop's."""
    got = results[1]
    assert rel_error(got["fp16"], got["fp16_engine"]) < 1e-6
    initial = {k: v.detach() for k, v in make_net().state_dict().items()}
    assert rel_error(got["fp16"], initial) > 1e-2


def test_checkpoint_directories(results):
    """ModelCheckpoint writes one zeroshard checkpoint directory per save, and removes them."""
    listing = results[0]["listing"]
    assert list(listing) == ["epoch=3-step=4.ckpt", "epoch=7-step=8.ckpt"]
    assert all(entries == ["checkpoint", "latest", "zero_to_fp32.py"]
               for entries in listing.values())
    assert results[0]["newest"] == ["epoch=7-step=8.ckpt"]  # top-k removed the older ones


@pytest.mark.parametrize("stage", [3, 1])
def test_resume_equals_uninterrupted(results, stage):
    """Resuming the stage-3 step-4 checkpoint (at stage 3, or at stage 1) ends where the
    uninterrupted run ended: weights, LR schedule and step counter."""
    got = results[0]
    assert got[f"resumed{stage}_step"] == 8
    assert got[f"resumed{stage}_lr"] == got["full_lr"] == [LR * 0.5 ** 4]
    assert rel_error(got[f"resumed{stage}"], got["full"]) < 1e-6
    assert rel_error(got["full"], reference(8, 2 * MICRO, sched=True, samples=2 * MICRO)) < 1e-5


def test_validation_in_fit_and_from_checkpoint(results):
    """The val loop inside fit, and trainer.validate(ckpt_path=) on a fresh module, evaluate the
    final weights (stage 3: eval forwards on shards)."""
    net = make_net()
    net.load_state_dict(results[0]["full"])
    x, y = make_data(seed=8)
    expected = F.mse_loss(net(x), y).item()
    assert results[0]["fit_val_loss"] == pytest.approx(expected, rel=1e-5)
    assert results[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_single_device(results):
    """Trainer(devices=1), Lightning's own process group, equals the reference too."""
    assert rel_error(results[1]["stage3"], reference(STEPS, 2 * MICRO)) < 1e-5


def test_refused_settings(results):
    """Trainer precision plugins and clipping by value are refused with what to do instead."""
    assert "mixed precision comes from the zeroshard config" in results[1]["precision"]
    assert "global norm" in results[1]["clip_value"]


def test_batch_keys_become_accumulation():
    """The config's batch keys give Lightning's accumulation; the engine keeps micro batch only."""
    from zeroshard.compat.lightning import _pop_accumulation

    cfg = {"gradient_accumulation_steps": 3, "train_batch_size": 24}
    assert _pop_accumulation(cfg, 2) == 3 and cfg == {"train_micro_batch_size_per_gpu": 1}
    assert _pop_accumulation({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2) == 4
    assert _pop_accumulation({"train_micro_batch_size_per_gpu": "auto"}, 2) == 1
    with pytest.raises(ValueError, match="not a multiple"):
        _pop_accumulation({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2)
