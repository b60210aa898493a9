"""A transformers Trainer script as the Hugging Face docs write one, unchanged for zeroshard:
TrainingArguments from the command line (so `--deepspeed ds_config.json` turns DeepSpeed on),
the model loaded with `from_pretrained` (at ZeRO-3 transformers builds it under
`deepspeed.zero.Init`), `trainer.train(resume_from_checkpoint=...)`, `trainer.save_model()`.

Run by tests/test_hf_stack.py under `zeroshard run --nproc-per-node 2`; rank 0 writes
<output_dir>/probe.json: what transformers saw (DeepSpeed on, ZeRO-3 on, world size), what the
ranks held of the parameters while training, the losses."""

import json
import os
from dataclasses import dataclass

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Trainer,
                          TrainerCallback, TrainingArguments)
from transformers.integrations import is_deepspeed_zero3_enabled


@dataclass
class ScriptArguments:
    model_dir: str
    train_file: str


class Probe(TrainerCallback):
    """Records, at the first step, how many parameter elements this rank holds."""

    def __init__(self):
        self.held = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.held is None:
            self.held = sum(p.numel() for p in model.parameters())


def main():
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)) \
        .parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script.model_dir)
    model = AutoModelForCausalLM.from_pretrained(script.model_dir)
    with open(script.train_file) as fh:
        texts = [json.loads(line)["text"] for line in fh]
    rows = tokenizer(texts, padding="max_length", max_length=16, truncation=True)["input_ids"]
    data = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in rows]
    probe = Probe()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[probe])
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    full = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "probe.json"), "w") as fh:
            json.dump({"deepspeed": trainer.is_deepspeed_enabled,
                       "zero3": is_deepspeed_zero3_enabled(),
                       "engine": type(trainer.model_wrapped).__module__,
                       "world": args.world_size, "global_step": result.global_step,
                       "held_at_step": probe.held, "full": full,
                       "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]},
                      fh)


if __name__ == "__main__":
    main()
