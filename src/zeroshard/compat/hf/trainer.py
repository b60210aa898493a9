"""Hugging Face Trainer on zeroshard: `ZeroTrainer(model=, args=, zero_config=, train_dataset=)`.

Design. `ZeroTrainer` subclasses `transformers.Trainer` but runs its own compact `train()` loop.
The Trainer's inner loop (transformers 5.x `_run_epoch`) wires Accelerate into every micro-step:
`accelerator.no_sync` (which the engine must refuse at stages 2-3, where every backward
reduce-scatters), an `AcceleratedOptimizer` (with Accelerate's own fp16 GradScaler) stepped by the
Trainer, clipping and `lr_scheduler.step()` outside the engine, and `optimizer_step_was_skipped`
read from Accelerate's scaler. Only Accelerate's DeepSpeed branch hands all of that to an engine,
and it cannot host a third-party one; overriding it piecemeal means patching a dozen private
methods. So here the engine owns backward, gradient accumulation, clipping, mixed precision, the
optimizer step and the LR scheduler, and the loop keeps the Trainer's public pieces around it:
`get_train_dataloader`, `compute_loss` (called by `training_step`), `create_optimizer`,
`create_scheduler`, `log`, the callbacks (`TrainerControl` decides when to log / evaluate / save /
stop), `TrainerState` and `evaluate`.

At stage 3, a `model_init` (instead of `model=`) is called under `zeroshard.Init`, so the model is
built partitioned; `model_init=lambda: from_pretrained(path, config=zero_config)` loads a
pretrained model slice by slice (`hf_load.py`).

TrainingArguments honoured: num_train_epochs, max_steps, per_device_train_batch_size,
gradient_accumulation_steps, learning_rate, weight_decay, adam_beta1 / adam_beta2, adam_epsilon,
optim (the Trainer's optimizer, unless zero_config has an "optimizer" block), lr_scheduler_type,
lr_scheduler_kwargs, warmup_steps (unless zero_config has a "scheduler" block), max_grad_norm,
bf16, fp16, seed / data_seed and the dataloader_* options (through `get_train_dataloader`),
logging_strategy / logging_steps / logging_first_step, save_strategy / save_steps /
save_total_limit, eval_strategy / eval_steps (with an eval_dataset), output_dir, use_cpu,
disable_tqdm / report_to (callbacks), and `train(resume_from_checkpoint=True or a path)`.
Not honoured: auto_find_batch_size, torch_compile, activation_checkpointing (enable it on the
model), neftune_noise_alpha, load_best_model_at_end, push_to_hub, save_only_model, ignore_data_skip,
average_tokens_across_devices, hyper-parameter search, datasets without a length. An epoch has
len(dataloader) // gradient_accumulation_steps optimizer steps: a last, shorter accumulation window
is dropped. The loss is each micro batch's mean, averaged over accumulation steps and ranks
(DeepSpeed's convention, not the Trainer's token-count weighting across micro batches). The
engine is built by the first train() and kept (save_model, evaluate, a later train() use it).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import shutil
import time

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerState
from transformers.trainer_utils import TrainOutput, speed_metrics

import zeroshard
from zeroshard.config.auto import resolve_auto
from zeroshard.checkpoint.run_state import rng_state, set_rng_state
from zeroshard.config import read_raw

STATE_NAME = "trainer_state.json"
_CKPT = re.compile(r"^checkpoint-(\d+)$")


def hf_known(args, max_steps: int) -> dict:
    """The dotted config keys an "auto" takes from TrainingArguments, for a run of max_steps."""
    lr = args.learning_rate
    return {"train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "gradient_clipping": float(args.max_grad_norm or 0.0),
            "fp16.enabled": bool(args.fp16), "bf16.enabled": bool(args.bf16),
            "optimizer.params.lr": lr,
            "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
            "optimizer.params.eps": args.adam_epsilon,
            "optimizer.params.weight_decay": args.weight_decay,
            "scheduler.params.warmup_min_lr": 0.0, "scheduler.params.warmup_max_lr": lr,
            "scheduler.params.warmup_num_steps": args.get_warmup_steps(max_steps),
            "scheduler.params.total_num_steps": max_steps}


def resolve_hf_config(zero_config, args, model, world_size: int, max_steps: int) -> dict:
    """zero_config as a dict, its "auto"s (and absent batch/clipping/precision keys) from args."""
    raw = dict(read_raw(zero_config))
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        raw.setdefault(key, "auto")
    for key in ("bf16", "fp16"):
        if getattr(args, key):
            raw.setdefault(key, {"enabled": "auto"})
    cfg = resolve_auto(raw, model=model, world_size=world_size, known=hf_known(args, max_steps))
    for key, arg in (("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
                     ("gradient_accumulation_steps", "gradient_accumulation_steps")):
        if cfg[key] != getattr(args, arg):
            raise ValueError(f"zero_config {key}={cfg[key]} but TrainingArguments {arg}="
                             f"{getattr(args, arg)}; make them agree or set {key} to \"auto\"")
    return cfg


class HfZero3Config:
    """What transformers' `is_deepspeed_zero3_enabled()` and `deepspeed_config()` read (through a
    weak reference, as its own HfDeepSpeedConfig is read)."""

    def __init__(self, config: dict):
        self.config = config

    def is_zero3(self) -> bool:
        """Always: only a stage-3 run announces itself."""
        return True


@contextlib.contextmanager
def zero3_announced(config: dict, enabled: bool = True):
    """Within the context transformers sees ZeRO-3 on, as under DeepSpeed: generate() syncs the
    ranks (synced_gpus), TRL gathers partitioned weights itself, from_pretrained builds under
    `deepspeed.zero.Init`. Outside it, what was there before is put back (a model loaded on one
    rank after training must not start collectives the other ranks never join).

    Those code paths `import deepspeed`: where DeepSpeed is not installed, that name is aliased
    to zeroshard in this process (compat/deepspeed/alias.py), as under `zeroshard run`."""
    if not enabled:
        yield None
        return
    from transformers.integrations import deepspeed as hf_deepspeed

    from ..deepspeed.alias import install, installed, real_deepspeed_installed

    if not installed() and not real_deepspeed_installed():
        install()
    before = hf_deepspeed._hf_deepspeed_config_weak_ref
    before = before() if before is not None else None
    flag = HfZero3Config(config)
    hf_deepspeed.set_hf_deepspeed_config(flag)
    try:
        yield flag
    finally:
        if before is not None:
            hf_deepspeed.set_hf_deepspeed_config(before)
        else:
            hf_deepspeed.unset_hf_deepspeed_config()


def last_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint-<step> under output_dir (one with a trainer_state.json)."""
    if not os.path.isdir(output_dir):
        return None
    done = [(int(m.group(1)), name) for name in os.listdir(output_dir)
            if (m := _CKPT.match(name))
            and os.path.isfile(os.path.join(output_dir, name, STATE_NAME))]
    return os.path.join(output_dir, max(done)[1]) if done else None


class ZeroTrainer(Trainer):
    """A transformers.Trainer whose model is trained by a zeroshard engine (ZeRO stages 0-3)."""

    def __init__(self, *args, zero_config=None, **kwargs):
        if zero_config is None:
            raise ValueError("ZeroTrainer needs zero_config=<DeepSpeed-style dict or JSON path>")
        self.zero_config = zero_config  # call_model_init (inside Trainer.__init__) reads it
        super().__init__(*args, **kwargs)
        self.engine = None
        self._saved_step = None

    def call_model_init(self, trial=None):
        """`model_init()` under zeroshard.Init at stage 3: the model is built partitioned (a
        `from_pretrained` of this module inside it streams its weights slice by slice)."""
        stage = read_raw(self.zero_config).get("zero_optimization", {}).get("stage", 0)
        with zeroshard.Init(config={"zero_optimization": {"stage": stage}}):
            return super().call_model_init(trial)

    # -- the engine --------------------------------------------------------------------------------
    def _build_engine(self, max_steps: int):
        """Resolve zero_config and wrap the model (once; later train() calls reuse the engine)."""
        world = dist.get_world_size() if dist.is_initialized() else \
            int(os.environ.get("WORLD_SIZE", 1))
        if world != self.args.world_size:
            raise ValueError(f"{world} ranks, but TrainingArguments sees world size "
                             f"{self.args.world_size} and would not shard the data; on CPU pass "
                             "TrainingArguments(use_cpu=True)")
        cfg = resolve_hf_config(self.zero_config, self.args, self.model, world, max_steps)
        optimizer = None if "optimizer" in cfg and self.optimizer is None else \
            self.create_optimizer()
        scheduler = None if "scheduler" in cfg and self.lr_scheduler is None else \
            (self.lr_scheduler or (lambda opt: self.create_scheduler(max_steps, opt)))
        self.engine, self.optimizer, _, self.lr_scheduler = zeroshard.initialize(
            model=self.model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
        self.model_wrapped = self.engine
        return self.engine

    def _wrap_model(self, model, training=True, dataloader=None):
        """The engine once built (evaluate/predict run through it), else the Trainer's wrapping."""
        if self.engine is not None:
            return self.engine
        return super()._wrap_model(model, training, dataloader)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-step: the batch's mean loss through engine.backward and engine.step."""
        model.train()
        loss = self.compute_loss(model, self._prepare_inputs(inputs))
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    # -- the loop ----------------------------------------------------------------------------------
    def _stage3(self):
        """transformers sees ZeRO-3 on while this trainer works at stage 3 (zero3_announced)."""
        stage = read_raw(self.zero_config).get("zero_optimization", {}).get("stage", 0)
        return zero3_announced(read_raw(self.zero_config), enabled=stage == 3)

    def evaluate(self, *args, **kwargs):
        """The Trainer's evaluate, with ZeRO-3 announced to transformers at stage 3."""
        with self._stage3():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """The Trainer's predict, with ZeRO-3 announced to transformers at stage 3."""
        with self._stage3():
            return super().predict(*args, **kwargs)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Train with TrainingArguments' semantics (module docstring); returns a TrainOutput."""
        with self._stage3():
            return self._train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def _train(self, resume_from_checkpoint, trial, ignore_keys_for_eval):
        args = self.args
        loader = self.get_train_dataloader()
        gas = args.gradient_accumulation_steps
        per_epoch = len(loader) // gas
        if per_epoch == 0:
            raise ValueError(f"{len(loader)} batches per epoch on each rank is fewer than "
                             f"gradient_accumulation_steps={gas}")
        max_steps = args.max_steps if args.max_steps > 0 else \
            math.ceil(args.num_train_epochs * per_epoch)
        epochs = math.ceil(max_steps / per_epoch)
        engine = self.engine or self._build_engine(max_steps)
        self.state = TrainerState()
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)
        self.state.compute_steps(args, max_steps)
        self.state.init_training_references(self, max_steps, epochs, trial)
        self.state.train_batch_size = args.per_device_train_batch_size
        handler = self.callback_handler
        handler.model, handler.optimizer = self.model, engine.optimizer
        handler.lr_scheduler, handler.train_dataloader = engine.lr_scheduler, loader
        self.is_in_train, start, start_step = True, time.time(), self.state.global_step
        tr_loss, total_loss = torch.zeros((), device=engine.device), 0.0
        last_logged, lr = start_step, None
        self.control = handler.on_train_begin(args, self.state, self.control)
        for epoch in range(start_step // per_epoch, epochs):
            if self.state.global_step >= max_steps or self.control.should_training_stop:
                break
            _set_epoch(loader, epoch)
            skip = (self.state.global_step - epoch * per_epoch) * gas  # resuming mid-epoch
            self.control = handler.on_epoch_begin(args, self.state, self.control)
            batches = _skipped(loader, skip, per_epoch * gas)
            for i, inputs in enumerate(batches, start=skip):
                if i % gas == 0:
                    self.control = handler.on_step_begin(args, self.state, self.control)
                    lr = engine.get_lr()[0]  # the rate this optimizer step applies
                tr_loss += self.training_step(engine, inputs).float() / gas
                if (i + 1) % gas:
                    self.control = handler.on_substep_end(args, self.state, self.control)
                    continue
                self.state.global_step += 1
                self.state.epoch = epoch + (i + 1) / (per_epoch * gas)
                self.control = handler.on_step_end(args, self.state, self.control)
                if self.state.global_step >= max_steps:
                    self.control.should_training_stop = True
                total_loss, last_logged = self._log_save_evaluate(
                    tr_loss, total_loss, last_logged, lr, ignore_keys_for_eval, start)
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break
            self.control = handler.on_epoch_end(args, self.state, self.control)
            total_loss, last_logged = self._log_save_evaluate(
                tr_loss, total_loss, last_logged, lr, ignore_keys_for_eval, start)
        total_loss += _mean_over_ranks(tr_loss, engine.device)
        steps = self.state.global_step - start_step
        metrics = speed_metrics("train", start, num_steps=steps,
                                num_samples=steps * engine.train_batch_size())
        metrics["train_loss"] = total_loss / max(steps, 1)
        self.log(metrics)
        self.is_in_train = False
        self.control = handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _log_save_evaluate(self, tr_loss, total_loss, last_logged, lr, ignore_keys, start):
        """Do what TrainerControl asks after a step or an epoch; returns the updated loss tally."""
        step = self.state.global_step
        if self.control.should_log and step > last_logged:
            loss = _mean_over_ranks(tr_loss, self.engine.device)
            tr_loss.zero_()
            logs = {"loss": loss / (step - last_logged), "learning_rate": lr}
            if self.engine.get_global_grad_norm() is not None:
                logs["grad_norm"] = float(self.engine.get_global_grad_norm())
            total_loss, last_logged = total_loss + loss, step
            self.log(logs, start)
        if self.control.should_evaluate:
            self.evaluate(ignore_keys=ignore_keys)
        if self.control.should_save:
            self._save_checkpoint(self.engine, None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return total_loss, last_logged

    # -- checkpoints and the saved model -----------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        """Write output_dir/checkpoint-<step>: engine checkpoint, weights, trainer_state.json."""
        step = self.state.global_step
        if self._saved_step == step:
            return
        run_dir = self.args.output_dir
        out = os.path.join(run_dir, f"checkpoint-{step}")
        self.engine.save_checkpoint(out, tag=f"global_step{step}",
                                    client_state={"global_step": step, "epoch": self.state.epoch})
        if self.engine.zero_optimization_stage() < 3 or \
                self.engine.zero_gather_16bit_weights_on_model_save():
            self.save_model(out, _internal_call=True)  # as DeepSpeed in the Trainer does
        if self.args.should_save:
            self.state.save_to_json(os.path.join(out, STATE_NAME))  # marks the checkpoint complete
            _rotate(run_dir, self.args.save_total_limit)
        self._saved_step = step
        self.engine.comm.barrier()

    def _resume(self, checkpoint) -> None:
        """Load the engine and the trainer state from checkpoint (True: the newest complete one)."""
        if checkpoint is True:
            checkpoint = last_checkpoint(self.args.output_dir)
            if checkpoint is None:
                raise ValueError(f"no complete checkpoint-<step> in {self.args.output_dir}")
        path, client = self.engine.load_checkpoint(checkpoint)
        if path is None:
            raise ValueError(f"{checkpoint} holds no zeroshard checkpoint (no 'latest' file)")
        state_file = os.path.join(checkpoint, STATE_NAME)
        if os.path.isfile(state_file):
            self.state = TrainerState.load_from_json(state_file)  # log history, best metric, ...
        self.state.global_step, self.state.epoch = int(client["global_step"]), client["epoch"]
        self._saved_step = self.state.global_step

    def save_model(self, output_dir=None, _internal_call=False):
        """Consolidate (every rank calls it); rank 0 writes model.safetensors and config.json."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        state = self.engine.consolidated_state_dict(rank0_only=True)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)  # save_pretrained(state_dict=...), tokenizer
        self.engine.comm.barrier()


def _set_epoch(loader, epoch: int) -> None:
    """Give the epoch to every sampler of an Accelerate-prepared loader that takes one."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for obj in (loader, getattr(loader, "sampler", None), batch_sampler,
                getattr(batch_sampler, "sampler", None),
                getattr(batch_sampler, "batch_sampler", None)):
        if obj is not None and hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)


def _skipped(loader, skip: int, stop: int):
    """Batches skip..stop-1 of the loader's epoch. Starting an epoch draws from the global RNG
    (the shuffle seed); when resuming mid-epoch the checkpoint's RNG state is the one after that
    draw, so it is put back once the skipped batches are consumed: dropout then sees the same
    random numbers as in the uninterrupted run."""
    if skip == 0:
        return itertools.islice(loader, 0, stop)
    saved = rng_state()
    batches = iter(loader)
    for _ in range(skip):
        next(batches)
    set_rng_state(saved)
    return itertools.islice(batches, 0, stop - skip)


def _rotate(run_dir: str, limit: int | None) -> None:
    """Keep the newest `limit` checkpoint-<step> folders (save_total_limit)."""
    if not limit or limit <= 0:
        return
    steps = sorted(int(m.group(1)) for name in os.listdir(run_dir) if (m := _CKPT.match(name)))
    for step in steps[:-limit]:
        shutil.rmtree(os.path.join(run_dir, f"checkpoint-{step}"), ignore_errors=True)


def _mean_over_ranks(value: torch.Tensor, device) -> float:
    """The mean of a scalar over all ranks (a collective: every rank calls it)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.to(device, copy=True)
        dist.all_reduce(value)
        return value.item() / dist.get_world_size()
    return value.item()


from .load import from_config, from_pretrained  # noqa: E402,F401 - the stage-3 loading path
