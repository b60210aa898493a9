"""A DeepSpeed-examples-style script, written for DeepSpeed and left that way: `import deepspeed`,
`from deepspeed.accelerator import get_accelerator`, CIFAR-10's top-level
`from deepspeed.moe.utils import ...` (used only behind a flag), HelloDeepSpeed's local_rank
taken as a function argument through a fire-style command line, CIFAR-10's config (fp16 keys
with fp16 off). tests/test_deepspeed_examples.py runs it under `zeroshard run` with DeepSpeed's
launcher flags; rank 0 writes <out>/result.json (final weights and what it saw).
"""

import json
import os
import sys

import torch
from torch import nn

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

from ds_example_model import BETAS, CLIP, EPS, LR, MICRO, SAVE_AT, STEPS, WEIGHT_DECAY, Net, dataset


def get_ds_config(stage, dtype="fp32"):
    """CIFAR-10's config, minus its scheduler."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                 "weight_decay": WEIGHT_DECAY}},
        "gradient_clipping": CLIP,
        "prescale_gradients": False,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "fp16_master_weights_and_grads": False,
                 "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True,
                              **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
    }


def train(local_rank: int = -1, stage: int = 1, out: str = ".", moe_param_group: bool = False):
    deepspeed.init_distributed()
    get_accelerator().set_device(local_rank)
    device = torch.device(get_accelerator().device_name(), local_rank) \
        if local_rank > -1 and get_accelerator().is_available() else torch.device("cpu")
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if moe_param_group:
        parameters = split_params_into_different_moe_groups_for_optimizer(parameters)
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        model=net, model_parameters=parameters, training_data=dataset(), config=get_ds_config(stage))
    local_device = get_accelerator().device_name(model_engine.local_rank)
    criterion = nn.CrossEntropyLoss()
    accel = get_accelerator()
    accel.reset_peak_memory_stats()
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    start.record()
    step = 0
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(local_device), data[1].to(local_device)
        loss = criterion(model_engine(inputs), labels)
        model_engine.backward(loss)
        model_engine.step()
        step += 1
        if step == SAVE_AT:
            ckpt = os.path.join(out, "ckpt")
            model_engine.save_checkpoint(ckpt, client_state={"checkpoint_step": step})
            _, client_state = model_engine.load_checkpoint(ckpt)
            resumed = client_state["checkpoint_step"] == step
        if step == STEPS:
            break
    end.record()
    accel.synchronize()
    seen = {
        "local_rank": local_rank, "env_local_rank": int(os.environ["LOCAL_RANK"]),
        "device": str(device), "name": accel._name, "backend": accel.communication_backend_name(),
        "device_count": accel.device_count(), "current": accel.current_device_name(),
        "memory": accel.max_memory_allocated() >= accel.memory_allocated() > 0,
        "total_memory": accel.total_memory() > 0, "elapsed_ms": start.elapsed_time(end) >= 0,
        "resumed": resumed, "affinity": sorted(os.sched_getaffinity(0)),
        "omp": os.environ.get("OMP_NUM_THREADS"), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "world": deepspeed.comm.get_world_size(), "stage": model_engine.zero_optimization_stage(),
    }
    # DeepSpeed's tests build every model's groups this way: without experts they pass through.
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": (p for p in net.parameters())})
    seen["moe_plain"] = len(groups) == 1 and \
        [id(p) for p in groups[0]["params"]] == [id(p) for p in net.parameters()]
    expert = nn.Parameter(torch.zeros(2))
    expert.allreduce = False  # how DeepSpeed's MoE layers mark an expert's parameter
    try:
        split_params_into_different_moe_groups_for_optimizer({"params": [expert], "name": "e"})
        seen["moe"] = "no error"
    except NotImplementedError as err:
        seen["moe"] = str(err)
    state = model_engine._zero3_consolidated_16bit_state_dict()
    everyone = [None] * seen["world"]
    torch.distributed.all_gather_object(everyone, seen)
    if deepspeed.comm.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump({"ranks": everyone, "weights": {k: v.tolist() for k, v in state.items()}}, fh)
    deepspeed.comm.barrier()


def _fire(fn):
    """What `fire.Fire(train)` does with --name=value / --name value, without the dependency."""
    kwargs, argv = {}, sys.argv[1:]
    defaults = dict(zip(fn.__code__.co_varnames, fn.__defaults__))
    while argv:
        name, _, value = argv.pop(0)[2:].partition("=")
        if not value:
            value = argv.pop(0)
        kwargs[name] = type(defaults[name])(value)
    fn(**kwargs)


if __name__ == "__main__":
    _fire(train)
