"""The Hugging Face stack, unchanged, on zeroshard under `zeroshard run` (2 CPU ranks, tiny local
models, no hub): the real `accelerate.Accelerator` in the seed's loop from an `accelerate config`
YAML at stages 2 and 3, transformers' Trainer with `--deepspeed` (the docs' "auto" ZeRO-3 config
with CPU offload) training, saving, reloading with from_pretrained and resuming bitwise, TRL's own
`sft.py` and `grpo.py` (generation between steps) at stage 3, accelerate's DeepSpeed environment
from the launcher, `Accelerator()` and the Trainer without DeepSpeed forming one CPU group, and
the launcher's refusal of a job given a DeepSpeed config that builds no engine (the package
metadata the workers see is checked in test_launcher_flags.py). Each launch is one real job; they
are few and small."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.accelerate_seed_loop import CausalLM  # noqa: E402
from tests.test_accelerate import _worst, reference  # noqa: E402

ROOT = Path(__file__).parent.parent
TESTS = ROOT / "tests"
SHIM = ROOT / "src" / "zeroshard" / "compat" / "deepspeed" / "_deepspeed_shim"
WORLD = 2


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(ZEROSHARD_QUIET="1", PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def launch(args: list[str], cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """`zeroshard run ARGS` as a user types it, in `cwd`."""
    return subprocess.run([sys.executable, "-m", "zeroshard.cli", "run", *args],
                          capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd)


def _ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]


# -- what the launcher gives its workers ------------------------------------------------------------
def test_launcher_turns_an_accelerate_yaml_into_accelerates_deepspeed_environment(tmp_path):
    from zeroshard.cli.launch import prepare_run_args
    from tests.test_accelerate import write_yaml

    script = tmp_path / "train.py"
    script.write_text("import accelerate\n")
    config = write_yaml(tmp_path / "acc.yaml", 3, "cpu", "cpu", gas=2)
    env = prepare_run_args(["--config_file", config, str(script)]).zeroshard_env
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert (env["ACCELERATE_DEEPSPEED_ZERO_STAGE"], env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"],
            env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"],
            env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"],
            env["ACCELERATE_DEEPSPEED_ZERO3_INIT"]) == ("3", "2", "cpu", "cpu", "false")
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"
    assert set(env["ACCELERATE_CONFIG_DS_FIELDS"].split(",")) >= {"zero_stage", "mixed_precision"}
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(SHIM)
    assert env["ZEROSHARD_WORKER_HOOKS"] == "1" and "ACCELERATE_USE_CPU" not in env
    off = prepare_run_args(["--no-alias-deepspeed", "--config_file", config, str(script)])
    assert "ZEROSHARD_WORKER_HOOKS" not in off.zeroshard_env


# -- the seed's loop with the real accelerate -------------------------------------------------------
STAGE3_JSON = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
               "gradient_clipping": 1.0, "train_batch_size": "auto",
               "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                     "offload_param": {"device": "cpu"},
                                     "stage3_param_persistence_threshold": 0}}


@pytest.mark.parametrize("stage", [2, 3])
def test_seed_loop_with_real_accelerate_engages_zero(stage, tmp_path):
    """`zeroshard run --config_file accelerate.yaml seed.py`: at stage 2 the YAML's own ZeRO
    settings, at stage 3 its deepspeed_config_file (every parameter partitioned); both equal one
    process on the same data with accelerate's default clipping (1.0)."""
    from tests.test_accelerate import write_yaml

    config = write_yaml(tmp_path / "acc.yaml", 2, "cpu")
    if stage == 3:
        (tmp_path / "ds.json").write_text(json.dumps(STAGE3_JSON))
        text = Path(config).read_text()
        head, tail = text.split("deepspeed_config:\n", 1)
        # As `accelerate config` writes it: with a config file, no ZeRO keys and no precision.
        tail = "\n".join(line for line in tail.splitlines()
                         if not line.startswith("  ") and not line.startswith("mixed_precision"))
        Path(config).write_text(head + "deepspeed_config:\n  deepspeed_config_file: ds.json\n"
                                "  zero3_init_flag: false\n" + tail + "\n")
    res = launch(["--config_file", config, str(TESTS / "accelerate_seed_loop.py"),
                  "--out", str(tmp_path)], tmp_path)
    _ok(res)
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["world"], result["stage"], result["distributed_type"]) == \
        (WORLD, stage, "DEEPSPEED")
    assert result["engine"] == "zeroshard.engine" and result["offload"]["device"] == "cpu"
    got = {k: torch.tensor(v) for k, v in result["weights"].items()}
    assert _worst(got, reference(clip=1.0)) < 1e-5
    # TRL's prepare_deepspeed over a frozen copy (no trainable parameter, no optimizer): the
    # trained model's loss, no gradients or optimizer state, partitioned at stage 3 but for
    # the tensors under TRL's persistence threshold (TRL leaves other stages at 0, whole).
    ref = result["reference"]
    assert ref["stage"] == (3 if stage == 3 else 0) and ref["grads_and_optimizer"] == 0, ref
    assert ref["loss"] == pytest.approx(ref["trained_loss"], rel=1e-6), ref
    held, total = ref["elements"]
    assert held < total / 2 if stage == 3 else held == total, ref
    if stage == 3:
        assert result["offload_param"]["device"] == "cpu"
        # Saving partitioned parameters outside a gather: the pickle refuses, state_dict warns.
        assert "GatheredParameters" in result["unsaved_errors"][0]
        # DeepSpeed-Chat's save_zero_three_model pattern (ds_id + GatheredParameters) loads.
        saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
        model = CausalLM()
        missing, unexpected = model.load_state_dict(saved, strict=False)
        assert not unexpected and missing == ["lm.head.weight"]  # tied to the embedding
        assert _worst(got, {n: p.detach() for n, p in model.named_parameters()}) == 0.0


def test_accelerator_cpu_true_under_a_deepspeed_yaml_is_an_error(tmp_path):
    """accelerate drops DeepSpeed for Accelerator(cpu=True): under a DEEPSPEED config the
    worker stops and says so, instead of training without ZeRO."""
    from tests.test_accelerate import write_yaml

    config = write_yaml(tmp_path / "acc.yaml", 2, world=1)
    script = tmp_path / "cpu.py"
    script.write_text("from accelerate import Accelerator\nAccelerator(cpu=True)\n")
    res = launch(["--config_file", config, "--nproc-per-node", "1", str(script)], tmp_path)
    assert res.returncode != 0
    assert "distributed_type: DEEPSPEED" in res.stderr and "cpu=True" in res.stderr


PLAIN_ACCELERATE = """
import json, os, sys, torch
from accelerate import Accelerator
from transformers import Trainer, TrainingArguments

acc = Accelerator()
seen = {"type": str(acc.distributed_type), "processes": acc.num_processes,
        "index": acc.process_index, "local": acc.local_process_index,
        "gathered": acc.gather(torch.tensor([acc.process_index * 10 + 1])).tolist()}


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}


g = torch.Generator().manual_seed(0)
data = [{"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)} for _ in range(8)]
args = TrainingArguments(output_dir=sys.argv[1], max_steps=2, per_device_train_batch_size=2,
                         report_to="none", save_strategy="no", learning_rate=0.1, seed=0)
trainer = Trainer(model=Linear(), args=args, train_dataset=data)
trainer.train()
state = trainer.accelerator.state
seen["trainer"] = {"type": str(state.distributed_type), "processes": state.num_processes,
                   "world": args.world_size, "wrapped": type(trainer.model_wrapped).__name__}
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as fh:
    json.dump(seen, fh)
"""


def test_plain_accelerator_and_trainer_on_cpu_ranks_form_one_group(tmp_path):
    """No config, no DeepSpeed, no cpu=True: `Accelerator()` and transformers' Trainer in two
    workers on a CPU-only host form one gloo group (MULTI_CPU), as with cpu=True, instead of
    accelerate's two single-process runs (DistributedType.NO); rank 0 says so once."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA accelerate picks its own backend and the hook stays out")
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_ACCELERATE)
    res = launch([str(script), str(tmp_path)], tmp_path)
    _ok(res)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, got in enumerate(seen):
        assert (got["type"], got["processes"], got["index"], got["local"]) == \
            ("DistributedType.MULTI_CPU", WORLD, rank, rank), got
        assert got["gathered"] == [1, 11], got  # an all-gather across both workers
        assert got["trainer"] == {"type": "DistributedType.MULTI_CPU", "processes": WORLD,
                                  "world": WORLD, "wrapped": "DistributedDataParallel"}, got
    assert res.stderr.count("accelerate's 2 workers form one gloo group") == 1, res.stderr[-3000:]


# -- transformers' Trainer and TRL with --deepspeed -------------------------------------------------
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from tests.hf_assets import write_assets

    return write_assets(str(tmp_path_factory.mktemp("hf")))


def _trainer(assets, out, *extra) -> subprocess.CompletedProcess:
    return launch([str(TESTS / "hf_trainer_script.py"), "--model_dir", assets["model"],
                   "--train_file", os.path.join(assets["data"], "train.jsonl"),
                   "--output_dir", out, "--deepspeed", assets["ds_zero3"], "--max_steps", "4",
                   "--save_steps", "2", "--per_device_train_batch_size", "2",
                   "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none",
                   "--seed", "0", *extra], os.path.dirname(out))


def test_trainer_with_deepspeed_zero3_offload_trains_saves_and_resumes_bitwise(assets, tmp_path):
    """run_clm-style: the docs' "auto" ZeRO-3 + CPU-offload config drives zeroshard; the model is
    partitioned while training; the saved model loads with from_pretrained; a run resumed from
    checkpoint-2 ends bitwise equal to the uninterrupted one (dropout on)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    _ok(_trainer(assets, full))
    probe = json.loads(Path(full, "probe.json").read_text())
    assert (probe["deepspeed"], probe["zero3"], probe["engine"], probe["world"]) == \
        (True, True, "zeroshard.engine", WORLD)
    assert probe["global_step"] == 4 and probe["held_at_step"] < probe["full"] / 10
    assert sorted(p for p in os.listdir(full) if p.startswith("checkpoint")) == \
        ["checkpoint-2", "checkpoint-4"]
    assert os.path.isdir(os.path.join(full, "checkpoint-2", "global_step2"))  # what resume globs
    model = AutoModelForCausalLM.from_pretrained(full)
    saved = load_file(os.path.join(full, "model.safetensors"))
    assert all(torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters()
               if n in saved)
    assert sum(p.numel() for p in model.parameters()) == probe["full"]

    _ok(_trainer(assets, resumed, "--resume_from_checkpoint",
                 os.path.join(full, "checkpoint-2")))
    again = load_file(os.path.join(resumed, "model.safetensors"))
    assert saved.keys() == again.keys()
    assert all(torch.equal(saved[k], again[k]) for k in saved)
    assert json.loads(Path(resumed, "probe.json").read_text())["losses"] == probe["losses"]


def test_trl_sft_script_at_zero3(assets, tmp_path):
    """TRL's own scripts/sft.py with --deepspeed (ZeRO-3, CPU offload) trains and saves a model
    that loads."""
    trl = pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    script = os.path.join(os.path.dirname(trl.__file__), "scripts", "sft.py")
    out = str(tmp_path / "sft")
    _ok(launch([script, "--model_name_or_path", assets["model"], "--dataset_name",
                assets["data"], "--max_steps", "3", "--per_device_train_batch_size", "2",
                "--max_length", "32", "--bf16", "False", "--logging_steps", "1",
                "--output_dir", out, "--deepspeed", assets["ds_zero3"], "--report_to", "none"],
               tmp_path))
    state = json.loads(Path(out, "checkpoint-3", "trainer_state.json").read_text())
    assert state["global_step"] == 3 and all("loss" in h for h in state["log_history"][:3])
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_trl_grpo_script_generates_between_steps_at_zero3(assets, tmp_path):
    """TRL's own scripts/grpo.py with --deepspeed (ZeRO-3, CPU offload): each step generates
    completions with the partitioned policy (TRL gathers it, removes and re-adds the engine's
    hooks around generate), scores them, trains; the saved model loads and has moved."""
    trl = pytest.importorskip("trl")
    from safetensors.torch import load_file

    from tests.hf_assets import sentences

    data = tmp_path / "prompts"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": " ".join(line.split()[:5])})
                                              + "\n" for line in sentences(32, seed=3)))
    (tmp_path / "rewards.py").write_text(  # grpo.py imports a dotted reward from the cwd
        "def words(completions, **kwargs):\n    return [float(len(c.split())) for c in completions]\n")
    script = os.path.join(os.path.dirname(trl.__file__), "scripts", "grpo.py")
    out = str(tmp_path / "grpo")
    # WarmupLR with HF's warmup of 0 holds the first two steps at lr 0 (as DeepSpeed): 3 steps.
    _ok(launch([script, "--model_name_or_path", assets["model"], "--dataset_name", str(data),
                "--reward_funcs", "rewards.words", "--num_generations", "2",
                "--per_device_train_batch_size", "2", "--max_completion_length", "6",
                "--max_steps", "3", "--learning_rate", "1e-3", "--bf16", "False",
                "--logging_steps", "1", "--output_dir", out, "--deepspeed", assets["ds_zero3"],
                "--report_to", "none"], tmp_path))
    state = json.loads(Path(out, "checkpoint-3", "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "completions/mean_length" in h]
    assert state["global_step"] == 3 and len(steps) == 3, state["log_history"]
    assert all(h["completions/mean_length"] > 0 and "reward" in h for h in steps), steps
    before = load_file(os.path.join(assets["model"], "model.safetensors"))
    after = load_file(os.path.join(out, "model.safetensors"))
    assert before.keys() <= after.keys() and after["transformer.h.0.mlp.c_fc.weight"].numel() > 0
    assert any(not torch.equal(before[k], after[k]) for k in before), "GRPO did not train"


def test_init_with_transformers_first_imported_inside_it(tmp_path):
    """A model factory that imports transformers lazily, called inside zeroshard.Init: the model
    is built partitioned with bitwise the weights of a plain construction (a fresh process, so
    transformers really is imported for the first time there)."""
    probe = """
import sys, torch, zeroshard
assert "transformers" not in sys.modules
def factory():
    import transformers
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32))
with zeroshard.Init(config={"zero_optimization": {"stage": 3}}):
    model = factory()
partitioned = all(p.numel() == 0 for p in model.transformer.h.parameters())
with zeroshard.GatheredParameters(list(model.parameters())):
    got = {k: v.clone() for k, v in model.state_dict().items()}
plain = factory().state_dict()
print(partitioned, all(torch.equal(got[k], plain[k]) for k in plain))
"""
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=_env(), timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-2:] == ["True", "True"]


def test_a_launch_given_a_deepspeed_config_that_builds_no_engine_fails(tmp_path):
    """A script handed `--deepspeed ds.json` that never builds an engine (it parses the flag and
    ignores it) ends in an error saying so; --no-zero-check lets an evaluation-only job pass."""
    script = tmp_path / "ignores.py"
    script.write_text("import argparse\nparser = argparse.ArgumentParser()\n"
                      "parser.add_argument('--deepspeed')\nparser.add_argument('--local_rank')\n"
                      "parser.parse_args()\n")
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    res = launch(["--nproc-per-node", "1", str(script), "--deepspeed", "ds.json"], tmp_path)
    assert res.returncode == 1 and "no worker built a ZeRO engine" in res.stderr
    assert "ds.json" in res.stderr
    _ok(launch(["--nproc-per-node", "1", "--no-zero-check", str(script), "--deepspeed",
                "ds.json"], tmp_path))
