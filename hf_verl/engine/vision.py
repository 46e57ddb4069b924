"""The training forward of rows with images, on transformers-based engines.

A rollout batch whose rows carry pixel inputs (`RolloutBatch.meta[VISION_INPUTS]`, :mod:`hf_verl.data.vision`) is
scored padded (left-padded prompt, right-padded completion) with those inputs beside the ids: never packed
padding-free nor laid out by shared prompt, whose layouts have no place for a row's image features. Positions:
a family that computes its own over image tokens (Qwen2-VL's multimodal RoPE: its model has `get_rope_index`) gets
none and computes them from the ids, the image grid and the attention mask as its `generate` did; every other
family gets the positions counted over real tokens, as `generate` gives them.
"""

from __future__ import annotations

import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.data.vision import VISION_INPUTS, collate_vision_inputs
from hf_verl.engine.positions import (
    position_ids_from_mask,
    rollout_positions,
    scatter_completion,
)


def has_vision_inputs(batch) -> bool:
    """Whether a batch's rows carry pixel inputs."""
    return isinstance(batch, RolloutBatch) and batch.meta.get(VISION_INPUTS) is not None


def computes_own_positions(model: torch.nn.Module) -> bool:
    """Whether a vision-language model computes its positions from the ids and the image grid (multimodal RoPE)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    inner = getattr(base, "model", None)
    return callable(getattr(base, "get_rope_index", None)) or callable(getattr(inner, "get_rope_index", None))


def check_vision_layout(engine) -> None:
    """Refuse the engine layouts that cannot run rows with images, saying what to change."""
    if engine.dims.sp > 1:
        raise ValueError("rows with images cannot be split over sequence-parallel ranks: set "
                         "sequence_parallel_size=1 (Ulysses SP trains text only).")
    if engine.padding_free or engine.shared_prefix:
        raise ValueError("rows with images are scored padded: set padding_free=None/False and "
                         "shared_prefix=None/False.")


def vision_logprobs(engine, batch: RolloutBatch, *, temperature: float, chunk_size: int, with_entropy: bool,
                    with_aux_loss: bool):
    """`(B, C)` log-probs (and entropy, and aux loss when asked) of a rollout whose rows carry pixel inputs, as
    :meth:`~hf_verl.engine.hf_layouts.HFLayouts.logprobs` returns them."""
    check_vision_layout(engine)
    input_ids, mask, select, targets = rollout_positions(batch)
    inputs = collate_vision_inputs(batch.meta[VISION_INPUTS], prompt_width=batch.prompt_ids.shape[1],
                                   width=input_ids.shape[1], device=input_ids.device)
    positions = None if computes_own_positions(engine.model) else position_ids_from_mask(mask)
    stats = engine.token_logprobs(input_ids, targets, select, attention_mask=mask, position_ids=positions,
                                  temperature=temperature if temperature > 0 else 1.0, chunk_size=chunk_size,
                                  with_entropy=with_entropy, with_aux_loss=with_aux_loss, model_inputs=inputs)
    entropy = scatter_completion(batch, stats.entropy) if with_entropy else None
    logp = scatter_completion(batch, stats.logp)
    return (logp, entropy, stats.aux_loss) if with_aux_loss else (logp, entropy)
