"""DPO on pairs with images: the sequence log-probs of a pair batch whose sequences carry pixel inputs.

The pair batch (:class:`~hf_verl.data.vision.VisionPreferenceCollator`: chosen rows then rejected rows, each
starting with its prompt, right-padded) is scored padded in one `token_logprobs` call with the sequences' pixel
inputs beside the ids, never in the shared-prompt or padding-free layouts; the per-sequence sums are DPO's own
(:meth:`~hf_verl.trainers.dpo_trainer.DPOTrainer._pair_reduce`).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_verl.data.vision import VISION_INPUTS, collate_vision_inputs
from hf_verl.engine.vision import computes_own_positions


def refuse_vision_pairs(args: Any, backend: Any, dims: Any) -> None:
    """Raise a ValueError naming the DPO setting that pairs with images cannot take."""
    refusals = [
        (getattr(backend, "kind", None) == "megatron",
         "the Megatron engine does not take pixel inputs: launch with an accelerate config (DDP, FSDP2 or ZeRO)"),
        (getattr(dims, "sp", 1) > 1,
         "Ulysses sequence parallelism splits rows that carry image features: set sequence_parallel_size=1"),
        (bool(args.padding_free), "pairs with images are scored padded: set padding_free=False"),
        (args.truncation_mode != "keep_start" and args.max_length is not None,
         ("truncation_mode='keep_end' is not supported for vision-language models (as in TRL): a prompt with images "
          "is not cut. Set truncation_mode='keep_start' (the default) or max_length=None")),
        (bool(args.precompute_ref_log_probs),
         ("precompute_ref_log_probs=True is not supported for vision datasets (as in TRL): set "
          "precompute_ref_log_probs=False")),
    ]
    for refused, reason in refusals:
        if refused:
            raise ValueError(f"DPOTrainer on a dataset with images: {reason}.")


def vision_sequence_logps(trainer: Any, engine: Any, batch: dict, *, with_aux_loss: bool = False,
                          with_wpo: bool = False) -> tuple:
    """DPO's per-sequence `(log-probs, mean logits, token counts[, aux loss][, WPO weights])` of a pair batch with
    pixel inputs (see the module docstring)."""
    from hf_verl.engine.hf_layouts import position_ids_from_mask

    ids, mask = batch["input_ids"], batch["attention_mask"]
    select, _, _ = trainer._pair_select(batch)
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    inputs = collate_vision_inputs(batch[VISION_INPUTS], prompt_width=0, width=ids.shape[1], device=ids.device,
                                   right_padded=True)
    positions = None if computes_own_positions(engine.model) else position_ids_from_mask(mask)
    stats = engine.token_logprobs(ids, targets, select, attention_mask=mask, position_ids=positions, temperature=1.0,
                                  chunk_size=trainer.args.logprob_chunk_size, with_mean_logit=True,
                                  with_aux_loss=with_aux_loss, with_log_sum_sq=with_wpo, model_inputs=inputs)
    return trainer._pair_reduce(stats, batch, with_aux_loss=with_aux_loss, with_wpo=with_wpo)
