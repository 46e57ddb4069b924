"""Mixed precision for the layouts that do not cast parameters themselves.

FSDP2 computes in its `param_dtype` and DeepSpeed in its `bf16`/`fp16` config, but a model on one
process (or a DDP replica, or a frozen role beside one) holds fp32 parameters: with `bf16=True` its
matmuls must run under `torch.autocast`, as transformers' Trainer does through accelerate, or the
flag would be accepted and ignored (fp32 compute: about twice the activation memory and a fraction
of a GPU's bf16 throughput).
"""

from __future__ import annotations

import contextlib

import torch


def amp_dtype(bf16: bool, fp16: bool) -> torch.dtype | None:
    """The autocast dtype the `bf16` / `fp16` flags ask for (`None`: full precision)."""
    if bf16 and fp16:
        raise ValueError("bf16 and fp16 cannot both be set; pick one.")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """`torch.autocast` on `device`'s type in `dtype`, or a no-op context when `dtype` is `None`."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
