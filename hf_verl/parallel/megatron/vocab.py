"""Token statistics from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds the logits of its slice `[start, start + V_local)` of the (padded) vocabulary.
:func:`token_stats` returns, per position, the log-probability of a target token under
`log_softmax(logits / temperature)` over the *model's* vocabulary (the padding rows Megatron adds are excluded,
so the result equals the HF model's), the entropy, and `log sum_v p_v^2`; the only communication is three
all-reduces of one number per position (max, sum of exponentials, the target's logit) plus one for the entropy.

Gradients: the sums go through an all-reduce whose backward is the identity (each rank's slice receives the
gradient of the replicated result), the max is a constant. On one rank every reduction is the identity, and the
arithmetic is that of `torch.log_softmax`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def token_stats(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int,
                temperature: float = 1.0, with_entropy: bool = False, with_log_sum_sq: bool = False,
                with_mean_logit: bool = False, reduce_sum: Reduce = _identity, reduce_max: Reduce = _identity):
    """`(logp, entropy or None, log_sum_sq or None, mean_logit or None)`, each `(N,)`, of `targets` under
    vocabulary-parallel logits (`mean_logit`: the mean logit over the model's vocabulary, before the temperature,
    without gradient; a DPO metric).

    Args:
        logits (`torch.Tensor` `(N, V_local)`): this rank's vocabulary slice at the N positions.
        targets (`torch.Tensor` `(N,)`): token ids in the whole vocabulary.
        vocab_start (`int`): the first token id of this rank's slice. vocab_size (`int`): the model's vocabulary
            (ids at or beyond it are padding and take no probability).
        temperature (`float`): logits are divided by it.
        reduce_sum / reduce_max: all-reduces over the tensor-parallel group (sum: identity backward; max: on a
            tensor without gradient).
    """
    local = logits.float() / temperature
    ids = torch.arange(vocab_start, vocab_start + local.shape[-1], device=local.device)
    padding = ids >= vocab_size
    mean_logit = None
    if with_mean_logit:
        with torch.no_grad():
            mean_logit = reduce_sum(torch.where(padding, 0.0, logits.detach().float()).sum(-1)) / vocab_size
    if padding.any():
        local = local.masked_fill(padding, torch.finfo(local.dtype).min)
    peak = reduce_max(local.detach().max(-1).values)
    shifted = local - peak.unsqueeze(-1)
    exp = shifted.exp()
    log_z = reduce_sum(exp.sum(-1)).log()
    inside = (targets >= vocab_start) & (targets < vocab_start + local.shape[-1])
    index = (targets - vocab_start).clamp(0, local.shape[-1] - 1).unsqueeze(-1)
    target_logit = reduce_sum(torch.where(inside, shifted.gather(-1, index).squeeze(-1), 0.0))
    logp = target_logit - log_z
    entropy = None
    if with_entropy:  # H = log Z - sum_v p_v * shifted_v
        weighted = reduce_sum(torch.where(padding, 0.0, exp * shifted).sum(-1))
        entropy = log_z - weighted / log_z.exp()
    log_sum_sq = None
    if with_log_sum_sq:  # log sum_v p_v^2 = log sum_v exp(2 shifted_v) - 2 log Z
        with torch.no_grad():
            log_sum_sq = reduce_sum((2 * shifted.detach()).exp().sum(-1)).log() - 2 * log_z.detach()
    return logp, entropy, log_sum_sq, mean_logit
