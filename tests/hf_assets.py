"""Tiny local Hugging Face assets for the tests that launch real scripts (no hub): a word-level
tokenizer, a 2-layer GPT-2 with dropout saved with save_pretrained, text data as JSON lines, and
the Hugging Face docs' ZeRO-3 config with "auto" values and CPU offload."""

from __future__ import annotations

import json
import os
import random

WORDS = ("the a my our cat dog bird man team robot student farmer sees likes builds finds paints "
         "reads carries follows watches cleans house ball river book garden car window tree "
         "market road today slowly again near sea with care at night before lunch red new old "
         "small long green quiet every morning in rain").split()
SPECIAL = ["<pad>", "<unk>", "<|endoftext|>"]


def sentences(n: int, seed: int = 0) -> list[str]:
    """n short lines of words from WORDS."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(n)]


def save_model(path: str, dropout: float = 0.1) -> None:
    """Tokenizer and a tiny GPT-2 (2 layers, 64 wide, dropout on) into `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + sorted(set(WORDS)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                        unk_token="<unk>", bos_token="<|endoftext|>",
                                        eos_token="<|endoftext|>", model_max_length=64)
    tokenizer.save_pretrained(path)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=len(vocab),
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)


def save_text(path: str, n: int = 64) -> None:
    """A JSON-lines file of {"text": ...} records."""
    with open(path, "w") as fh:
        for line in sentences(n):
            fh.write(json.dumps({"text": line}) + "\n")


#: The Hugging Face docs' ZeRO-3 config ("auto" everywhere the Trainer fills in), CPU offload.
DS_ZERO3 = {
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def write_assets(root: str) -> dict[str, str]:
    """Everything above under `root`; returns the paths by name."""
    paths = {"model": os.path.join(root, "tiny-gpt2"), "data": os.path.join(root, "data"),
             "ds_zero3": os.path.join(root, "ds_zero3.json")}
    save_model(paths["model"])
    os.makedirs(paths["data"], exist_ok=True)
    save_text(os.path.join(paths["data"], "train.jsonl"))
    with open(paths["ds_zero3"], "w") as fh:
        json.dump(DS_ZERO3, fh)
    return paths
