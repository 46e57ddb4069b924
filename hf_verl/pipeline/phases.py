"""The trainer-side phases of a rollout: log-probs, values, advantages, importance weights.

Each phase reads engines (:class:`~hf_verl.engine.base.TrainingEngine`) and the batch, and, where a
statistic spans the whole round (group baselines, whitening, token counts), the data-parallel group
of a :class:`~hf_verl.parallel.dims.ParallelDims`: the result for a given global round is the same
on one process as split over several. Forward passes run `micro_batch` rows at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hf_verl.algorithms.estimators import masked_whiten, token_level_rewards
from hf_verl.algorithms.importance import importance_weights
from hf_verl.algorithms.policy_losses import entropy_quantile
from hf_verl.algorithms.registry import get_advantage_estimator
from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.base import TrainingEngine
from hf_verl.engine.parts import ScoringEngine
from hf_verl.engine.step import LogProbs, SamplingStatistics, Values
from hf_verl.parallel import comm, watchdog
from hf_verl.parallel.dims import ParallelDims
from hf_verl.pipeline.cross_tokenizer import CrossTokenizer


def policy_logprobs(actor: TrainingEngine, batch: RolloutBatch, *, temperature: float, chunk_size: int,
                    micro_batch: int) -> torch.Tensor:
    """The actor's `(B, C)` log-probs of the sampled tokens (the PPO "old" policy), no gradient."""
    return actor.infer(batch, LogProbs(temperature=temperature, chunk_size=chunk_size), micro_batch=micro_batch).logp


def sampling_statistics(actor: TrainingEngine, batch: RolloutBatch, *, temperature: float, chunk_size: int,
                        micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(old log-probs, sum_v pi_v^2)`, both `(B, C)`, of the actor on a rollout (no gradient): the inputs of
    the optimal-token-baseline estimators."""
    return actor.infer(batch, SamplingStatistics(temperature=temperature, chunk_size=chunk_size),
                       micro_batch=micro_batch)


def reference_logprobs(reference: ScoringEngine | None, actor: TrainingEngine, batch: RolloutBatch, *,
                       temperature: float, chunk_size: int, micro_batch: int,
                       cross: CrossTokenizer | None = None) -> torch.Tensor:
    """`(B, C)` log-probs under the reference: its own engine, else the actor with PEFT adapters off. A reference
    on another tokenizer (`cross`, :mod:`hf_verl.pipeline.cross_tokenizer`) scores the re-tokenised text and its
    log-probs are aligned back to the actor's tokens by character offsets.

    Raises:
        ValueError: with neither a reference engine nor adapters to disable.
    """
    if reference is not None and cross is not None:
        return cross.logprobs(reference, actor, batch, temperature=temperature, chunk_size=chunk_size,
                              micro_batch=micro_batch)
    if reference is not None:
        return policy_logprobs(reference, batch, temperature=temperature, chunk_size=chunk_size,
                               micro_batch=micro_batch)
    if not actor.has_adapters:
        raise ValueError("a KL term needs a reference policy: pass a reference model (id, path or a frozen copy "
                         "of the actor), or train a PEFT actor (adapters disabled serve as the reference).")
    with actor.adapters_disabled():
        return policy_logprobs(actor, batch, temperature=temperature, chunk_size=chunk_size, micro_batch=micro_batch)


def critic_values(critic: TrainingEngine, batch: RolloutBatch, *, micro_batch: int) -> torch.Tensor:
    """The critic's `(B, C)` values of the states before each completion token, 0 on padding."""
    return critic.infer(batch, Values(), micro_batch=micro_batch)


def global_masked_whiten(dims: ParallelDims, values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                         eps: float = 1e-8) -> torch.Tensor:
    """:func:`~hf_verl.algorithms.estimators.masked_whiten` with the mean and (unbiased) variance taken
    over the masked entries of every data-parallel rank (the same formula, two scalar all-reduces)."""
    if dims.dp_size == 1:
        return masked_whiten(values, mask, shift_mean=shift_mean, eps=eps)
    maskf = mask.to(values.dtype)
    local = torch.stack([(values * maskf).sum(), maskf.sum()])
    total, count = comm.reduce(dims, local, "sum").unbind()
    if count < 2:
        raise ValueError(f"masked_whiten needs at least 2 masked entries, got {int(count)}.")
    mean = total / count
    sq = comm.reduce(dims, ((values - mean).square() * maskf).sum().reshape(1), "sum")[0]
    var = sq / count * (count / (count - 1))
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


# estimator inputs with one row per completion: gathered over the data-parallel ranks for a batch-wide estimator
_ROW_INPUTS = ("greedy_scores", "scores_per_func")
_TOKEN_INPUTS = ("values", "old_logprobs", "sum_pi_squared")


@watchdog.phase("advantages", role="actor")
def advantages(dims: ParallelDims, estimator: str, *, scores: torch.Tensor, mask: torch.Tensor,
               num_generations: int | None, token_rewards: torch.Tensor | None = None,
               **inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(advantages (B, C), returns (B, C) or None)` of this rank's rows with the registered `estimator`
    (:mod:`hf_verl.algorithms.registry`).

    `token_rewards` default to the score on the last completion token. A per-sequence estimator (`gae`) runs on the
    local rows; a batch-wide one (every group estimator, whitening, a user's unless registered `per_sequence`) runs
    on the rows of every data-parallel rank (a group may span ranks) and returns this rank's slice. `inputs` are the
    estimator's other keyword inputs (`values`, `gamma`, `lam`, `greedy_scores`, `scale_rewards`, ...).
    """
    spec = get_advantage_estimator(estimator)
    if spec.per_sequence or dims.dp_size == 1:
        if token_rewards is None:
            token_rewards, _ = token_level_rewards(scores, mask)
        return spec(scores=scores, mask=mask, num_generations=num_generations, token_rewards=token_rewards, **inputs)
    n, width = mask.shape
    all_scores = comm.gather_rows(dims, scores)
    all_mask = comm.gather_padded(dims, mask, dim=1)
    if token_rewards is None:
        all_tokens, _ = token_level_rewards(all_scores, all_mask)
    else:
        all_tokens = comm.gather_padded(dims, token_rewards, dim=1)
    gathered = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and name in _ROW_INPUTS:
            value = comm.gather_rows(dims, value)
        elif isinstance(value, torch.Tensor) and name in _TOKEN_INPUTS:
            value = comm.gather_padded(dims, value, dim=1)
        gathered[name] = value
    adv, returns = spec(scores=all_scores, mask=all_mask, num_generations=num_generations, token_rewards=all_tokens,
                        **gathered)
    adv = comm.local_rows(dims, adv, n)[:, :width]
    return adv, None if returns is None else comm.local_rows(dims, returns, n)[:, :width]


def global_token_count(dims: ParallelDims, mask: torch.Tensor) -> float:
    """Completion tokens of `mask` summed over the data-parallel ranks."""
    return float(comm.reduce(dims, mask.sum().to(torch.float64).reshape(1), "sum").item())


def micro_batch_token_counts(dims: ParallelDims, micro_batches: list[RolloutBatch]) -> list[float]:
    """Per micro-batch: completion tokens of the same micro-batch on every data-parallel rank (a float count).
    A token-mean loss divided by the count over the data-parallel size, averaged over ranks by the gradient
    reduction, is the token mean of the global micro-batch, whatever the layout."""
    counts = torch.tensor([float(mb.completion_mask.sum()) for mb in micro_batches], dtype=torch.float64)
    return comm.reduce(dims, counts, "sum").tolist()


def attach_importance_weights(batch: RolloutBatch, *, mode: str, clip_min: float | None, clip_max: float | None,
                              correct: bool) -> dict[str, float]:
    """Compare the engine's sampling log-probs with the actor's old ones; with `correct`, put the
    truncated / masked importance weights into `batch.is_weights`. Returns TRL's `sampling/*` metrics
    (empty when the engine gave no log-probs)."""
    batch.is_weights = None  # weights of an earlier call (other settings) never linger
    lp, mask = batch.sampling_logprobs, batch.completion_mask.bool()
    if lp is None or batch.old_logprobs is None or (mask.any() and not torch.isfinite(lp[mask]).any()):
        return {}
    weights, stats = importance_weights(batch.old_logprobs, lp, batch.completion_mask, mode, clip_min, clip_max)
    if correct:
        batch.is_weights = weights.detach().float()
    return stats


def entropy_threshold(dims: ParallelDims, entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float) -> float | None:
    """The entropy a token needs to be among the top `top_quantile` of the completion tokens of every
    data-parallel rank (TRL's `top_entropy_quantile`); None when it is 1 (every token trains)."""
    if top_quantile >= 1.0:
        return None
    values = comm.gather_ragged(dims, entropy.detach()[mask.bool()])
    return entropy_quantile(values, 1.0 - top_quantile)


def set_entropy_thresholds(actor: TrainingEngine, dims: ParallelDims, micro_batches: list[RolloutBatch],
                           request: LogProbs, top_quantile: float) -> None:
    """TRL's `top_entropy_quantile` for a step: each micro-batch's :func:`entropy_threshold` over every rank's
    tokens, from a forward-only pass before the step (the step's loss function runs no collective), written into
    its `loss_inputs`. Nothing to do when `top_quantile` is 1 (every token trains)."""
    if top_quantile >= 1.0:
        return
    request = dataclasses.replace(request, with_entropy=True, with_aux_loss=False)
    result = actor.forward_backward(micro_batches, lambda out, mb: (out.logp.new_zeros(()), {}), forward=request,
                                    forward_only=True, keep_outputs=True)
    for mb, out in zip(micro_batches, result.outputs):
        threshold = entropy_threshold(dims, out.entropy, mb.completion_mask, top_quantile)
        mb.loss_inputs = dataclasses.replace(mb.loss_inputs, entropy_threshold=threshold)
