"""Megatron-Core on a machine without a GPU: the CPU compatibility layer.

Megatron-Core 0.16 builds its process groups and models over gloo, but its forward and its schedules assume CUDA
in a few places: `torch.cuda.current_device()` as the device of new tensors (rotary frequencies, TP gathers, the
gradient buffers of its DDP), literal `device="cuda"` tensors (the token counters of
`pipeline_parallel/schedules.py`), the CUDA RNG state of its model-parallel RNG tracker, and
`torch.cuda.synchronize()` / streams around communication. :func:`cpu_compat` maps those onto the CPU for the
duration of a Megatron call:

- a :class:`torch.overrides.TorchFunctionMode` (thread-local, scoped: no function of torch is replaced) rewrites
  a CUDA device argument (`"cuda"`, `"cuda:0"`, `torch.device("cuda")`, or a bare device index, which torch reads
  as a CUDA device) to the CPU in tensor factories and `Tensor.to`, makes `Tensor.cuda()` a no-op, and names a CPU
  float tensor's type as its CUDA counterpart (`Tensor.type()`, which Megatron's optimizers dispatch on);
- `torch.cuda.current_device`, `synchronize`, `current_stream` / `default_stream` / `Stream` / `stream` and the
  CUDA RNG functions (`get_rng_state`, `set_rng_state`, `manual_seed`, and Megatron's own
  `_get_cuda_rng_state` / `_set_cuda_rng_state`) are pointed at CPU equivalents while the context is open and
  restored when it closes (the RNG of the tracker is the CPU generator: dropout masks drawn under the tracker's
  fork come from the CPU stream; hf_verl trains with dropout off);
- `torch.distributed.all_to_all_single` takes split sizes given as tensors (the MoE all-to-all dispatcher copies
  its splits to the host as numpy arrays from a GPU; on the CPU they stay tensors, which the collective's binding
  refuses): they are passed on as lists, while the context is open;
- `torch.distributed.all_gather` / `reduce_scatter` over lists of tensors of different first dimensions (the MoE
  dispatcher's uneven token counts under sequence parallelism; NCCL takes them, gloo refuses): the same result
  through equal-size collectives (pieces padded to the longest, then cut back; a reduce-scatter as an all-reduce of
  the whole, each rank keeping its piece), while the context is open; equal sizes go to the collective unchanged.

The engine enters it around every call into Megatron-Core; the CPU mapping applies only when CUDA is unavailable
(:func:`needed`): on a GPU machine Megatron-Core runs unmodified. Contexts nest (a reference count). On every
machine the context also hides, for the enclosed calls only, the warnings Megatron-Core raises that ask nothing
of an hf_verl user (:data:`QUIET`: Apex / fused-kernel notices, deprecations inside Megatron-Core and its use of
torch.distributed); other warnings pass.

One name is supplied on every machine, once (:func:`define_te_fallbacks`): Megatron-Core 0.16's MoE router
(`moe_utils.RouterGatingLinearFunction`) tests `te_general_gemm is not None` to choose its plain `torch.mm` path, but
defines that name only when Transformer Engine imports; without TE the test is a `NameError`. It is set to None
there, which is the value the code expects for "no TE" (nothing else of Megatron is changed).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# (category, message regex) of warnings raised inside Megatron-Core that say nothing actionable to an hf_verl user
QUIET = (
    (UserWarning, r"Apex is not installed"),
    (UserWarning, r"full scope is deprecated"),
    (UserWarning, r"When using async grad allreduce it is recommended to set the environment variable "
                  r"CUDA_DEVICE_MAX_CONNECTIONS"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"),
)

_CPU = torch.device("cpu")
_DEVICE_TYPE_NAMES = ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor")
_lock = threading.RLock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


def define_te_fallbacks() -> None:
    """Megatron-Core's MoE helpers without Transformer Engine: `te_general_gemm = None` where the import of TE
    failed (see the module docstring); a no-op where TE is installed."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def needed() -> bool:
    """Whether Megatron-Core calls need the CPU layer (no usable CUDA device)."""
    return not torch.cuda.is_available()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index is a CUDA device to torch
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CPUDevices(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # the type name Megatron dispatches on
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name in _DEVICE_TYPE_NAMES else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _NoStream:
    """A stand-in CUDA stream: work on the CPU is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoEvent:
        return _NoEvent()


class _NoEvent:
    """A stand-in CUDA event (the MoE all-to-all dispatcher waits on one after its device-to-host copies)."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_rng_get(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_set(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state)


def _all_to_all_single(collective: Any) -> Any:
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        as_list = (lambda s: s.tolist() if isinstance(s, torch.Tensor) else s)
        return collective(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs)

    return all_to_all_single


def _uneven_all_gather(collective: Any) -> Any:
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if len({t.shape for t in tensor_list} | {tensor.shape}) == 1 or async_op:
            return collective(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(t.shape[0] for t in tensor_list)
        padded = torch.zeros(longest, *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in tensor_list]
        collective(parts, padded, group=group)
        for out, part in zip(tensor_list, parts):
            out.copy_(part[: out.shape[0]])
        return None

    return all_gather


def _uneven_reduce_scatter(collective: Any) -> Any:
    import torch.distributed as dist

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if len({t.shape for t in input_list} | {output.shape}) == 1 or async_op:
            return collective(output, input_list, op=op, group=group, async_op=async_op)
        whole = torch.cat([t.reshape(t.shape[0], -1) for t in input_list]).contiguous()
        dist.all_reduce(whole, op=op, group=group)
        rank = dist.get_rank(group)
        start = sum(t.shape[0] for t in input_list[:rank])
        output.copy_(whole[start : start + output.shape[0]].reshape(output.shape))
        return None

    return reduce_scatter


def _replacements() -> list[tuple[Any, str, Any]]:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def _stream(stream: Any = None) -> Iterator[None]:
        yield

    cuda = torch.cuda
    return [
        (cuda, "current_device", lambda: _CPU),
        (cuda, "synchronize", lambda *a, **k: None),
        (cuda, "current_stream", lambda *a, **k: _NoStream()),
        (cuda, "default_stream", lambda *a, **k: _NoStream()),
        (cuda, "Stream", _NoStream),
        (cuda, "stream", _stream),
        (cuda, "get_rng_state", _cpu_rng_get),
        (cuda, "set_rng_state", _cpu_rng_set),
        (cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (cuda.random, "get_rng_state", _cpu_rng_get),
        (mrandom, "_get_cuda_rng_state", _cpu_rng_get),
        (mrandom, "_set_cuda_rng_state", _cpu_rng_set),
        (dist, "all_to_all_single", _all_to_all_single(dist.all_to_all_single)),
        (dist, "all_gather", _uneven_all_gather(dist.all_gather)),
        (dist, "reduce_scatter", _uneven_reduce_scatter(dist.reduce_scatter)),
    ]


@contextlib.contextmanager
def cpu_compat(enabled: bool | None = None) -> Iterator[None]:
    """Run the enclosed Megatron-Core calls on the CPU (see the module docstring).

    Args:
        enabled (`bool`, *optional*): force the layer on or off; by default on exactly when CUDA is unavailable.
    """
    with warnings.catch_warnings():
        for category, message in QUIET:
            warnings.filterwarnings("ignore", message=message, category=category)
        if not (needed() if enabled is None else enabled):
            yield
            return
        with _mapped():
            yield


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    global _depth
    with _lock:
        if _depth == 0:
            for owner, name, value in _replacements():
                _saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, value)
        _depth += 1
    try:
        with _CPUDevices():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _saved:
                    owner, name, value = _saved.pop()
                    setattr(owner, name, value)
