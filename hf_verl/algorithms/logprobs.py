"""Token log-probs and entropy computed in chunks of positions.

A full ``(batch, seq, vocab)`` fp32 log-softmax is the largest tensor of an RL step (for a 150k
vocabulary, 8 x 1024 tokens is 4.9 GB). These functions take the final hidden states and the
output projection and walk the flattened positions `chunk_size` at a time: each chunk's logits
are made, reduced to one log-prob (and entropy) per position, and freed. Under autograd each chunk
is recomputed in backward (activation checkpointing), so peak memory holds one chunk of logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_stats(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    with_mean_logit: bool,
    with_log_sum_sq: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    mean_logit = logits.mean(-1) if with_mean_logit else logits.new_zeros(())
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
    else:
        entropy = logp.new_zeros(())
    # log sum_v p_v^2 = logsumexp(2 log p), detached (WPO's alignment term)
    log_sum_sq = torch.logsumexp(2 * (logits.detach() - logz.detach().unsqueeze(-1)), dim=-1) if with_log_sum_sq \
        else logp.new_zeros(())
    return logp, entropy, mean_logit, log_sum_sq


def logprobs_from_head(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    with_mean_logit: bool = False,
    head_requires_grad: bool | None = None,
    with_log_sum_sq: bool = False,
):
    """Log-probs of `targets` under ``softmax(head(hidden) / T)``, computed `chunk_size` positions at a time.

    `head` is called on each chunk, so it may be the model's output-embedding *module*: under
    FSDP2 or ZeRO-3 its weight is only whole inside a module call (or inside the root module's
    forward window), never readable as a plain tensor outside it.

    Args:
        hidden (`torch.Tensor` `(..., H)`): final hidden states at the predicting positions.
        head (`Callable`): maps `(n, H)` hidden states to `(n, V)` logits (the LM head).
        targets (`torch.Tensor` `(...)`): token ids whose log-prob is wanted.
        temperature (`float`): logits are divided by it (as during sampling).
        chunk_size (`int`): positions per chunk.
        with_entropy (`bool`): also return the entropy of each position's distribution.
        with_mean_logit (`bool`): also return each position's mean logit over the vocabulary
            (before the temperature; a DPO metric), without gradient.
        head_requires_grad (`bool`, *optional*): whether the head has trainable weights (chunks are
            then recomputed in backward); default: read from `head` when it is an `nn.Module`.
        with_log_sum_sq (`bool`): also return `log sum_v p_v^2` per position, without gradient (WPO).

    Returns:
        `(logp, entropy, mean_logit)` shaped like `targets`, fp32; the last two are `None` unless
        requested. With `with_log_sum_sq`, a fourth tensor `log_sum_sq`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score log-probs, got {temperature}.")
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    if head_requires_grad is None:
        head_requires_grad = isinstance(head, torch.nn.Module) and any(p.requires_grad for p in head.parameters())
    use_ckpt = torch.is_grad_enabled() and (hidden.requires_grad or head_requires_grad)
    logps, ents, means, sqs = [], [], [], []
    for start in range(0, flat_t.numel(), chunk_size):
        h, t = flat_h[start : start + chunk_size], flat_t[start : start + chunk_size]
        if use_ckpt:
            lp, ent, mean, sq = checkpoint(_chunk_stats, h, head, t, temperature, with_entropy, with_mean_logit,
                                           with_log_sum_sq, use_reentrant=False)
        else:
            lp, ent, mean, sq = _chunk_stats(h, head, t, temperature, with_entropy, with_mean_logit, with_log_sum_sq)
        logps.append(lp)
        ents.append(ent)
        means.append(mean.detach())
        sqs.append(sq.detach())
    # no position to score (every completion of a micro-batch masked out): zeros that still hang off the
    # graph, so that a loss built on them backpropagates (zero gradients) instead of failing
    empty = flat_h[:0, 0].float().view(shape) * 0 if not logps else None
    logp = torch.cat(logps).view(shape) if logps else empty
    entropy = (torch.cat(ents).view(shape) if ents else empty) if with_entropy else None
    mean_logit = (torch.cat(means).view(shape) if means else empty) if with_mean_logit else None
    if with_log_sum_sq:
        return logp, entropy, mean_logit, (torch.cat(sqs).view(shape) if sqs else empty.detach())
    return logp, entropy, mean_logit


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logprobs_from_head` for an explicit projection ``hidden @ weight.T + bias`` `(V, H)`.

    Returns:
        `(logp, entropy)` shaped like `targets`, fp32; entropy is `None` unless requested.
    """
    def head(h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight, bias)

    trainable = weight.requires_grad or (bias is not None and bias.requires_grad)
    logp, entropy, _ = logprobs_from_head(hidden, head, targets, temperature=temperature, chunk_size=chunk_size,
                                          with_entropy=with_entropy, head_requires_grad=trainable)
    return logp, entropy


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As :func:`logprobs_from_hidden` for logits a model already produced `(..., V)`.

    The fp32 upcast and log-softmax still happen one chunk at a time.
    """
    shape = targets.shape
    flat_l = logits.reshape(-1, logits.shape[-1])
    flat_t = targets.reshape(-1)
    logps, ents = [], []
    for start in range(0, flat_t.numel(), chunk_size):
        chunk = flat_l[start : start + chunk_size].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        logz = torch.logsumexp(chunk, dim=-1)
        logps.append(chunk.gather(-1, flat_t[start : start + chunk_size].unsqueeze(-1)).squeeze(-1) - logz)
        if with_entropy:
            ents.append(logz - (torch.softmax(chunk, -1) * chunk).sum(-1))
    logp = torch.cat(logps).view(shape)
    return logp, (torch.cat(ents).view(shape) if with_entropy else None)
