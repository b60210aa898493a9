"""Throughput and model FLOPs utilization (MFU).

Model FLOPs per token are 6 x parameters (forward 2N, backward 4N: the convention MFU is quoted
in, without the attention term and without recomputation). MFU is the achieved model FLOP/s of
one device over that device's dense peak for the compute dtype, from a small table of well-known
accelerators; on a CPU, or a device not in the table, MFU is unknown (None) and not printed.
"""

from __future__ import annotations

import torch

#: Dense (non-sparse) peak TFLOP/s per device: (name fragment, 16-bit tensor cores, fp32 without
#: TF32). Matched against the device name in order, so more specific names come first.
PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),
    ("H200", 989.0, 67.0),
    ("H800", 989.0, 67.0),
    ("GH200", 989.0, 67.0),
    ("B200", 2250.0, 80.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("A10", 125.0, 31.2),
    ("V100", 125.0, 15.7),
    ("MI300X", 1307.0, 163.4),
]


def peak_flops(device: torch.device, dtype: torch.dtype | None) -> float | None:
    """Dense peak FLOP/s of `device` for `dtype` (None: fp32), or None when not known (CPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, half, single in PEAK_TFLOPS:
        if fragment in name:
            fp32_tf32 = torch.backends.cuda.matmul.allow_tf32
            # fp32 matmuls on tensor cores (TF32) peak at half the 16-bit rate.
            tflops = half if dtype in (torch.float16, torch.bfloat16) else \
                half / 2 if fp32_tf32 else single
            return tflops * 1e12
    return None


def model_flops_per_token(num_params: int) -> float:
    """Training FLOPs per token (forward and backward) of a model with `num_params` parameters."""
    return 6.0 * num_params


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1] (None when the peak is unknown)."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_s_per_device * flops_per_token / peak


def count_tokens(args: tuple, kwargs: dict) -> tuple[int | None, int | None]:
    """`(samples, tokens)` of one forward's inputs: `input_ids` (keyword, or the first integer
    tensor of two or more dimensions) gives both; otherwise the first tensor's leading dimension
    gives the samples and tokens are unknown (None)."""
    ids = kwargs.get("input_ids")
    tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
    if ids is None:
        ids = next((t for t in tensors if not t.is_floating_point() and not t.is_complex()
                    and t.dtype != torch.bool and t.dim() >= 2), None)
    if torch.is_tensor(ids) and ids.dim() >= 1:
        return int(ids.shape[0]), int(ids.numel()) if ids.dim() >= 2 else None
    if tensors and tensors[0].dim() >= 1:
        return int(tensors[0].shape[0]), None
    return None, None
