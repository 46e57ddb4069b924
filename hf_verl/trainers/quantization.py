"""`quantization_config` for GRPOTrainer and DPOTrainer (QLoRA), as TRL 1.16 takes it, checked before any weight loads.

TRL's trainers accept a `transformers.BitsAndBytesConfig` as the `quantization_config` constructor argument or
inside `args.model_init_kwargs`, not both. It applies when the model is given by id or path: the base then loads
k-bit quantized by bitsandbytes, and with `peft_config` only the adapters train (QLoRA). Given a model object, a
GRPO run warns that the argument is ignored and a DPO run refuses it, as in TRL.

What TRL leaves to fail later is checked here, at construction, naming what to change: bitsandbytes must import and
support the run's device, a quantized base needs adapters to train (`peft_config`), and the layout must keep whole
models: one process or DDP. FSDP2 and DeepSpeed would shard the packed k-bit weights, and in-process vLLM would be
sent them, so those are refused. A generator with weights of its own needs adapter-only sync
(`weight_sync="adapter"`: nothing is merged, the base stays quantized on the trainer): asynchronous rollout's copy of
the actor keeps the same packed base, and `hf-verl serve` (a generator URL, or `vllm_mode="server"`) gets the base
once, dequantized to the values the actor computes with, then the adapters only. Nothing is
ever quantized by hf_verl itself: bitsandbytes does it inside `from_pretrained`.

On the CPU (bitsandbytes 0.50 ships CPU kernels; 4-bit and 8-bit QLoRA GRPO and DPO are tested on this machine): on
a CPU with AVX512-BF16, bitsandbytes' 4-bit layers repack their weights into an inference-only layout at the first
forward without gradients in eval mode (a generation, a reference or evaluation pass) and keep it, and the next
training forward then fails inside bitsandbytes (measured with 0.50.2). :func:`keep_kbit_layers_trainable` turns that
repacking off on every 4-bit layer (the layers then compute with the ordinary dequantizing kernel, in eval mode too).

Departure from TRL: the LoRA weights stay in float32 (peft's default); TRL casts them to bfloat16.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_INSTEAD = ("or train LoRA without quantization: keep peft_config and drop quantization_config (the base then "
            "trains frozen in full precision)")


def merge_quantization_config(model: Any, model_init_kwargs: dict | None, quantization_config: Any, *,
                              refuse_model_object: bool) -> dict:
    """The keyword arguments to load `model` with: `args.model_init_kwargs` plus `quantization_config`, TRL's rules.

    Args:
        model: the trainer's `model` argument (an id / path, or a model object).
        model_init_kwargs (`dict`, *optional*): `args.model_init_kwargs` (not modified).
        quantization_config: the trainer's `quantization_config` argument, or `None`.
        refuse_model_object (`bool`): raise (DPOTrainer) rather than warn (GRPOTrainer) when `quantization_config`
            comes with a model object, which it cannot apply to.

    Returns:
        `dict`: a new dict; it holds `quantization_config` when one applies.

    Raises:
        `ValueError`: `quantization_config` given twice, or (with `refuse_model_object`) beside a model object.
    """
    kwargs = dict(model_init_kwargs or {})
    if quantization_config is None:
        return kwargs
    if not isinstance(model, str):
        message = ("quantization_config applies when the model is loaded from an id or path; this model is already "
                   "instantiated, so it cannot be quantized here")
        if refuse_model_object:
            raise ValueError(f"{message}: pass the model id (a str), or omit quantization_config.")
        logger.warning("%s: quantization_config is ignored.", message)
        return kwargs
    if "quantization_config" in kwargs:
        raise ValueError("quantization_config is set both as a trainer argument and in args.model_init_kwargs; set "
                         "it in one place, preferably the trainer argument.")
    kwargs["quantization_config"] = quantization_config
    return kwargs


def is_kbit_model(model: Any) -> bool:
    """Whether `model` (or the base under its PEFT wrapper) was loaded k-bit quantized by bitsandbytes."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def check_quantized_run(model: Any, load_kwargs: dict, peft_config: Any, args: Any) -> None:
    """Refuse, before loading, a quantized run that cannot work here (see the module docstring).

    Args:
        model: the trainer's `model` argument (an id / path, or a model object).
        load_kwargs (`dict`): what :func:`merge_quantization_config` returned.
        peft_config: the trainer's `peft_config` argument.
        args: the trainer config (`world_size`, `device`, `use_vllm`).

    Raises:
        `ImportError` / `RuntimeError` / `ValueError`: naming what to install or change.
    """
    config = load_kwargs.get("quantization_config") if isinstance(model, str) else None
    if config is None and not is_kbit_model(model):
        return
    if peft_config is None and not hasattr(model, "peft_config"):
        raise ValueError("a quantized base cannot be trained itself (its k-bit weights take no gradients): pass "
                         "peft_config (e.g. peft.LoraConfig) to train adapters on it (QLoRA), or drop "
                         "quantization_config to train the full model.")
    from hf_verl.parallel.backend import requested_backend

    backend = requested_backend(args.world_size)
    if backend.shards:
        raise ValueError(f"a quantized base with {backend.label} ({backend.source}) is not supported: hf_verl would "
                         "shard its packed k-bit weights. Launch QLoRA on one process or with DDP "
                         "(configs/accelerate/ddp.yaml), or drop quantization_config to shard a full-precision base.")
    adapters = getattr(args, "weight_sync", None) == "adapter"
    if getattr(args, "use_vllm", False) and not (adapters and getattr(args, "vllm_mode", None) == "server"):
        raise ValueError("use_vllm=True with a quantized base is not supported: the vLLM engine would be sent the "
                         "packed k-bit weights after each step. Generate with the transformers engine "
                         "(use_vllm=False), which shares the policy's weights, or on hf-verl serve with "
                         "weight_sync='adapter' (the base goes once, dequantized; then the adapters only).")
    served = isinstance(getattr(args, "placement", None), dict) and args.placement.get("generator") is not None
    if served and not adapters:
        raise ValueError("placement['generator'] with a quantized base needs weight_sync='adapter': a merged sync "
                         "would merge the adapters into packed k-bit weights. With adapter-only sync the server gets "
                         "the base once, dequantized, and then the adapters only.")
    if getattr(args, "use_async_rollout", False) and not adapters:
        raise ValueError("use_async_rollout=True with a quantized base needs weight_sync='adapter': asynchronous "
                         "rollout generates on a copy of the actor, and only adapter-only sync keeps it in step "
                         "without merging the adapters into packed k-bit weights.")
    if config is not None and _quant_method(config) == "bitsandbytes":
        _check_bitsandbytes(config, args.device.type)
    if not isinstance(model, str):
        keep_kbit_layers_trainable(model)


def keep_kbit_layers_trainable(model: Any) -> int:
    """Keep every bitsandbytes 4-bit layer of `model` trainable on the CPU (see the module docstring): no repacking
    into the inference-only layout. Returns the number of layers changed; harmless off the CPU."""
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            # bitsandbytes 0.50 has no public switch: Linear4bit.forward repacks its weight for the AVX512-BF16 CPU
            # kernel (an inference-only layout) when this instance flag is set, the layer is in eval mode and the
            # input takes no gradient. Clearing the flag is the one place to turn it off.
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


def _quant_method(config: Any) -> str | None:
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    if method is None and isinstance(config, dict) and (config.get("load_in_4bit") or config.get("load_in_8bit")):
        return "bitsandbytes"
    return str(getattr(method, "value", method)) if method is not None else None


def _bits(config: Any) -> str:
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, False)
    return "8-bit" if get("load_in_8bit") else "4-bit"


def _check_bitsandbytes(config: Any, device: str) -> None:
    """bitsandbytes imports and lists the run's device among those it runs on (the CPU from 0.50 on)."""
    what = f"quantization_config asks for a {_bits(config)} bitsandbytes base (QLoRA)"
    try:
        import bitsandbytes
    except Exception as err:  # missing, or built for a CUDA this machine lacks
        raise ImportError(f"{what}, but bitsandbytes does not import ({type(err).__name__}: {err}): "
                          f"`pip install bitsandbytes` (or hf_verl[qlora]), {_INSTEAD}.") from err
    supported = set(getattr(bitsandbytes, "supported_torch_devices", None) or {"cuda"})
    if device not in supported:
        raise RuntimeError(f"{what}, but bitsandbytes {getattr(bitsandbytes, '__version__', '?')} runs on "
                           f"{sorted(supported)}, not on this run's device ({device}): `pip install -U bitsandbytes` "
                           f"(0.50 runs on the CPU) or run on a CUDA GPU, {_INSTEAD}.")
