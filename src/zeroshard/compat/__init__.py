"""Everything that exists to look like another library, one subpackage per library imitated:

* `deepspeed/`: DeepSpeed's module names (`zero`, `comm`, `accelerator`, `ops`, `utils`) and the
  launcher's `import deepspeed` alias with its shim folder (package metadata, sitecustomize);
* `accelerate/`: the Accelerate look-alike (`Accelerator`, `DeepSpeedPlugin`, the `accelerate
  config` YAML, data loaders, rank helpers) and the launcher's worker hooks for accelerate;
* `hf/`: Hugging Face (`ZeroTrainer`, `from_pretrained` under stage 3, transformers' weight init
  inside `zeroshard.Init`);
* `lightning.py`: the Lightning strategy.

Nothing below this layer imports it; `import zeroshard` loads none of it (the public names reach
it on first use: `zeroshard.zero`, `.comm`, `.ops`, `.utils` are these modules). The documented
paths `zeroshard.accelerator` and `zeroshard.integrations.hf` / `.lightning` are the same module
objects as their homes here.
"""
