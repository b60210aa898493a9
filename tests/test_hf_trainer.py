"""zeroshard.integrations.hf.ZeroTrainer trains a tiny GPT-2 at stages 2 and 3 on 2 ranks: the loss
falls, an interrupted run resumed from its checkpoint ends on the same weights as an uninterrupted
one, save_model() reloads with from_pretrained with the same logits, and "auto" resolves from
TrainingArguments; stages 0 and 1 follow the same loss trajectory. One world of 2 ranks runs every
case.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.harness import run_world

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ, SAMPLES = 64, 16, 32
STEPS, SAVE_AT = 6, 3  # 4 optimizer steps per epoch: resume mid-epoch 1, end in epoch 2


def _model():
    """Dropout on: resuming must give the same random numbers as the uninterrupted run."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return transformers.GPT2LMHeadModel(cfg).float()


def _data():
    """Counting sequences (start, start+k, start+2k, ...) mod VOCAB: learnable in a few steps."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=gen)
    stride = torch.randint(1, 4, (SAMPLES, 1), generator=gen)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(out, **overrides):
    kw = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_steps=STEPS, learning_rate=3e-2, lr_scheduler_type="linear", warmup_steps=1,
              logging_steps=1, save_strategy="steps", save_steps=SAVE_AT, report_to="none",
              disable_tqdm=True, seed=0, use_cpu=not torch.cuda.is_available())
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


class _SeesZero3(transformers.TrainerCallback):
    """Records what transformers' is_deepspeed_zero3_enabled() says during training."""

    def __init__(self):
        self.seen = None

    def on_step_end(self, args, state, control, **kwargs):
        """Read the flag once a step has run."""
        from transformers.integrations import is_deepspeed_zero3_enabled

        self.seen = is_deepspeed_zero3_enabled()


class _StopAt(transformers.TrainerCallback):
    """Ends training after `step` optimizer steps (an interrupted job)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        """Stop once the step is reached."""
        if state.global_step >= self.step:
            control.should_training_stop = True


def _rel_err(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


def _stage(rank, root, stage):
    from zeroshard.integrations.hf import ZeroTrainer

    cfg = {"zero_optimization": {"stage": stage}}
    full_dir, part_dir, saved = (os.path.join(root, f"s{stage}-{name}")
                                 for name in ("full", "part", "saved"))
    data = _data()
    limit = 1 if stage == 3 else None  # save_total_limit keeps only the newest checkpoint
    sees = _SeesZero3()
    trainer = ZeroTrainer(model=_model(), args=_args(full_dir, save_total_limit=limit),
                          zero_config=cfg, train_dataset=data, eval_dataset=data[:8],
                          callbacks=[sees])
    output = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    eval_loss = trainer.evaluate()["eval_loss"]
    full = trainer.engine.consolidated_state_dict(rank0_only=False)
    trainer.save_model(saved)
    probe = torch.stack([d["input_ids"] for d in data[:4]])
    trainer.engine.eval()
    with torch.no_grad():
        live = trainer.engine(input_ids=probe).logits
    trainer.engine.destroy()
    from transformers.integrations import is_deepspeed_zero3_enabled

    out = {"losses": losses, "global_step": output.global_step, "eval_loss": eval_loss,
           "checkpoints": sorted(os.listdir(full_dir)),
           "zero3_seen": (sees.seen, is_deepspeed_zero3_enabled())}
    if rank == 0:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
        reference = _model().eval()
        reference.load_state_dict(full)
        with torch.no_grad():
            got, want = reloaded(input_ids=probe).logits, reference(input_ids=probe).logits
        out["logits_equal"] = torch.equal(got, want)
        out["live_logits_err"] = (got - live).abs().max().item()
        out["saved_files"] = sorted(os.listdir(saved))

    # The same run interrupted after the checkpoint at SAVE_AT, then resumed by a fresh trainer.
    first = ZeroTrainer(model=_model(), args=_args(part_dir), zero_config=cfg, train_dataset=data,
                        callbacks=[_StopAt(SAVE_AT)])
    out["interrupted_at"] = first.train().global_step
    first.engine.destroy()
    second = ZeroTrainer(model=_model(), args=_args(part_dir), zero_config=cfg, train_dataset=data)
    resume = True if stage == 2 else os.path.join(part_dir, f"checkpoint-{SAVE_AT}")
    out["resumed_to"] = second.train(resume_from_checkpoint=resume).global_step
    resumed = second.engine.consolidated_state_dict(rank0_only=False)
    second.engine.destroy()
    out["resume_err"] = _rel_err(resumed, full)
    return out


AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                 "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"}}


def _auto(rank, root):
    from zeroshard.integrations.hf import ZeroTrainer

    path = os.path.join(root, "auto.json")
    if rank == 0:
        with open(path, "w") as fh:
            json.dump(AUTO, fh)
    torch.distributed.barrier()
    args = _args(os.path.join(root, "auto"), max_steps=2, save_strategy="no", bf16=True,
                 learning_rate=3e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7,
                 weight_decay=0.01, max_grad_norm=0.5, warmup_steps=1)
    trainer = ZeroTrainer(model=_model(), args=args, zero_config=path, train_dataset=_data())
    trainer.train()
    engine = trainer.engine
    group = engine.optimizer.param_groups[0]
    out = {"config": engine.config, "bf16": engine.bfloat16_enabled(),
           "scheduler": type(engine.lr_scheduler).__name__,
           "group": {k: group[k] for k in ("betas", "eps", "weight_decay")},
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    engine.destroy()
    return out


def _short(rank, root, stage):
    """The long cases' run, without checkpoints, at another stage; the logged losses."""
    from zeroshard.integrations.hf import ZeroTrainer

    args = _args(os.path.join(root, f"short{stage}"), save_strategy="no")
    trainer = ZeroTrainer(model=_model(), args=args, train_dataset=_data(),
                          zero_config={"zero_optimization": {"stage": stage}})
    trainer.train()
    trainer.engine.destroy()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _sft(rank, root):
    """TRL's SFTTrainer on ZeroTrainer at stage 3 (its loss and entropy read lm_head whole)."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from tests import hf_assets
    from zeroshard.integrations.hf import ZeroTrainer

    class ZeroSFTTrainer(ZeroTrainer, SFTTrainer):
        """SFT's data handling and loss, zeroshard's engine."""

    path = os.path.join(root, "sft-model")
    if rank == 0:
        hf_assets.save_model(path)
    torch.distributed.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    data = datasets.Dataset.from_list([{"text": t} for t in hf_assets.sentences(32)])
    args = SFTConfig(output_dir=os.path.join(root, "sft"), per_device_train_batch_size=2,
                     max_steps=3, max_length=32, report_to="none", save_strategy="no",
                     use_cpu=True, bf16=False, logging_steps=1, disable_tqdm=True)
    trainer = ZeroSFTTrainer(model=model, args=args, train_dataset=data,
                             processing_class=transformers.AutoTokenizer.from_pretrained(path),
                             zero_config={"zero_optimization": {
                                 "stage": 3, "stage3_param_persistence_threshold": 0}})
    trainer.train()
    out = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "stage": trainer.engine.zero_optimization_stage()}
    trainer.engine.destroy()
    return out


def _all(rank, world, root):
    out = {"stage2": _stage(rank, root, 2), "stage3": _stage(rank, root, 3),
           "auto": _auto(rank, root), "short": {s: _short(rank, root, s) for s in (0, 1)}}
    try:
        import trl  # noqa: F401
    except ImportError:
        return out
    out["sft"] = _sft(rank, root)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's per-rank results, from one world of 2 ranks."""
    return run_world(2, _all, str(tmp_path_factory.mktemp("hf_trainer")))


@pytest.mark.parametrize("stage", [2, 3])
def test_loss_decreases(results, stage):
    """The logged loss falls over 6 steps and the final eval loss is below the first."""
    for r in results:
        got = r[f"stage{stage}"]
        assert got["global_step"] == STEPS and len(got["losses"]) == STEPS
        assert got["losses"][-1] < 0.95 * got["losses"][0], got["losses"]
        assert got["eval_loss"] < got["losses"][0]


@pytest.mark.parametrize("stage", [2, 3])
def test_transformers_sees_zero3_only_while_a_stage3_trainer_works(results, stage):
    """is_deepspeed_zero3_enabled() is true during a stage-3 train() (TRL and generate read it)
    and false again afterwards (a from_pretrained on one rank must not start collectives)."""
    for r in results:
        assert r[f"stage{stage}"]["zero3_seen"] == (stage == 3, False)


def test_trl_sft_trainer_on_zero_trainer_at_stage3(results):
    """SFTTrainer's loss on ZeroTrainer's engine, stage 3: trains, same losses on both ranks."""
    if "sft" not in results[0]:
        pytest.skip("trl is not installed")
    first = results[0]["sft"]
    assert first["stage"] == 3 and len(first["losses"]) == 3
    assert all(0 < loss < 10 for loss in first["losses"])
    assert results[1]["sft"]["losses"] == first["losses"]


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_and_1_train(results, stage):
    """Stages 0 and 1 train too, on the same trajectory as stages 2 and 3."""
    for r in results:
        assert r["short"][stage] == pytest.approx(r["stage2"]["losses"], rel=1e-5)


def test_checkpoints_are_written_at_save_steps_and_rotated(results):
    """checkpoint-<step> at save_steps and at the end; save_total_limit=1 keeps the newest."""
    assert results[0]["stage2"]["checkpoints"] == [f"checkpoint-{SAVE_AT}", f"checkpoint-{STEPS}"]
    assert results[0]["stage3"]["checkpoints"] == [f"checkpoint-{STEPS}"]  # save_total_limit=1


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_reaches_the_uninterrupted_weights(results, stage):
    """Stopped at the checkpoint and resumed by a fresh trainer: the uninterrupted weights."""
    for r in results:
        got = r[f"stage{stage}"]
        assert got["interrupted_at"] == SAVE_AT and got["resumed_to"] == STEPS
        assert got["resume_err"] < 1e-6, got["resume_err"]


@pytest.mark.parametrize("stage", [2, 3])
def test_saved_model_reloads_with_from_pretrained(results, stage):
    """save_model() output loads with from_pretrained; logits match the trained model."""
    got = results[0][f"stage{stage}"]
    assert {"model.safetensors", "config.json"} <= set(got["saved_files"])
    assert got["logits_equal"]
    assert got["live_logits_err"] < 1e-5


def test_auto_config_resolves_from_training_arguments(results):
    """Every "auto" in a JSON config file takes its value from TrainingArguments or the model."""
    for r in results:
        got = r["auto"]
        cfg = got["config"]
        assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
                cfg["train_batch_size"]) == (2, 2, 8)
        assert cfg["gradient_clipping"] == 0.5 and got["bf16"]
        assert cfg["optimizer"]["params"] == {"lr": 3e-3, "betas": [0.8, 0.95], "eps": 1e-7,
                                              "weight_decay": 0.01}
        assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                              "warmup_num_steps": 1, "total_num_steps": 2}
        zero = cfg["zero_optimization"]
        assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
                zero["stage3_param_persistence_threshold"]) == (32 * 32, int(0.9 * 32 * 32), 320)
        assert got["scheduler"] == "WarmupDecayLR"
        assert tuple(got["group"]["betas"]) == (0.8, 0.95) and got["group"]["eps"] == 1e-7
        assert len(got["losses"]) == 2


class _Args:
    """The TrainingArguments fields resolve_hf_config reads (no Accelerate state in pytest)."""

    per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm = 4, 2, 1.0
    fp16, bf16, learning_rate, weight_decay = False, True, 1e-3, 0.0
    adam_beta1, adam_beta2, adam_epsilon = 0.9, 0.99, 1e-8

    def get_warmup_steps(self, max_steps):
        """No warmup."""
        return 0


def test_absent_keys_come_from_training_arguments_and_contradictions_are_refused():
    """Absent batch/clipping/precision keys come from args; a contradicting micro batch fails."""
    from zeroshard.integrations.hf import resolve_hf_config

    cfg = resolve_hf_config({"zero_optimization": {"stage": 2}}, _Args(), None, 2, 10)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
            cfg["gradient_clipping"], cfg["bf16"]) == (4, 2, 1.0, {"enabled": True})
    with pytest.raises(ValueError, match="per_device_train_batch_size=4"):
        resolve_hf_config({"train_micro_batch_size_per_gpu": 8}, _Args(), None, 2, 10)
