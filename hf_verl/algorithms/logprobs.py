"""Token log-probs and entropy computed in chunks of positions.

A full ``(batch, seq, vocab)`` fp32 log-softmax is the largest tensor of an RL step (for a 150k
vocabulary, 8 x 1024 tokens is 4.9 GB). These functions take the final hidden states and the
output projection and walk the flattened positions `chunk_size` at a time: each chunk's logits
are made, reduced to one log-prob (and entropy) per position, and freed. Under autograd each chunk
is recomputed in backward (activation checkpointing), so peak memory holds one chunk of logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
    else:
        entropy = torch.zeros_like(logp)
    return logp, entropy


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
    """Log-probs of `targets` (and optionally entropy) under ``softmax(hidden @ weight.T / T)``.

    Args:
        hidden (`torch.Tensor` `(..., H)`): final hidden states at the predicting positions.
        weight (`torch.Tensor` `(V, H)`): output projection (the LM head). bias: its bias, if any.
        targets (`torch.Tensor` `(...)`): token ids whose log-prob is wanted.
        temperature (`float`): logits are divided by it (as during sampling).
        chunk_size (`int`): positions per chunk.
        with_entropy (`bool`): also return the entropy of each position's distribution.

    Returns:
        `(logp, entropy)` shaped like `targets`, fp32; entropy is `None` unless requested.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score log-probs, got {temperature}.")
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    use_ckpt = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for start in range(0, flat_t.numel(), chunk_size):
        h, t = flat_h[start : start + chunk_size], flat_t[start : start + chunk_size]
        if use_ckpt:
            lp, ent = checkpoint(
                _chunk_stats, h, weight, bias, t, temperature, with_entropy, use_reentrant=False
            )
        else:
            lp, ent = _chunk_stats(h, weight, bias, t, temperature, with_entropy)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps).view(shape) if logps else flat_t.new_zeros(shape, dtype=torch.float32)
    entropy = (torch.cat(ents).view(shape) if ents else torch.zeros_like(logp)) if with_entropy else None
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
