"""Token log-probs and entropy computed in chunks of positions.

A full ``(batch, seq, vocab)`` fp32 log-softmax is the largest tensor of an RL step (for a 150k
vocabulary, 8 x 1024 tokens is 4.9 GB). These functions take the final hidden states and the
output projection and walk the flattened positions `chunk_size` at a time: each chunk's logits
are made, reduced to one log-prob (and entropy) per position, and freed. Under autograd each chunk
is recomputed in backward (activation checkpointing), so peak memory holds one chunk of logits.

A chunk is `chunk_size` positions, or fewer when the vocabulary is large: one chunk's fp32 logits are
kept within `MAX_CHUNK_BYTES` (256 MiB; a 152k vocabulary gets 441 positions a chunk, any vocabulary
up to 64k the full 1024), because a chunk's intermediates (the fp32 copy, the exponentials of the
log-sum-exp, the logits' gradient in backward) are several times that size at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

MAX_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk


def chunk_positions(chunk_size: int, vocab_size: int | None, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Positions per chunk: at most `chunk_size`, and at most as many as keep one chunk's fp32 logits
    `(positions, vocab_size)` within `max_chunk_bytes` (never fewer than 1). An unknown vocabulary
    (`None`) leaves `chunk_size`."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    if not vocab_size:
        return chunk_size
    return max(1, min(chunk_size, max_chunk_bytes // (4 * vocab_size)))


def _vocab_of(head: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
    """The output width of an LM-head module (`out_features`, or its 2-D weight's rows); `None` for a
    plain callable."""
    out = getattr(head, "out_features", None)
    if isinstance(out, int):
        return out
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    return None


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
    vocab_size: int | None = None,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
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
        chunk_size (`int`): positions per chunk, at most (see `max_chunk_bytes`).
        with_entropy (`bool`): also return the entropy of each position's distribution.
        with_mean_logit (`bool`): also return each position's mean logit over the vocabulary
            (before the temperature; a DPO metric), without gradient.
        head_requires_grad (`bool`, *optional*): whether the head has trainable weights (chunks are
            then recomputed in backward); default: read from `head` when it is an `nn.Module`.
        with_log_sum_sq (`bool`): also return `log sum_v p_v^2` per position, without gradient (WPO).
        vocab_size (`int`, *optional*): the head's output width; default: read from `head`'s
            `out_features` or weight when it is a module.
        max_chunk_bytes (`int`): a chunk holds at most as many positions as keep its fp32 logits
            within this many bytes (see :func:`chunk_positions`).

    Returns:
        `(logp, entropy, mean_logit)` shaped like `targets`, fp32; the last two are `None` unless
        requested. With `with_log_sum_sq`, a fourth tensor `log_sum_sq`.
    """
    chunk_size = chunk_positions(chunk_size, vocab_size or _vocab_of(head), max_chunk_bytes)
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
                                          with_entropy=with_entropy, head_requires_grad=trainable,
                                          vocab_size=weight.shape[0])
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
