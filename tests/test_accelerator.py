"""`zeroshard.accelerator.get_accelerator()`: DeepSpeed's accelerator interface, checked on the
CPU for every call DeepSpeed's public examples make (and the rest of the interface)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import zeroshard
from zeroshard.accelerator import CpuAccelerator, CudaAccelerator, get_accelerator

# What DeepSpeedExamples call on get_accelerator() (surveyed: every `get_accelerator().<name>`).
EXAMPLES_CALL = ["device_name", "synchronize", "set_device", "current_device_name",
                 "memory_allocated", "empty_cache", "max_memory_allocated", "device_count",
                 "reset_peak_memory_stats", "memory_reserved", "max_memory_reserved",
                 "is_available", "_name", "total_memory", "manual_seed_all",
                 "communication_backend_name"]
# DeepSpeed's abstract accelerator interface (deepspeed/accelerator/abstract_accelerator.py).
INTERFACE = EXAMPLES_CALL + [
    "is_synchronized_device", "use_host_timers", "resolves_data_dependency",
    "handles_memory_backpressure", "device", "current_device", "random", "set_rng_state",
    "get_rng_state", "manual_seed", "initial_seed", "default_generator", "Stream", "stream",
    "current_stream", "default_stream", "Event", "reset_max_memory_allocated", "memory_cached",
    "max_memory_cached", "reset_max_memory_cached", "memory_stats", "available_memory",
    "is_bf16_supported", "is_fp16_supported", "supported_dtypes", "range_push", "range_pop",
    "lazy_call", "is_triton_supported", "create_graph", "capture_to_graph", "replay_graph",
    "BFloat16Tensor", "ByteTensor", "DoubleTensor", "FloatTensor", "HalfTensor", "IntTensor",
    "LongTensor", "pin_memory", "is_pinned", "on_accelerator", "op_builder_dir",
    "create_op_builder", "get_op_builder", "build_extension", "export_envs",
    "visible_devices_envs", "set_visible_devices_envs", "get_compile_backend",
    "set_compile_backend"]


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    if torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return get_accelerator()


@pytest.mark.parametrize("cls", [CpuAccelerator, CudaAccelerator])
def test_every_interface_name_exists(cls):
    missing = [name for name in INTERFACE if not hasattr(cls, name)]
    assert not missing


def test_public_paths():
    """`deepspeed.accelerator.get_accelerator` and `deepspeed.get_accelerator` (both used)."""
    assert zeroshard.get_accelerator is get_accelerator
    assert zeroshard.accelerator.get_accelerator is get_accelerator


def test_cpu_device_answers(cpu):
    """DeepSpeed's CPU answers: "cpu" without an index, gloo, the local rank as current device."""
    assert isinstance(cpu, CpuAccelerator) and cpu._name == "cpu"
    assert get_accelerator() is cpu  # one object per process
    assert cpu.device_name(1) == cpu.device_name() == cpu.current_device_name() == "cpu"
    assert torch.zeros(1, device=torch.device(cpu.device_name(), 1)).device.type == "cpu"
    assert cpu.current_device() == 1 and cpu.device_count() == 2 and cpu.is_available()
    assert cpu.communication_backend_name() == "gloo"
    cpu.set_device(1)
    cpu.synchronize()
    with cpu.device(0):
        pass
    assert cpu.is_bf16_supported() and torch.bfloat16 in cpu.supported_dtypes()
    assert cpu.on_accelerator(torch.zeros(1)) and cpu.pin_memory(torch.ones(2)).sum() == 2
    assert cpu.FloatTensor([1, 2]).dtype == torch.float32
    assert cpu.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    env = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}


def test_cpu_rng(cpu):
    cpu.manual_seed_all(5)
    a = torch.rand(3)
    cpu.manual_seed(5)
    assert torch.equal(a, torch.rand(3)) and cpu.initial_seed() == 5
    state = cpu.get_rng_state()
    b = torch.rand(2)
    cpu.set_rng_state(state)
    assert torch.equal(b, torch.rand(2))


def test_cpu_memory_counters_follow_the_process(cpu):
    """Resident memory rises with a large allocation and the peak keeps it after it is freed;
    a reset starts the peak again from what is resident."""
    cpu.empty_cache()
    cpu.reset_peak_memory_stats()
    before = cpu.memory_allocated()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    during = cpu.memory_allocated()
    del big
    peak = cpu.max_memory_allocated()
    assert during - before > 48 * 2**20 and peak >= during
    cpu.reset_peak_memory_stats()
    assert cpu.max_memory_allocated() < peak - 32 * 2**20
    assert cpu.memory_stats()["allocated_bytes.all.peak"] >= cpu.memory_reserved()
    assert cpu.total_memory() > cpu.available_memory() > 0


def test_cpu_streams_events_and_ranges(cpu):
    """Stream/event code written for GPUs runs on the host; events time host code."""
    stream = cpu.Stream()
    with cpu.stream(stream):
        start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
        start.record()
        torch.ones(1000).sum()
        end.record()
    stream.wait_stream(cpu.current_stream())
    cpu.current_stream().wait_event(end)
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0
    cpu.range_push("step")
    cpu.range_pop()
    assert cpu.lazy_call(lambda: 7) == 7
    with cpu.capture_to_graph(cpu.create_graph()):
        pass
    with pytest.raises(NotImplementedError, match="compiled-op builders do not exist"):
        cpu.create_op_builder("CPUAdamBuilder")


def test_ds_accelerator_selects_and_errors_name_it(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert isinstance(get_accelerator(), CpuAccelerator)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'"):
        get_accelerator()
    if not torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", "cuda")
        with pytest.raises(RuntimeError, match="DS_ACCELERATOR='cuda' but torch sees no CUDA"):
            get_accelerator()


def test_cuda_names_without_a_gpu():
    """The CUDA accelerator's pure answers (its other calls are torch.cuda's own)."""
    cuda = CudaAccelerator()
    assert (cuda.device_name(), cuda.device_name(3)) == ("cuda", "cuda:3")
    assert cuda.communication_backend_name() == "nccl" and cuda.export_envs() == ["NCCL"]
    assert cuda._name == "cuda" and not cuda.on_accelerator(torch.zeros(1))


def test_examples_snippets_run_in_a_fresh_process():
    """The lines DeepSpeed's examples start with, in a fresh process (no GPU needed)."""
    code = ("import os, torch\n"
            "from zeroshard.accelerator import get_accelerator\n"
            "local_rank = int(os.environ.get('LOCAL_RANK', 0))\n"
            "get_accelerator().set_device(local_rank)\n"
            "device = torch.device(get_accelerator().device_name(), local_rank)\n"
            "x = torch.ones(4, device=get_accelerator().device_name(local_rank))\n"
            "get_accelerator().synchronize()\n"
            "print(device.type, x.device.type, get_accelerator().communication_backend_name())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": ":".join(sys.path)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["cpu", "cpu", "gloo"]
