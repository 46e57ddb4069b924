"""Where a rollout's tokens sit in a forward, as pure functions on a :class:`~hf_verl.data.batch.RolloutBatch`:
the positions that predict completion tokens and their targets, the positions counted over real tokens, and the
way back from one value per completion token to a `(B, C)` tensor. Shared by every layout
(:mod:`hf_verl.engine.hf_layouts`, :mod:`hf_verl.engine.vision`, the Megatron engine's scoring)."""

from __future__ import annotations

import torch

from hf_verl.data.batch import RolloutBatch


def rollout_positions(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask, select, targets)` of a rollout batch: the position before each
    completion token of `completion_mask` is selected, and its target is that token. The attention
    mask (and so the positions) is `batch.attention_mask`, which covers tokens attended but not
    selected (a multi-turn rollout's tool observations, `completion_attention_mask`)."""
    input_ids, mask = batch.input_ids, batch.attention_mask
    P, C = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    select = torch.zeros_like(mask, dtype=torch.bool)
    targets = torch.zeros_like(input_ids)
    select[:, P - 1 : P + C - 1] = batch.completion_mask.bool()
    targets[:, P - 1 : P + C - 1] = batch.completion_ids
    return input_ids, mask, select, targets


def scatter_completion(batch: RolloutBatch, flat: torch.Tensor) -> torch.Tensor:
    """`(B, C)` tensor with `flat` (one value per real completion token, row-major) in place, 0 elsewhere."""
    out = flat.new_zeros(batch.completion_mask.shape)
    out[batch.completion_mask.bool()] = flat
    return out


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding does not shift them)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
