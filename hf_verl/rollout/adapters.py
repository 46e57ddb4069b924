"""LoRA adapters on an in-process generation model, for adapter-only weight sync (`weight_sync="adapter"`).

A transformers engine that generates on its own model (asynchronous rollout's copy of the actor, a replica of a
sharded actor) keeps the actor's base weights unmerged and a PEFT LoRA adapter beside them; each sync writes the
adapter's tensors only (:meth:`~hf_verl.rollout.hf_engine.TransformersEngine.sync_adapter`). The helpers here map
the names the trainer sends onto that model:

- the base weights arrive under the plain model's names (:func:`base_targets` finds them in a PEFT model, whose
  wrapped layers keep them under `.base_layer.`);
- the adapter arrives under the PEFT model's own `state_dict` names, adapter name included, once the adapter exists
  (:func:`with_lora_adapter` creates it from the actor's `LoraConfig`, sent as a dict).

A QLoRA actor's base is bitsandbytes-packed; a generator in full precision (`hf-verl serve`) gets it once,
dequantized to the values the actor's forward computes with (:func:`dequantized_base`).
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch

logger = logging.getLogger(__name__)

_LORA_KEY = re.compile(r"(^|\.)lora_[A-Za-z_]+(\.|$)")  # as hf_verl.parallel.weight_export names adapter tensors


def is_lora_key(name: str) -> bool:
    """Whether `name` (a PEFT model's `state_dict` key) is a LoRA adapter tensor (`lora_A`, `lora_B`, ...)."""
    return bool(_LORA_KEY.search(name))


def base_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights of `model` (a PEFT model or a plain one) under the plain model's `state_dict` names.

    Raises:
        ValueError: a PEFT model with `modules_to_save` (trained copies of base layers: not LoRA tensors).
    """
    if not callable(getattr(model, "get_base_model", None)):
        return model.state_dict(keep_vars=True)
    out = {}
    for key, tensor in model.get_base_model().state_dict(keep_vars=True).items():
        if ".modules_to_save." in key:
            raise ValueError("adapter-only weight sync moves LoRA tensors only; this model has modules_to_save "
                             f"({key!r}): set weight_sync='auto' (merged weights).")
        if is_lora_key(key) or ".original_module." in key:
            continue
        out[key.replace(".base_layer", "")] = tensor
    return out


def _json_safe(value):
    if isinstance(value, (set, frozenset)):
        return sorted(_json_safe(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):  # an enum
        return value.value
    return value


def lora_config_dict(model: torch.nn.Module, name: str) -> dict:
    """PEFT adapter `name`'s config of `model` as a JSON-safe dict (what an adapter sync sends and an
    `adapter_config.json` holds): unset fields dropped, sets as sorted lists, enums as their values."""
    return _json_safe({k: v for k, v in model.peft_config[name].to_dict().items() if v is not None})


def lora_config(config: dict):
    """A `peft.LoraConfig` for inference from `config` (its `to_dict()`, as sent by the trainer); keys this peft
    version does not take are dropped (logged)."""
    from peft import LoraConfig

    fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    ignored = sorted(set(config) - fields)
    if ignored:
        logger.info("adapter sync: ignoring LoraConfig keys this peft does not take: %s", ignored)
    out = LoraConfig(**{k: v for k, v in config.items() if k in fields})
    out.inference_mode = True
    return out


def with_lora_adapter(model: torch.nn.Module, name: str, config: dict) -> torch.nn.Module:
    """`model` with the LoRA adapter `name` (PEFT's initialisation, from `config`) active: `model` itself when it has
    one of that name, else the adapter added to it (a PEFT model) or `model` wrapped by PEFT; eval mode, no
    gradients."""
    if name in (getattr(model, "peft_config", None) or {}):
        return model
    from peft import PeftModel, get_peft_model

    cfg = lora_config(config)
    if isinstance(model, PeftModel):
        model.add_adapter(name, cfg)
        model.set_adapter(name)
    else:
        model = get_peft_model(model, cfg, adapter_name=name)
    model.eval().requires_grad_(False)
    return model


def copy_named(targets: dict[str, torch.Tensor], named_tensors, what: str) -> int:
    """Copy each `(name, tensor)` into `targets[name]` (cast to its device and dtype); returns the bytes copied.

    Raises:
        ValueError: a name not in `targets`, or a shape that differs.
    """
    copied = 0
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            raise ValueError(f"adapter sync: {what} has no tensor {name!r} (the weight version is unchanged).")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"adapter sync: shape mismatch for {name!r}: the model has {tuple(target.shape)}, got "
                             f"{tuple(tensor.shape)} (the weight version is unchanged).")
        if target.data_ptr() != tensor.data_ptr():
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        copied += tensor.numel() * tensor.element_size()
    return copied


def _packed_weights(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The bitsandbytes k-bit layers of a PEFT model's base, by their weight's plain name."""
    out = {}
    for name, module in model.get_base_model().named_modules():
        weight = getattr(module, "weight", None)
        if weight is not None and (hasattr(weight, "quant_state") or hasattr(weight, "SCB")):
            layer = getattr(module, "base_layer", module)  # a LoRA wrapper's `weight` is its base layer's
            out[name.replace(".base_layer", "") + ".weight"] = layer
    return out


def dequantized_base(model: torch.nn.Module, pairs):
    """A PEFT model's base export (`pairs`, plain names) with its bitsandbytes k-bit weights dequantized (peft's
    `dequantize_module_weight`, what merging uses) and their quantization-state entries (`.absmax`, `.quant_map`,
    `.SCB`, ...) left out: a base a full-precision generator loads. Unchanged for a model with no k-bit layer."""
    packed = _packed_weights(model)
    if not packed:
        yield from pairs
        return
    from peft.utils.integrations import dequantize_module_weight

    layers = {weight[: -len("weight")] for weight in packed}  # "model.layers.0.self_attn.q_proj."
    for name, tensor in pairs:
        if name in packed:
            yield name, dequantize_module_weight(packed[name]).detach()
            continue
        if not name.endswith(".bias") and any(name.startswith(prefix) for prefix in layers):
            continue  # quantization state of a packed layer (`weight.absmax`, `weight.quant_map`, `SCB`, ...)
        yield name, tensor
