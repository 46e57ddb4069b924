"""Loading that scales: each rank reads only its own part of a safetensors checkpoint.

Loading a model whole on every rank and sharding it afterwards needs the whole model in every process
at once. Here the model is built without its weights and each rank reads, from the checkpoint files,
exactly the bytes it keeps:

| backend | built as | filled by |
|---|---|---|
| FSDP2 | parameters on the meta device, buffers real (`accelerate.init_empty_weights(include_buffers=False)`) | the engine shards it (:func:`~hf_verl.parallel.fsdp.apply_fsdp`), allocates the local shards (`to_empty`), then :func:`load_fsdp_shards` reads each shard's rows |
| DeepSpeed ZeRO-3 | under `deepspeed.zero.Init` (each parameter partitioned as its module is built) | :func:`load_zero3_partitions` reads each partition's flat element range |

Both read with plain positioned file reads (:class:`SafetensorsCheckpoint`, over the safetensors
format: an 8-byte header length, a JSON header, then row-major little-endian data): a dim-0 shard of a
row-major tensor, and a flat ZeRO partition, is one contiguous byte range, so no rank reads, maps or
holds another rank's bytes and no collective runs. (`safetensors.safe_open` memory-maps the file,
and the mapped pages a rank touches count in its resident memory until the file is closed.)

A model built for FSDP2 carries its checkpoint (:data:`CHECKPOINT_ATTR`) until the engine fills it;
a copy of it carries it too and is filled from the same files by its own engine. Entry point:
:func:`load_sharded`; :func:`sharded_load_applies` says when a launch takes this path (FSDP2 or ZeRO-3
over 2 or more data-parallel shards). For the trainers' roles (`trainers/engine_glue.load_for_launch`):
:func:`reference_copy` (a frozen role, itself loaded sharded), :func:`whole_copy` (the generation replica,
read whole), :func:`loaded_sharded` (a model no rank holds whole: not to be moved) and :func:`state_sums`
(weight sums read from the checkpoint).
"""

from __future__ import annotations

import copy
import glob
import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

CHECKPOINT_ATTR = "hf_verl_pending_checkpoint"
SOURCE_ATTR = "hf_verl_loaded_from"  # (checkpoint directory, dtype) of a model load_sharded built; stays after filling

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file: the file, its dtype and shape, and the absolute byte offset
    of its first element."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str) -> dict[str, TensorEntry]:
    """The tensors of one `.safetensors` file, from its header (no tensor data is read).

    Raises:
        ValueError: a file that is not safetensors, or a dtype this reader does not know.
    """
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length).")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a safetensors file (its header is not JSON): {err}") from err
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which sharded loading does not read "
                             f"(it reads {sorted(_DTYPES)}); load this model whole instead.")
        out[name] = TensorEntry(path, dtype, tuple(info["shape"]), 8 + size + int(info["data_offsets"][0]))
    return out


class SafetensorsCheckpoint:
    """The safetensors files of one checkpoint directory (`model.safetensors`, or the shards named by
    `model.safetensors.index.json`), read by element range.

    Args:
        directory (`str`): a local directory holding the checkpoint.

    Raises:
        FileNotFoundError: the directory holds no `.safetensors` file.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            paths = [os.path.join(directory, name) for name in files]
        else:
            paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not paths:
            raise FileNotFoundError(f"no .safetensors file in {directory}: sharded loading reads safetensors only; save "
                                    "the model with save_pretrained(safe_serialization=True), or pass it loaded.")
        self.entries: dict[str, TensorEntry] = {}
        for path in paths:
            self.entries.update(read_header(path))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the checkpoint {self.directory}.") from None

    def read_flat(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements `[start, stop)` of tensor `name` flattened (row-major), as a 1-D tensor of the checkpoint's
        dtype; read into `out` (a contiguous CPU tensor of that dtype and `stop - start` elements) when given."""
        entry = self.entry(name)
        if not 0 <= start <= stop <= entry.numel:
            raise ValueError(f"elements [{start}, {stop}) are outside {name!r}, which has {entry.numel}.")
        if out is None:
            out = torch.empty(stop - start, dtype=entry.dtype)
        elif (out.dtype != entry.dtype or out.device.type != "cpu" or not out.is_contiguous()
              or out.numel() != stop - start):
            raise ValueError(f"read_flat({name!r}) needs a contiguous CPU {entry.dtype} tensor of {stop - start} "
                             f"elements, got {out.dtype} {tuple(out.shape)} on {out.device}.")
        if stop == start:
            return out
        width = out.element_size()
        view = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
        with open(entry.file, "rb", buffering=0) as f:
            f.seek(entry.offset + start * width)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{entry.file} ends inside tensor {name!r}: the file is truncated.")
                done += n
        return out

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `[start, stop)` (along dim 0) of tensor `name`, shaped `(stop - start, *shape[1:])`."""
        entry = self.entry(name)
        if not entry.shape:
            if (start, stop) != (0, 1):
                raise ValueError(f"{name!r} is a scalar: read it as rows [0, 1).")
            return self.read_flat(name, 0, 1, None if out is None else out.view(-1)).view(())
        row = math.prod(entry.shape[1:])
        flat = self.read_flat(name, start * row, stop * row, None if out is None else out.view(-1))
        return flat.view(stop - start, *entry.shape[1:])


def shard_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """`[start, stop)` of part `index` when `length` rows are cut into `parts` as `torch.chunk` cuts them (FSDP2's
    dim-0 sharding): chunks of `ceil(length / parts)`, the last ones shorter or empty."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} does not exist.")
    chunk = -(-length // parts)
    start = min(index * chunk, length)
    return start, min(start + chunk, length)


def partition_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """`[start, stop)` of the flat elements ZeRO-3 partition `index` of `parts` holds: `numel` padded up to a
    multiple of `parts`, cut evenly (DeepSpeed's `_partition_param`); the padding is not in the checkpoint."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"partition {index} of {parts} does not exist.")
    size = -(-numel // parts)
    start = min(index * size, numel)
    return start, min(start + size, numel)


# ---------------------------------------------------------------------------------------------- building


def resolve_checkpoint(model_id: str) -> str:
    """The local directory of `model_id`: itself when it is one, else its Hub snapshot (config and safetensors
    files only, through huggingface_hub's cache; `HF_HUB_OFFLINE` is honoured)."""
    if os.path.isdir(model_id):
        return model_id
    from huggingface_hub import snapshot_download

    return snapshot_download(model_id, allow_patterns=["*.json", "*.safetensors"])


def sharded_load_applies(layout: Any) -> bool:
    """Whether a role on `layout` (a :class:`~hf_verl.engine.registry.RoleLayout`) loads sharded: the accelerate
    engine on FSDP2 or DeepSpeed ZeRO-3 with 2 or more data-parallel shards."""
    backend, dims = layout.backend, layout.dims
    sharded = backend.kind == "fsdp2" or (backend.kind == "deepspeed" and backend.zero_stage == 3)
    return getattr(layout, "engine", "accelerate") == "accelerate" and sharded and dims.dp_shard >= 2


def _auto_class(auto_class):
    if auto_class is not None:
        return auto_class
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def _config(model_id: str, trust_remote_code: bool, config_kwargs: dict):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code, **config_kwargs)


def _finish(model: nn.Module, directory: str) -> nn.Module:
    """What `from_pretrained` also does: the generation config from the checkpoint, eval mode."""
    if os.path.exists(os.path.join(directory, "generation_config.json")):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.eval()


def empty_model(model_id: str, *, auto_class=None, dtype: torch.dtype = torch.float32,
                trust_remote_code: bool = False, **config_kwargs: Any) -> nn.Module:
    """`model_id`'s architecture with its parameters on the meta device (buffers real), carrying the checkpoint
    directory in :data:`CHECKPOINT_ATTR` for :func:`load_fsdp_shards`.

    Args:
        model_id (`str`): a local directory or a Hub id (resolved through the Hub cache).
        auto_class (*optional*): the transformers auto class (default `AutoModelForCausalLM`).
        dtype (`torch.dtype`): the parameters' dtype (the checkpoint's is converted on reading).
        trust_remote_code (`bool`): as in `from_pretrained`.
        config_kwargs: overrides of the config (e.g. `num_labels=1`).

    Returns:
        `nn.Module`: in eval mode, as `from_pretrained` returns it.
    """
    from accelerate import init_empty_weights
    from transformers.initialization import no_init_weights

    directory = resolve_checkpoint(model_id)
    SafetensorsCheckpoint(directory)  # fail now, with the reason, on a checkpoint without safetensors
    config = _config(model_id, trust_remote_code, config_kwargs)
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = _auto_class(auto_class).from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # no_init_weights skips it; from_pretrained ties after loading
    setattr(model, CHECKPOINT_ATTR, directory)
    setattr(model, SOURCE_ATTR, (directory, dtype))
    return _finish(model, directory)


def pending_checkpoint(model: nn.Module) -> str | None:
    """The checkpoint directory `model` still has to be filled from (built by :func:`empty_model`), or None."""
    directory = getattr(model, CHECKPOINT_ATTR, None)
    if directory is None or not any(p.is_meta for p in model.parameters()):
        return None
    return directory


def _unique_parameters(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each parameter once, with every name it is registered under (tied weights have several)."""
    by_id: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), ([], param))[0].append(name)
    return list(by_id.values())


def _checkpoint_name(names: list[str], checkpoint: SafetensorsCheckpoint, missing: list[str]) -> str | None:
    for name in names:
        if name in checkpoint:
            return name
    missing.append(names[0])
    return None


def _check_shape(name: str, entry: TensorEntry, shape) -> None:
    if tuple(entry.shape) != tuple(shape):
        raise ValueError(f"{name!r} is {tuple(entry.shape)} in the checkpoint but {tuple(shape)} in the model: the "
                         "config does not describe these weights.")


def _fill(local: torch.Tensor, checkpoint: SafetensorsCheckpoint, name: str, start: int, stop: int, *,
          rows: bool) -> None:
    """Read rows (or flat elements) `[start, stop)` of `name` into `local`, in place, converting the dtype."""
    read = checkpoint.read_rows if rows else checkpoint.read_flat
    entry = checkpoint.entry(name)
    if local.dtype == entry.dtype and local.device.type == "cpu" and local.is_contiguous():
        read(name, start, stop, out=local)
    else:
        local.copy_(read(name, start, stop).view(local.shape))


def _report(missing: list[str], used: set[str], checkpoint: SafetensorsCheckpoint, model: nn.Module) -> None:
    if missing:
        raise ValueError(f"the checkpoint {checkpoint.directory} has no weights for {len(missing)} parameter(s) of "
                         f"{type(model).__name__}: {missing[:5]}; sharded loading reads checkpoint names as the model "
                         "names its parameters: pass the model loaded (from_pretrained) instead.")
    unused = sorted(set(checkpoint.entries) - used)
    if unused:
        logger.warning("sharded load: %d checkpoint tensor(s) the model does not use, e.g. %s", len(unused), unused[:3])


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The local tensor of a parameter and the global rows `[start, stop)` it holds (FSDP2 shards dim 0)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, 0, param.shape[0] if param.dim() else 1
    start, stop = 0, param.shape[0]
    mesh = param.device_mesh
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise ValueError(f"sharded loading reads dim-0 shards; a parameter is sharded on dim {placement.dim}.")
            a, b = shard_range(stop - start, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
            start, stop = start + a, start + b
        elif not placement.is_replicate():
            raise ValueError(f"sharded loading cannot place {placement} parameters.")
    return param.to_local(), start, stop


@torch.no_grad()
def load_fsdp_shards(model: nn.Module, device: torch.device | str = "cpu") -> None:
    """Allocate the local shards of a model built by :func:`empty_model` and sharded with FSDP2, and read each
    rank's rows from the checkpoint (buffers keep the values they were built with, unless the checkpoint has them).

    Args:
        model (`nn.Module`): the FSDP2-sharded model, parameters still on the meta device.
        device: where the shards live (the CPU under parameter offload).

    Raises:
        ValueError: the model is not pending, a parameter is missing from the checkpoint, or a shape differs.
    """
    directory = pending_checkpoint(model)
    if directory is None:
        raise ValueError("load_fsdp_shards: the model has no pending checkpoint (build it with empty_model()).")
    local, total = _fill_pending(model, directory, device)
    logger.info("sharded load (FSDP2): %s read, this rank's rows only (%d of %d parameter elements)", directory,
                local, total)


@torch.no_grad()
def _fill_pending(model: nn.Module, directory: str, device: torch.device | str) -> tuple[int, int]:
    """Allocate a pending model's parameters on `device` and read, for each one, the rows this rank holds (all of
    them for a parameter that is not a DTensor). Returns (elements read, elements of the whole model)."""
    checkpoint = SafetensorsCheckpoint(directory)
    buffers = {name: buf for name, buf in model.named_buffers() if not buf.is_meta}
    model.to_empty(device=device)
    for name, buf in model.named_buffers():
        if name in checkpoint:
            _check_shape(name, checkpoint.entry(name), buf.shape)
            buf.copy_(checkpoint.read_rows(name, 0, buf.shape[0]) if buf.dim() else checkpoint.read_flat(name, 0, 1))
        elif name in buffers:
            buf.copy_(buffers[name])
    missing: list[str] = []
    used: set[str] = set(name for name, _ in model.named_buffers())
    read = total = 0
    for names, param in _unique_parameters(model):
        name = _checkpoint_name(names, checkpoint, missing)
        if name is None:
            continue
        used.update(names)
        _check_shape(name, checkpoint.entry(name), param.shape)
        local, start, stop = _local_rows(param)
        if stop > start:
            _fill(local, checkpoint, name, start, stop, rows=True)
        read += local.numel()
        total += param.numel()
    _report(missing, used, checkpoint, model)
    setattr(model, CHECKPOINT_ATTR, None)
    return read, total


@torch.no_grad()
def load_zero3_partitions(model: nn.Module, directory: str) -> None:
    """Read each ZeRO-3 parameter's partition (this rank's flat element range) from the checkpoint.

    Raises:
        ValueError: a parameter that is not ZeRO-3 partitioned, or partitioned to NVMe, or missing from the
            checkpoint.
    """
    import torch.distributed as dist

    checkpoint = SafetensorsCheckpoint(directory)
    missing: list[str] = []
    used: set[str] = set()
    read = total = 0
    for names, param in _unique_parameters(model):
        if not hasattr(param, "ds_tensor"):
            raise ValueError(f"{names[0]} is not ZeRO-3 partitioned: build the model under deepspeed.zero.Init.")
        part = param.ds_tensor
        if str(getattr(part, "final_location", "")).endswith("nvme"):
            raise ValueError("sharded loading does not write NVMe-offloaded partitions; offload parameters to the CPU.")
        name = _checkpoint_name(names, checkpoint, missing)
        if name is None:
            continue
        used.update(names)
        _check_shape(name, checkpoint.entry(name), param.ds_shape)
        parts = dist.get_world_size(group=param.ds_process_group)
        start, stop = partition_range(param.ds_numel, parts, dist.get_rank(group=param.ds_process_group))
        flat = part.view(-1)
        _fill(flat[: stop - start], checkpoint, name, start, stop, rows=False)
        flat[stop - start:].zero_()
        read, total = read + (stop - start), total + param.ds_numel
    for name, buf in model.named_buffers():
        if name in checkpoint:
            used.add(name)
            buf.copy_(checkpoint.read_flat(name, 0, buf.numel()).view(buf.shape))
    _report(missing, used, checkpoint, model)
    logger.info("sharded load (ZeRO-3): %s read, this rank's partitions only (%d of %d parameter elements)",
                directory, read, total)


def zero3_model(model_id: str, ds_config: dict, *, auto_class=None, dtype: torch.dtype = torch.float32,
                trust_remote_code: bool = False, **config_kwargs: Any) -> nn.Module:
    """`model_id` built under `deepspeed.zero.Init(ds_config)` (every parameter partitioned as its module is
    built) and filled with :func:`load_zero3_partitions`. Arguments as :func:`empty_model`; `ds_config` is the
    role's DeepSpeed config (:func:`hf_verl.parallel.deepspeed.deepspeed_config`), whose bf16 / fp16 section
    decides the partitions' dtype as it does in `deepspeed.initialize`."""
    import deepspeed
    from transformers.initialization import no_init_weights

    directory = resolve_checkpoint(model_id)
    SafetensorsCheckpoint(directory)
    config = _config(model_id, trust_remote_code, config_kwargs)
    # the partitions' dtype is the config's (bf16 / fp16 section, else float32), as in deepspeed.initialize: an explicit
    # `dtype=` is ignored by DeepSpeed 0.19's zero.Init on a device without fp16 (the CPU), which then picks bf16
    with deepspeed.zero.Init(config_dict_or_path=ds_config), no_init_weights():
        model = _auto_class(auto_class).from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # no_init_weights skips it; from_pretrained ties after loading
    load_zero3_partitions(model, directory)
    setattr(model, SOURCE_ATTR, (directory, dtype))
    return _finish(model, directory)


def load_sharded(model_id: str, layout: Any, *, auto_class=None, dtype: torch.dtype = torch.float32,
                 trust_remote_code: bool = False, bf16: bool = False, fp16: bool = False,
                 **config_kwargs: Any) -> nn.Module:
    """Load `model_id` for a role on `layout` without any rank holding the whole model.

    Under FSDP2 the model comes back with its parameters on the meta device: the accelerate engine of the
    role shards it and reads this rank's rows (`make_engine(model, role, layout)`). Under ZeRO-3 it comes back
    partitioned and filled; the engine hands it to `deepspeed.initialize` as it is.

    Args:
        model_id (`str`): a local directory or a Hub id holding safetensors weights.
        layout ([`RoleLayout`]): the role's layout; :func:`sharded_load_applies` must hold.
        auto_class / dtype / trust_remote_code / config_kwargs: as in :func:`empty_model`.
        bf16 / fp16 (`bool`): the run's mixed precision (ZeRO-3 partitions take the DeepSpeed config's dtype).

    Returns:
        `nn.Module`: the model, pending (FSDP2) or partitioned (ZeRO-3).

    Raises:
        ValueError: `layout` is not FSDP2 / ZeRO-3 over 2+ shards.
    """
    if not sharded_load_applies(layout):
        raise ValueError(f"sharded loading needs FSDP2 or DeepSpeed ZeRO-3 over 2 or more data-parallel shards; the "
                         f"layout is {layout.label}: load the model with from_pretrained instead.")
    if layout.backend.kind == "fsdp2":
        return empty_model(model_id, auto_class=auto_class, dtype=dtype, trust_remote_code=trust_remote_code,
                           **config_kwargs)
    from hf_verl.parallel.deepspeed import deepspeed_config

    config = deepspeed_config(layout.backend, micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=None,
                              bf16=bf16, fp16=fp16, trainable=False)
    return zero3_model(model_id, config, auto_class=auto_class, dtype=dtype, trust_remote_code=trust_remote_code,
                       **config_kwargs)


# ---------------------------------------------------------------------------------------------- the trainers' roles


def loaded_sharded(model: nn.Module) -> bool:
    """Whether `model` came from :func:`load_sharded` and no rank holds it whole: its parameters are still on the
    meta device (FSDP2, filled by its engine) or partitioned by ZeRO-3. Such a model must not be moved
    (`.to(device)`) or copied with `copy.deepcopy` + weights; its engine places it."""
    if getattr(model, SOURCE_ATTR, None) is None:
        return False
    return any(p.is_meta or hasattr(p, "ds_id") for p in model.parameters())


def _rebuild_empty(model: nn.Module) -> nn.Module:
    """A new model of `model`'s class and config, parameters on the meta device, pending on the same checkpoint."""
    from accelerate import init_empty_weights
    from transformers.initialization import no_init_weights

    directory, dtype = getattr(model, SOURCE_ATTR)
    with init_empty_weights(include_buffers=False), no_init_weights():
        out = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
    out.tie_weights()
    setattr(out, CHECKPOINT_ATTR, directory)
    setattr(out, SOURCE_ATTR, (directory, dtype))
    return _finish(out, directory)


def whole_copy(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """A whole, frozen (eval, no gradients) copy of a model :func:`load_sharded` built, read from its checkpoint onto
    `device`: the trainers' generation replica under a sharded actor (generation needs every weight on every rank;
    weight sync keeps it in step afterwards). This rank reads the whole checkpoint, one tensor at a time.

    Raises:
        ValueError: `model` was not built by :func:`load_sharded`.
    """
    if getattr(model, SOURCE_ATTR, None) is None:
        raise ValueError("whole_copy: the model was not built by load_sharded; copy it with frozen_copy instead.")
    out = _rebuild_empty(model)
    directory = getattr(out, CHECKPOINT_ATTR)
    _fill_pending(out, directory, device)
    logger.info("generation replica: %s read whole", directory)
    return out.requires_grad_(False)


def reference_copy(model: nn.Module, layout: Any, *, bf16: bool = False, fp16: bool = False) -> nn.Module:
    """A frozen copy of a model :func:`load_sharded` built, itself loaded sharded for `layout`: under FSDP2 a
    pending meta copy its own engine fills, under ZeRO-3 a new `zero.Init` build filled with this rank's
    partitions. No rank holds it whole.

    Raises:
        ValueError: `model` was not built by :func:`load_sharded`.
    """
    if getattr(model, SOURCE_ATTR, None) is None:
        raise ValueError("reference_copy: the model was not built by load_sharded; copy it with frozen_copy instead.")
    if layout.backend.kind == "fsdp2":
        return _rebuild_empty(model).requires_grad_(False)
    import deepspeed
    from transformers.initialization import no_init_weights

    from hf_verl.parallel.deepspeed import deepspeed_config

    directory, dtype = getattr(model, SOURCE_ATTR)
    config = deepspeed_config(layout.backend, micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=None,
                              bf16=bf16, fp16=fp16, trainable=False)
    with deepspeed.zero.Init(config_dict_or_path=config), no_init_weights():  # the config's dtype (zero3_model)
        out = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
    out.tie_weights()
    load_zero3_partitions(out, directory)
    setattr(out, SOURCE_ATTR, (directory, dtype))
    return _finish(out, directory).requires_grad_(False)


def state_sums(model: nn.Module) -> list[tuple[str, tuple[int, ...], float]]:
    """`(name, shape, sum in float64)` of every entry of `model.state_dict()` for a model :func:`load_sharded` built,
    read from its checkpoint one tensor at a time in the model's dtype: what the same sums over a whole load give
    (tied weights appear under each of their names, as in `state_dict`)."""
    directory, _ = getattr(model, SOURCE_ATTR)
    checkpoint = SafetensorsCheckpoint(directory)
    names_of = {id(param): names for names, param in _unique_parameters(model)}
    out = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        shape = tuple(getattr(tensor, "ds_shape", tensor.shape))
        candidates = names_of.get(id(tensor), [name])
        found = next((n for n in candidates if n in checkpoint), None)
        if found is None:
            if tensor.is_meta or hasattr(tensor, "ds_id"):
                raise ValueError(f"{name!r} is not in the checkpoint {directory}.")
            value = tensor.detach()
        else:
            value = checkpoint.read_flat(found, 0, math.prod(shape)).view(shape).to(tensor.dtype)
        out.append((name, shape, float(value.double().sum().item())))
    return out
