"""Model-level options the trainers share (TRL's meanings): an LM head kept in float32, the router
load-balancing loss of Mixture-of-Experts models, and dropout switched off (`disable_dropout`).

Both work through public extension points only: module hooks for the float32 head (the head's input is
cast up, a tied embedding's output is cast back down), and the `output_router_logits` flag of the model's
forward for the auxiliary loss (the model computes `aux_loss` itself).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """Keep `model`'s output head in float32: its weights are cast, and a forward pre-hook casts the hidden
    states it receives to float32, so logits and log-probs are computed in full precision. With tied
    embeddings the shared weight becomes float32 too and the embedding's output is cast back to the model's
    dtype, so the rest of the network runs as before.

    Raises:
        ValueError: the head is a PEFT adapter layer (its adapter would bypass the cast), or there is none.
    """
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError("cast_lm_head_to_fp32: the model has no output embeddings (LM head).")
    if hasattr(head, "base_layer"):
        raise ValueError("cast_lm_head_to_fp32 cannot be used with a PEFT adapter on the LM head: remove 'lm_head' "
                         "from the LoRA target_modules.")
    dtype = next(model.parameters()).dtype
    head.float()
    head.register_forward_pre_hook(lambda _module, args: (args[0].float(), *args[1:]))
    tied = getattr(model.config, "tie_word_embeddings", False)
    embed = model.get_input_embeddings()
    if tied and embed is not None and dtype != torch.float32:
        embed.register_forward_hook(lambda _module, _args, output: output.to(dtype))
    logger.info("LM head kept in float32 (model dtype %s%s)", dtype, ", tied embeddings" if tied else "")


def router_aux_loss(model: torch.nn.Module, coef: float | None) -> tuple[float, bool]:
    """`(coefficient, enabled)` of the router load-balancing loss, as TRL resolves it: `coef`, or the model
    config's `router_aux_loss_coef` when None; enabled when the model can return router logits and the
    coefficient is non-zero.

    Raises:
        ValueError: a non-zero `coef` for a model that is not a Mixture of Experts returning router logits.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    is_moe = hasattr(config, "output_router_logits")
    if coef and not is_moe:
        raise ValueError(f"router_aux_loss_coef={coef} but {type(model).__name__} is not a Mixture-of-Experts model "
                         "returning router logits: there is no auxiliary loss to weight; remove router_aux_loss_coef.")
    value = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else float(coef)
    return value, is_moe and value != 0.0


def disable_dropout(*models: torch.nn.Module | None) -> None:
    """Set the probability of every `torch.nn.Dropout` in `models` to 0 (TRL's `disable_dropout`); None is skipped."""
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
