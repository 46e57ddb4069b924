"""`MegatronAdapters`: the adapters part of the Megatron engine: a PEFT LoRA actor on Megatron-Core.

Given a `PeftModel` (the trainers' `peft_config=`), the engine loads its base weights through the bridge, then
:meth:`MegatronAdapters._attach_lora` freezes the stage and gives each targeted Megatron linear its LoRA branches
(:mod:`hf_verl.parallel.megatron.lora`: PEFT's initial tensors, sharded as the linear is), before Megatron's
`DistributedDataParallel` wraps the stage, so only the adapters get gradient buffers and only they enter the
distributed optimizer. Then:

- the reference of a LoRA actor is the same stage with the adapters off (:meth:`adapters_disabled`), as on the
  accelerate engines: no reference copy;
- the weight sync and `full_state_dict` export the *merged* weights (`W + scaling * B A`, computed per shard) under
  HF names, so a rollout engine replica (PEFT merged, as for a PEFT actor elsewhere) takes them as they are;
  `export_weights(lora="base")` gives the base weights alone (HF names), `lora="adapter"` the adapters alone (the
  `PeftModel`'s own keys), the parts every engine exports for adapter-only sync;
- :meth:`adapter_state_dict` gathers only the adapters, under PEFT's names; `save_pretrained` writes a PEFT adapter
  directory (`adapter_config.json`, `adapter_model.safetensors`) that `PeftModel.from_pretrained` loads on the HF
  model;
- checkpoints keep each rank's shards, adapters included (they are the stage's parameters), and resume on the
  layout that wrote them.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_verl.engine.megatron.weights import MegatronWeights, buckets
from hf_verl.engine.parts.adapters import AdapterEngine
from hf_verl.parallel.megatron.lora import LoraLinear, PeftLora, attach


class MegatronAdapters(AdapterEngine):
    """LoRA adapters on the Megatron stage (see the module docstring); mixed into
    :class:`~hf_verl.engine.megatron.engine.MegatronEngine` before its weights part, which it extends. Reads the
    engine's `_stage`, `_bridge`, `_ctx`, `_arch`, `_ps`, `_dtype` and `dims`."""

    _lora: dict[str, LoraLinear] | None = None
    _peft: PeftLora | None = None

    def _attach_lora(self, peft: PeftLora) -> None:
        if self._kind != "causal_lm":
            raise ValueError(f"LoRA on backend='megatron' is for the actor (a causal LM); the {self.role} is a "
                             f"{self._kind} model: train it without peft_config, or on another backend.")
        self._peft = peft
        group = self._ps.get_tensor_model_parallel_group() if self.dims.tp > 1 else None
        self._lora = attach(self._stage, peft, self._bridge.table, ctx=self._ctx,
                            layer_offset=self._bridge.layer_offset, num_layers=self._bridge.num_layers,
                            total_layers=self._arch.num_layers, dtype=self._dtype, tp_group=group)
        peft.base_state = {}  # loaded: the engine owns the weights now
        if getattr(self._config, "recompute_granularity", None) and self._first:
            # Megatron's recompute (a reentrant checkpoint) back-propagates into a layer block only when its input
            # needs a gradient; with the embedding frozen it does not, and the adapters inside would get none (what
            # transformers' enable_input_require_grads does for a PEFT model)
            self._stage.embedding.register_forward_hook(_input_requires_grad)

    # ------------------------------------------------------------------ the reference: adapters off
    @property
    def has_adapters(self) -> bool:
        return self._lora is not None

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[Any]:
        if self._lora is None:
            raise ValueError(f"the {self.role} on backend='megatron' has no LoRA adapters (no peft_config); give a "
                             "reference model.")
        for lora in self._lora.values():
            lora.enabled = False
        try:
            yield self
        finally:
            for lora in self._lora.values():
                lora.enabled = True

    # ------------------------------------------------------------------ weights out
    def _export_params(self) -> dict[str, torch.Tensor]:
        params = super()._export_params()
        for name, lora in (self._lora or {}).items():  # merged, shard by shard, in the linear's layout
            key = f"{name}.weight"
            params[key] = params[key].detach() + lora.delta_weight().to(params[key].dtype)
        return params

    def export_weights(self, bucket_bytes: int, *, dtype: torch.dtype | None = None, to_cpu: bool = False,
                       lora: str = "merged", **kwargs: Any) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named tensors bucket by bucket (a collective); a LoRA actor's `lora` part: `"merged"` (default),
        `"base"` (its frozen base weights) or `"adapter"` (the adapters, under the `PeftModel`'s own keys)."""
        if lora == "merged":
            return super().export_weights(bucket_bytes, dtype=dtype, to_cpu=to_cpu, **kwargs)
        if lora not in ("base", "adapter"):
            raise ValueError(f"lora must be one of ('merged', 'base', 'adapter'), got {lora!r}.")
        if self._lora is None:
            raise ValueError(f"exporting the {lora} weights of LoRA adapters needs a LoRA actor (peft_config); the "
                             f"{self.role} on backend='megatron' has no adapters.")
        if lora == "base":
            base = MegatronWeights._export_params(self)  # unmerged
            pairs = self._across_stages(list(self._bridge.export(self._gather, base)), dtype)
        else:
            pairs = ((k, v if dtype is None else v.to(dtype))
                     for k, v in self.adapter_state_dict(adapter_name=self._peft.adapter_name).items())
        return buckets(pairs, bucket_bytes)

    def _gather_dim(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.dims.tp)]
        dist.all_gather(parts, tensor.contiguous(), group=self._ps.get_tensor_model_parallel_group())
        return torch.cat(parts, dim)

    def adapter_state_dict(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """The LoRA tensors under PEFT's names, whole (gathered over TP, every pipeline stage's), on every rank; a
        collective. Keys as `adapter_model.safetensors` holds them (`base_model.model.<module>.lora_A.weight`), or as
        the `PeftModel`'s own state dict (`...lora_A.<adapter_name>.weight`) when `adapter_name` is given."""
        if self._lora is None:
            raise ValueError(f"the {self.role} on backend='megatron' has no LoRA adapters (no peft_config).")
        mine = [pair for lora in self._lora.values() for pair in lora.peft_tensors(self._gather_dim, adapter_name)]
        return dict(self._across_stages(mine, None))

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """With LoRA: the PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`), written by the
        main rank; else the HF model. Call on every rank."""
        if self._lora is None:
            return super().save_pretrained(output_dir, **kwargs)
        state = self.adapter_state_dict()
        if not self.dims.is_main:
            return
        from safetensors.torch import save_file

        os.makedirs(output_dir, exist_ok=True)
        config = copy.deepcopy(self._peft.config)
        config.inference_mode = True
        config.save_pretrained(output_dir)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
                  os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self._lora is not None:
            raise ValueError("a LoRA actor on backend='megatron' restores from its per-rank checkpoint "
                             "(load_checkpoint: base shards and adapters), not from whole HF weights.")
        super().load_full_state_dict(state)


def _input_requires_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.requires_grad_(True) if torch.is_grad_enabled() else output
