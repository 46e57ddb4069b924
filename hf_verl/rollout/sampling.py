"""Pure functions on next-token logits: repetition penalty, top-k / top-p / min-p, sampling.

These reproduce the semantics of transformers' ``RepetitionPenaltyLogitsProcessor`` and its
``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper`` (with
``min_tokens_to_keep=1``), applied in the order ``GenerationMixin._get_logits_processor`` builds
them: repetition penalty, then (sampling only) temperature, top-k, top-p, min-p. They let
:class:`~hf_verl.rollout.hf_engine.TransformersEngine` run a lean KV-cached decode loop without
``generate``'s per-token Python overhead.

Log-prob convention (see :mod:`hf_verl.rollout.base`): :func:`sample_next` returns each sampled
token's log-probability under ``log_softmax(raw_logits / temperature)``, computed *before* the
repetition penalty and the truncations; the temperature is taken as 1 for greedy decoding.

One deliberate departure from ``generate``: :func:`apply_repetition_penalty` accepts a mask of the
previous positions, so that left padding is not counted as "already generated" (``generate``
penalises the pad token of left-padded rows, which matters when the pad token is also EOS).
"""

from __future__ import annotations

import torch

from hf_verl.rollout.base import SamplingParams

__all__ = [
    "apply_repetition_penalty",
    "draw_categorical",
    "filter_min_p",
    "filter_top_k",
    "filter_top_p",
    "invert_cdf",
    "sample_next",
]


def apply_repetition_penalty(
    logits: torch.Tensor,
    prev_ids: torch.Tensor,
    penalty: float,
    prev_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """CTRL repetition penalty: divide positive, multiply negative scores of tokens already seen.

    Args:
        logits (`torch.Tensor` of shape `(batch, vocab)`): next-token scores.
        prev_ids (`torch.LongTensor` of shape `(batch, length)`): the prompt and completion so far.
        penalty (`float`): the penalty; `1.0` returns `logits` unchanged.
        prev_mask (`torch.Tensor` of shape `(batch, length)`, *optional*): 1 where `prev_ids`
            holds a real token, 0 for padding (ignored); `None` counts every position.

    Returns:
        `torch.Tensor`: the penalised scores (a new tensor).
    """
    if penalty == 1.0:
        return logits
    vocab = logits.shape[-1]
    # ids past the vocabulary (or masked out) land in one extra column that is dropped afterwards
    ids = prev_ids.clamp(max=vocab)
    if prev_mask is not None:
        ids = ids.masked_fill(prev_mask == 0, vocab)
    padded = torch.nn.functional.pad(logits, (0, 1))
    score = padded.gather(1, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return padded.scatter(1, ids, score)[:, :vocab]


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` highest scores per row (ties with the k-th kept), set the rest to -inf.

    Args:
        logits (`torch.Tensor` of shape `(batch, vocab)`): scores.
        top_k (`int`): number of tokens kept; `0` disables the filter.

    Returns:
        `torch.Tensor`: the filtered scores.
    """
    if top_k <= 0:
        return logits
    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1, None]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of top tokens whose probability mass reaches `top_p`.

    Like transformers, the tokens removed are those whose cumulative probability, summed from the
    least likely upwards, stays ``<= 1 - top_p``; the most likely token is always kept.

    Args:
        logits (`torch.Tensor` of shape `(batch, vocab)`): scores.
        top_p (`float`): probability mass kept; `1.0` disables the filter.

    Returns:
        `torch.Tensor`: the filtered scores.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float | None) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the most likely token's.

    Args:
        logits (`torch.Tensor` of shape `(batch, vocab)`): scores (already temperature-scaled).
        min_p (`float`, *optional*): relative threshold; `None` disables the filter.

    Returns:
        `torch.Tensor`: the filtered scores; the most likely token is always kept.
    """
    if min_p is None:
        return logits
    probs = torch.softmax(logits, dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, float("-inf"))


def draw_categorical(probs: torch.Tensor,
                     generator: torch.Generator | list[torch.Generator] | None = None) -> torch.Tensor:
    """One draw per row from the categorical distribution of `probs` `(batch, vocab)` (non-negative, each row
    with some mass), by inverting its cumulative distribution with one uniform number per row.

    `torch.multinomial` (which `generate` uses) draws one exponential number per vocabulary entry; on a CPU that
    random stream is most of the cost of a decode step with a large vocabulary (about 20 ns per entry: 5 ms a
    step for 32 rows of 8000 words). Here the stream is `batch` numbers and the rest is a float64 cumulative sum
    and a binary search. Entries of probability 0 are never drawn (their interval of the CDF is empty).

    Args:
        probs (`torch.Tensor` of shape `(batch, vocab)`): probabilities (or unnormalised weights).
        generator (`torch.Generator` or a list of them, *optional*): random source; a list holds one generator
            per row, so that a row's draw does not depend on the rest of the batch.

    Returns:
        `torch.LongTensor` of shape `(batch,)`.
    """
    if isinstance(generator, (list, tuple)):
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device) for g in generator])
    else:
        u = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64, device=probs.device)
    return invert_cdf(probs, u)


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The entry of each row of `probs` `(batch, vocab)` whose interval of the cumulative distribution holds
    `u` `(batch,)` in `[0, 1]` (float64); `u = 1` (or a product that rounds up to the total) gives the last entry
    with mass."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # strictly below the total, so the first entry whose cumulative sum exceeds it exists and has mass
    x = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(1)


def sample_next(
    logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | list[torch.Generator] | None = None,
    *,
    prev_ids: torch.Tensor | None = None,
    prev_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token per row and return it with its raw-logit log-probability.

    Processing order follows ``generate``: repetition penalty, then for sampling temperature,
    top-k, top-p and min-p, then a draw from the resulting distribution (:func:`draw_categorical`; greedy:
    argmax after the penalty).

    Args:
        logits (`torch.Tensor` of shape `(batch, vocab)`): raw next-token logits.
        sampling ([`SamplingParams`]): how to sample.
        generator (`torch.Generator` or a list of them, *optional*): random source for the draw;
            `None` uses torch's global generator; a list holds one generator per row.
        prev_ids (`torch.LongTensor` of shape `(batch, length)`, *optional*): prompt and
            completion so far, needed when `sampling.repetition_penalty != 1`.
        prev_mask (`torch.Tensor` of shape `(batch, length)`, *optional*): 1 for real tokens of
            `prev_ids`, 0 for padding.

    Returns:
        `tuple[torch.LongTensor, torch.Tensor]`: the chosen ids `(batch,)` and their
        log-probabilities `(batch,)` under ``log_softmax(logits / temperature)`` (temperature 1
        when greedy), before any penalty or truncation.
    """
    logits = logits.float()
    temperature = 1.0 if sampling.greedy else sampling.temperature
    raw_lps = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)

    scores = logits
    if sampling.repetition_penalty != 1.0:
        if prev_ids is None:
            raise ValueError("repetition_penalty != 1 needs prev_ids.")
        scores = apply_repetition_penalty(scores, prev_ids, sampling.repetition_penalty, prev_mask)
    if sampling.greedy:
        next_ids = scores.argmax(dim=-1)
    else:
        if temperature != 1.0:
            scores = scores / temperature
        scores = filter_top_k(scores, sampling.top_k)
        scores = filter_top_p(scores, sampling.top_p)
        scores = filter_min_p(scores, sampling.min_p)
        next_ids = draw_categorical(torch.softmax(scores, dim=-1), generator)
    return next_ids, raw_lps.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
