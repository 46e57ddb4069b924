"""Distillation losses (pure functions): the generalized Jensen-Shannon divergence of GKD, and the sampled-token
estimate used when the teacher's full distribution is not available (another tokenizer, a served teacher).

**Generalized JSD** (Agarwal et al., 2024, eq. 1; TRL's `GKDTrainer.generalized_jsd_loss`), per position, with
`p_S = softmax(student / T)`, `p_T = softmax(teacher / T)` and the mixture `m = beta p_T + (1 - beta) p_S`::

    JSD_beta = beta KL(p_T || m) + (1 - beta) KL(p_S || m)

`beta = 0` is the forward KL `KL(p_T || p_S)` and `beta = 1` the reverse KL `KL(p_S || p_T)` (the mixture form is 0
at both ends, so those two are computed directly, as TRL does).

**Sampled-token estimate** (:func:`sampled_token_distillation_loss`). With only the teacher's log-prob of each
*sampled* token (aligned to the student's tokens by text, :mod:`hf_verl.algorithms.token_alignment`), there is no
distribution to interpolate. On tokens the student sampled, `log p_S(y_t) - log p_T(y_t)` is an unbiased per-token
estimate of the reverse KL, and its gradient is taken by the score function: the loss is
`-sg(log p_T(y_t) - log p_S(y_t)) * log p_S(y_t)` per token (a per-token reward of the teacher-student log-ratio,
no credit to later tokens: the per-token form of on-policy distillation). On tokens the student did not sample (a
dataset completion, a teacher's own completion) the loss is their negative log-likelihood under the student (the
sampled estimate of the forward KL when the text is the teacher's, up to the teacher's entropy, which has no
gradient). `beta` does not enter either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float = 0.5,
                    temperature: float = 1.0) -> torch.Tensor:
    """The generalized JSD of the module docstring, per vocabulary entry (summing over the last dimension gives
    each position's divergence).

    Args:
        student_logits (`torch.Tensor` of shape `(..., V)`): the student's logits (with gradient).
        teacher_logits (`torch.Tensor` of shape `(..., V)`): the teacher's logits, same shape.
        beta (`float`, defaults to `0.5`): in [0, 1]; 0: forward KL, 1: reverse KL.
        temperature (`float`, defaults to `1.0`): both logits are divided by it.

    Returns:
        `torch.Tensor` of shape `(..., V)`: the pointwise terms (`F.kl_div(..., reduction="none")`'s).

    Raises:
        ValueError: `beta` outside [0, 1], or the two logits of different shapes (different vocabularies: use the
            sampled-token estimate).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}.")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: the generalized JSD needs one vocabulary (a teacher "
                         "with another tokenizer is distilled by the sampled-token estimate).")
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.to(s.dtype) / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    mixture = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
    return b * F.kl_div(mixture, t, reduction="none", log_target=True) + \
        (1 - b) * F.kl_div(mixture, s, reduction="none", log_target=True)


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                         labels: torch.Tensor | None = None, beta: float = 0.5, temperature: float = 1.0,
                         reduction: str = "batchmean", num_items_in_batch: int | torch.Tensor | None = None
                         ) -> torch.Tensor:
    """The generalized JSD reduced as TRL's `GKDTrainer.generalized_jsd_loss` reduces it (same arguments).

    Args:
        student_logits / teacher_logits (`torch.Tensor` of shape `(B, T, V)`): logits at each position.
        labels (`torch.Tensor` of shape `(B, T)`, *optional*): -100 where a position does not count.
        beta / temperature: see :func:`generalized_jsd`.
        reduction (`str`, defaults to `"batchmean"`): `"batchmean"` (sum over the counted positions and the
            vocabulary, divided by the number of counted positions; by `B` without labels), `"sum"`, `"mean"`
            (over every counted element), `"none"` (the pointwise terms, counted positions only when `labels`
            is given).
        num_items_in_batch (*optional*): when given, the sum divided by it (a global token count: the loss of one
            micro-batch under gradient accumulation).
    """
    jsd = generalized_jsd(student_logits, teacher_logits, beta=beta, temperature=temperature)
    mask = None
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    if num_items_in_batch is not None:
        total = jsd.sum()
        count = num_items_in_batch.to(total.device) if isinstance(num_items_in_batch, torch.Tensor) else \
            num_items_in_batch
        return total / count
    if reduction == "batchmean":
        denom = mask.sum().clamp_min(1) if mask is not None else max(jsd.size(0), 1)
        return jsd.sum() / denom
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    if reduction == "none":
        return jsd
    raise ValueError(f"reduction must be 'batchmean', 'sum', 'mean' or 'none', got {reduction!r}.")


def sampled_token_distillation_loss(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, *,
                                    on_policy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token sampled-token loss of the module docstring, summed over the masked tokens.

    Args:
        student_logp (`torch.Tensor` of shape `(B, C)`): the student's log-prob of each completion token (with
            gradient).
        teacher_logp (`torch.Tensor` of shape `(B, C)`): the teacher's log-prob of the same tokens (aligned).
        mask (`torch.Tensor` of shape `(B, C)`): 1 on the tokens that count.
        on_policy (`bool`): whether the student sampled these tokens (reverse-KL surrogate) or not (negative
            log-likelihood).

    Returns:
        `(loss_sum, kl_sum)`: the loss summed over the masked tokens (divide by a token count), and the summed
        estimate `log p_S - log p_T` (no gradient; the reverse KL on student samples).
    """
    maskf = mask.to(student_logp.dtype)
    log_ratio = (student_logp - teacher_logp.to(student_logp.dtype)).detach()
    if on_policy:
        per_token = log_ratio * student_logp  # = -sg(log p_T - log p_S) * log p_S
    else:
        per_token = -student_logp
    return (per_token * maskf).sum(), (log_ratio * maskf).sum()
