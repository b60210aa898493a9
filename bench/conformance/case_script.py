"""One conformance case under a launcher: `import deepspeed` is DeepSpeed's or zeroshard's.

    DS_ACCELERATOR=cpu <deepspeed venv>/bin/python -m torch.distributed.run --nproc_per_node 2 \\
        bench/conformance/case_script.py CASE OUT.json
    zeroshard run --nproc-per-node 2 bench/conformance/case_script.py CASE OUT.json

Rank 0 writes the case's records and final weights (cases.py) to OUT.json; a case the library
refuses writes {"error": "..."} instead, so the driver can show it.
"""

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed  # noqa: E402 - DeepSpeed, or zeroshard under `zeroshard run`
import torch.distributed as dist  # noqa: E402

import cases  # noqa: E402


def _let_deepspeed_run_fp16_on_this_cpu() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels; torch still
    computes fp16 on such CPUs (slowly), and the loss scaler under test is DeepSpeed's own code,
    so the oracle is told fp16 is supported. Nothing else of DeepSpeed is changed."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True
        dtypes = type(accelerator).supported_dtypes
        type(accelerator).supported_dtypes = lambda self: [*dtypes(self), __import__("torch").half]


def main() -> int:
    """Train the named case on every rank; rank 0 writes the JSON result."""
    # A launcher may add --local_rank=N (DeepSpeed's and zeroshard's do, for scripts that
    # import deepspeed).
    name, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][:2]
    world, config = cases.CASES[name]
    if not str(getattr(deepspeed, "__version__", "")).endswith("+zeroshard"):
        _let_deepspeed_run_fp16_on_this_cpu()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    try:
        result = cases.train(deepspeed, config, rank, dist.get_world_size())
    except Exception as err:  # noqa: BLE001 - reported as the case's result
        result = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:400],
                  "traceback": traceback.format_exc()[-3000:]}
    result["library"] = getattr(deepspeed, "__version__", "?")
    if rank == 0:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
