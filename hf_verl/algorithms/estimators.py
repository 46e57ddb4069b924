"""Advantage estimators beyond GRPO, token-level rewards, whitening and KL controllers.

All tensor functions are pure and take detached inputs. Completions are right-padded: token
tensors are `(B, T)` with a 0/1 response `mask` that is 1 on the real completion tokens,
contiguous from position 0. Outcome estimators take one score per completion, `(B,)`, and return
token-level advantages `(B, T)` broadcast over the mask (0 on padding). Groups are contiguous:
completions `g*G .. g*G+G-1` answer the same prompt. A multi-turn rollout's mask has holes (0 on
its tool observations, between the model's turns): the recursions of `gae_advantages` and
`reinforce_pp_advantages` step over them, carrying the next value, advantage and return across
(verl's multi-turn handling), and `token_level_rewards` puts the score on the last valid token.

Semantics follow verl's `core_algos.py` and TRL's PPO trainer. Departures:

- `gae_advantages` does not whiten its advantages; verl and TRL whiten them with
  `masked_whiten` before the loss, which the caller does explicitly.
- `rloo_advantages` rejects `num_generations < 2` (verl keeps the raw score for a group of one).
- `remax_advantages` takes per-sequence scores; verl subtracts the baseline from the return-to-go
  of the token rewards, which equals the score when the rewards are outcome-only.
"""

from __future__ import annotations

import torch

from hf_verl.algorithms.advantages import grpo_advantages
from hf_verl.algorithms.policy_loss import masked_mean
from hf_verl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,  # noqa: F401 (importable from here, as before the registry)
    get_advantage_estimator,
    register_advantage_estimator,
)


def _check_groups(n: int, num_generations: int | None, name: str) -> int:
    if num_generations is None:
        raise ValueError(f"estimator {name!r} needs num_generations (the group size).")
    if num_generations < 1 or n % num_generations:
        raise ValueError(
            f"estimator {name!r}: batch of {n} completions does not split into groups of "
            f"num_generations={num_generations}."
        )
    return num_generations


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`(B,)` -> `(B, T)`, equal to `per_seq` on the mask and 0 on padding (`(B,)` if no mask)."""
    if mask is None:
        return per_seq
    return per_seq.unsqueeze(-1) * mask.to(per_seq.dtype)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise `values` by the mean and unbiased variance of its masked entries (TRL/verl).

    `whitened = (values - mean) / sqrt(var + eps)`, with `mean` and `var` taken over entries where
    `mask` is 1 and `var` scaled by `n / (n - 1)`. Padded entries are transformed too (not zeroed).

    Args:
        values (`torch.Tensor`): any shape. mask (`torch.Tensor`): same shape, 0/1.
        shift_mean (`bool`): if `False`, add the mean back (scale only).
        eps (`float`): added to the variance.

    Returns:
        `torch.Tensor` of the shape of `values`.
    """
    n = mask.sum()
    if n < 2:
        raise ValueError(f"masked_whiten needs at least 2 masked entries, got {int(n)}.")
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean).square(), mask) * (n / (n - 1))
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016, arXiv 1506.02438) over the mask.

    `delta_t = r_t + gamma * V_{t+1} - V_t` with `V` beyond the last valid token equal to 0, and
    `A_t = delta_t + gamma * lam * A_{t+1}`, computed in reverse time. `returns = A + V`. Positions
    where `mask` is 0 (padding, or tool observations inside a multi-turn completion) are skipped:
    `t + 1` is the next valid token, whose value and advantage are carried across the gap (verl).

    Args:
        token_rewards, values, mask (`torch.Tensor` `(B, T)`): per-token rewards, critic values
            and response mask.
        gamma (`float`): discount. lam (`float`): GAE lambda.

    Returns:
        `(advantages, returns)`, both `(B, T)` and 0 on padding; not whitened.
    """
    maskf = mask.to(values.dtype)
    next_value = values.new_zeros(values.shape[0])
    next_adv = values.new_zeros(values.shape[0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = maskf[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        # a masked position (padding, a tool observation) leaves the next value and advantage as they are
        next_value = values[:, t] * m + next_value * (1 - m)
        next_adv = adv * m + next_adv * (1 - m)
    returns = (advantages + values) * maskf
    return advantages, returns


def token_level_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards as in TRL's PPO: the score on the last valid token, minus `kl_coef * kl`.

    Args:
        scores (`torch.Tensor` `(B,)`): one score per completion.
        mask (`torch.Tensor` `(B, T)`): response mask. A row with no valid token gets no score.
        kl (`torch.Tensor` `(B, T)`, *optional*): per-token KL estimate to the reference.
        kl_coef (`float`): penalty coefficient.

    Returns:
        `(token_rewards, non_score_reward)`, both `(B, T)` and 0 on padding, where
        `non_score_reward = -kl_coef * kl` and `token_rewards` is `non_score_reward` plus the score
        on the last valid token.
    """
    maskf = mask.to(scores.dtype)
    if kl is None:
        non_score = torch.zeros_like(maskf)
    else:
        non_score = -kl_coef * kl.to(scores.dtype) * maskf
    lengths = mask.long().sum(-1)
    # the last valid position (the last token when the mask is contiguous from 0; a multi-turn mask has holes)
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    last = ((mask.long() != 0).long() * positions).amax(-1, keepdim=True).sub(1).clamp(min=0)
    placed = torch.zeros_like(maskf).scatter(-1, last, (scores * (lengths > 0)).unsqueeze(-1))
    return non_score + placed, non_score


def rloo_advantages(
    scores: torch.Tensor, num_generations: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al., 2024, arXiv 2402.14740).

    `A_i = r_i - (sum_{j in group, j != i} r_j) / (G - 1)`. Needs `num_generations >= 2`. A NaN score (an
    unscorable completion) is left out of its siblings' baselines (the divisor counts scorable siblings) and gets 0,
    as does a completion with no scorable sibling.

    Returns:
        `(B, T)` broadcast over `mask` (0 on padding), or `(B,)` when `mask` is `None`.
    """
    g = _check_groups(scores.numel(), num_generations, "rloo")
    if g < 2:
        raise ValueError("estimator 'rloo' needs num_generations >= 2 (a leave-one-out baseline).")
    grouped = scores.view(-1, g)
    # NaN (an unscorable completion) takes no part in its siblings' baselines and gets advantage 0 (TRL's RLOO); a
    # group with one scorable completion has no baseline: 0
    scorable = (~grouped.isnan()).sum(-1, keepdim=True)
    baseline = (grouped.nansum(-1, keepdim=True) - grouped) / (scorable - 1)
    return _broadcast(torch.nan_to_num(grouped - baseline, nan=0.0).reshape(-1), mask)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025, arXiv 2501.03262).

    `G_t = sum_{s >= t} gamma^(s-t) r_s` over each row's valid tokens (the token rewards include
    the KL penalty), then `A = masked_whiten(G, mask)` over the whole batch; 0 on padding. Masked
    positions inside a completion (tool observations) carry the return across unchanged (verl).
    """
    maskf = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        m = maskf[:, t]
        step = token_rewards[:, t] + gamma * running
        returns[:, t] = step * m
        running = step * m + running * (1 - m)
    return masked_whiten(returns, mask) * maskf


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor, mask: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu, 2025, arXiv 2501.03262; verl's version).

    `A_i = r_i - mean_group(r)`, broadcast over the mask, then whitened with `masked_whiten` over
    all valid tokens of the batch (so each sequence weighs by its length, as in verl).
    """
    g = _check_groups(scores.numel(), num_generations, "reinforce_plus_plus_baseline")
    grouped = scores.view(-1, g)
    centred = (grouped - grouped.mean(-1, keepdim=True)).reshape(-1)
    return masked_whiten(_broadcast(centred, mask), mask) * mask.to(scores.dtype)


def remax_advantages(
    scores: torch.Tensor, greedy_scores: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """ReMax (Li et al., 2023, arXiv 2310.10505): `A_i = r_i - r_greedy(prompt_i)`.

    `greedy_scores` `(B,)` holds, for each sample, the score of the greedy completion of its
    prompt. Broadcast over the mask.
    """
    if greedy_scores.shape != scores.shape:
        raise ValueError(
            f"greedy_scores shape {tuple(greedy_scores.shape)} != scores shape "
            f"{tuple(scores.shape)}."
        )
    return _broadcast(scores - greedy_scores, mask)


def dr_grpo_advantages(
    scores: torch.Tensor, num_generations: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Dr. GRPO (Liu et al., 2025, arXiv 2503.20783): `A_i = r_i - mean_group(r)`, no std scaling.

    Returns:
        `(B, T)` broadcast over `mask` (0 on padding), or `(B,)` when `mask` is `None`.
    """
    _check_groups(scores.numel(), num_generations, "dr_grpo")
    advantages, _ = grpo_advantages(scores, num_generations, scale_rewards="none")
    return _broadcast(advantages, mask)


def gpg_advantages(scores: torch.Tensor, num_generations: int, mask: torch.Tensor | None = None,
                   f_norm: float = 1.0) -> torch.Tensor:
    """GPG (Chu et al., 2025, arXiv 2504.02546): `A_i = alpha (r_i - mean_group(r)) / f_norm` with
    `alpha = B / #{i : r_i != 0}`, which rescales the gradient when few completions are rewarded."""
    g = _check_groups(scores.numel(), num_generations, "gpg")
    alpha = scores.numel() / max(int((scores != 0).sum()), 1)
    grouped = scores.view(-1, g)
    centred = (grouped - grouped.mean(-1, keepdim=True)) if g > 1 else grouped
    return _broadcast(alpha * centred.reshape(-1) / f_norm, mask)


def grpo_passk_advantages(scores: torch.Tensor, num_generations: int, mask: torch.Tensor | None = None,
                          scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Pass@k GRPO (Chen et al., 2025, arXiv 2503.19595): only each group's best completion gets an advantage,
    the margin over the second best `r_1 - r_2` (divided by the group's unbiased std + eps when
    `scale_by_std`); every other completion gets 0."""
    g = _check_groups(scores.numel(), num_generations, "grpo_passk")
    if g < 2:
        raise ValueError("estimator 'grpo_passk' needs num_generations >= 2.")
    grouped = scores.view(-1, g)
    top = torch.topk(grouped, 2, dim=-1)
    margin = top.values[:, 0] - top.values[:, 1]
    if scale_by_std:
        margin = margin / (grouped.std(-1) + eps)
    adv = torch.zeros_like(grouped)
    adv.scatter_(1, top.indices[:, :1], margin.unsqueeze(1))
    return _broadcast(adv.reshape(-1), mask)


def opo_advantages(scores: torch.Tensor, num_generations: int, mask: torch.Tensor) -> torch.Tensor:
    """OPO (Hao et al., 2025, arXiv 2505.23585): the baseline is the group's length-weighted mean score
    `sum_j L_j r_j / sum_j L_j` (`L` the response lengths); no std scaling."""
    g = _check_groups(scores.numel(), num_generations, "opo")
    lengths = mask.to(scores.dtype).sum(-1).view(-1, g)
    grouped = scores.view(-1, g)
    baseline = (lengths * grouped).sum(-1, keepdim=True) / lengths.sum(-1, keepdim=True).clamp(min=1e-12)
    if g == 1:
        baseline = torch.zeros_like(baseline)
    return _broadcast((grouped - baseline).reshape(-1), mask)


def gdpo_token_advantages(scores_per_func: torch.Tensor, num_generations: int, mask: torch.Tensor,
                          weights=None, eps: float = 1e-6) -> torch.Tensor:
    """verl's `gdpo` estimator: the weighted sum over reward functions of each function's GRPO advantage
    (`(r - mean_group) / (std_group + eps)`), whitened over the batch's valid tokens (longer completions weigh
    more), 0 on padding. With one reward function it is the token-whitened GRPO advantage."""
    if scores_per_func.dim() == 1:
        scores_per_func = scores_per_func.unsqueeze(1)
    n, k = scores_per_func.shape
    g = _check_groups(n, num_generations, "gdpo")
    w = [1.0] * k if weights is None else list(weights)
    total = scores_per_func.new_zeros(n)
    for j in range(k):
        grouped = scores_per_func[:, j].view(-1, g)
        if g > 1:
            adv = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + eps)
        else:
            adv = grouped  # a group of one: mean 0, std 1 (verl)
        total = total + w[j] * adv.reshape(-1)
    return masked_whiten(_broadcast(total, mask), mask) * mask.to(total.dtype)


def optimal_token_baseline_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, old_logprobs: torch.Tensor, sum_pi_squared: torch.Tensor,
    num_generations: int, *, is_weights: torch.Tensor | None = None, handle_zero_tail: bool = True,
    eps: float = 1e-8, multi_turn: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (verl's `optimal_token_baseline`; `multi_turn=True`: `tir_optimal_token_baseline`).

    With `G_t` the reward-to-go and `W_t = sum_{s <= t} (1 - 2 pi_s + sum_v pi_v^2) [x rho_s^2]` (a cumulative
    path-variance proxy from the sampling policy's token probability `pi = exp(old_logprobs)`, the squared
    probabilities `sum_pi_squared` and optional importance weights `rho`), each position's baseline is the
    group's `sum_i G_t W_t / (sum_i W_t + eps)` (0 for a group of one), and `A_t = G_t - b_t`. With
    `handle_zero_tail`, the single longest completion of a group has no baseline past the second-longest.
    `multi_turn` aligns the positions by each row's k-th *trained* token (tool observations in between are
    skipped) instead of by absolute position.

    Returns:
        `(advantages (B, T), returns (B, T))`: advantages 0 off the mask; returns are `G_t` (not masked).
    """
    g = _check_groups(token_rewards.shape[0], num_generations, "optimal_token_baseline")
    maskf = mask.to(token_rewards.dtype)
    returns = (token_rewards * maskf).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * torch.exp(old_logprobs) + sum_pi_squared
    if is_weights is not None:
        w = w * is_weights.square()
    cum_w = (w * maskf).cumsum(-1)
    if multi_turn:  # the k-th trained token of every row at column k (stable sort keeps their order)
        order = torch.argsort((~mask.bool()).to(torch.int8), dim=1, stable=True)
        lengths = mask.bool().sum(-1)
        cmask = (torch.arange(mask.shape[1], device=mask.device) < lengths.unsqueeze(1)).to(maskf.dtype)
        G, W, m = returns.gather(1, order) * cmask, cum_w.gather(1, order) * cmask, cmask
    else:
        G, W, m = returns, cum_w, maskf
    baseline = torch.zeros_like(G)
    lengths = m.sum(-1)
    for start in range(0, G.shape[0], g):
        rows = torch.arange(start, start + g, device=G.device)
        if multi_turn:
            rows = rows[lengths[rows] > 0]  # an empty completion takes no part in its group
        if rows.numel() < 2:
            continue
        num = (G[rows] * W[rows] * m[rows]).sum(0)
        den = (W[rows] * m[rows]).sum(0) + eps
        baseline[rows] = (num / den).to(baseline.dtype)
        if handle_zero_tail:
            lens = lengths[rows]
            top2 = torch.sort(lens).values[-2:]
            longest = (lens == top2[1]).nonzero().flatten()
            if longest.numel() == 1 and top2[1] > top2[0]:
                baseline[rows[longest[0]], int(top2[0].item()):] = 0.0
    adv = (G - baseline) * m
    if multi_turn:
        adv = torch.zeros_like(adv).scatter(1, order, adv)
    return adv * maskf, returns


def compute_advantages(name: str, *, mask: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages of the registered estimator `name` (:mod:`hf_verl.algorithms.registry`).

    Args:
        name (`str`): a registered estimator (`gae`, `grpo`, `rloo`, ..., or one of your own).
        mask (`torch.Tensor` `(B, T)`): the response mask.
        inputs: the estimator's keyword inputs (see the registry's module docstring): `scores` `(B,)`,
            `token_rewards` / `values` `(B, T)`, `num_generations`, `gamma`, `lam`, `greedy_scores`,
            `scale_rewards`, `scores_per_func`, `reward_weights`, `old_logprobs`, `sum_pi_squared`. The
            estimator receives those its signature names.

    Returns:
        `(advantages (B, T), returns (B, T) or None)`: `returns` for `gae` (the critic's targets), `None` for the
        others. GAE advantages are not whitened.

    Raises:
        ValueError: an unknown name, or a required input missing.
    """
    return get_advantage_estimator(name)(mask=mask, **inputs)


# ---------------------------------------------------------------------------------------------------------------
# The built-ins, registered as a user registers one (hf_verl.algorithms.register_advantage_estimator).


@register_advantage_estimator("gae", needs_critic=True, per_sequence=True, requires=("token_rewards",))
def _gae(token_rewards, values, mask, gamma=1.0, lam=0.95, **_):
    return gae_advantages(token_rewards, values, mask, gamma, lam)


@register_advantage_estimator("grpo")
def _grpo(scores, mask, num_generations=None, scale_rewards="group", **_):
    g = _check_groups(scores.shape[0], num_generations, "grpo")
    return _broadcast(grpo_advantages(scores, g, scale_rewards)[0], mask), None


@register_advantage_estimator("rloo")
def _rloo(scores, mask, num_generations=None, **_):
    return rloo_advantages(scores, _check_groups(scores.shape[0], num_generations, "rloo"), mask), None


@register_advantage_estimator("reinforce_plus_plus", uses_groups=False, requires=("token_rewards",))
def _reinforce_pp(token_rewards, mask, gamma=1.0, **_):
    return reinforce_pp_advantages(token_rewards, mask, gamma), None


@register_advantage_estimator("reinforce_plus_plus_baseline")
def _reinforce_pp_baseline(scores, mask, num_generations=None, **_):
    g = _check_groups(scores.shape[0], num_generations, "reinforce_plus_plus_baseline")
    return reinforce_pp_baseline_advantages(scores, mask, g), None


@register_advantage_estimator("remax", uses_groups=False, requires=("scores", "greedy_scores"))
def _remax(scores, greedy_scores, mask, **_):
    return remax_advantages(scores, greedy_scores, mask), None


@register_advantage_estimator("dr_grpo")
def _dr_grpo(scores, mask, num_generations=None, **_):
    return dr_grpo_advantages(scores, _check_groups(scores.shape[0], num_generations, "dr_grpo"), mask), None


@register_advantage_estimator("gpg")
def _gpg(scores, mask, num_generations=None, **_):
    return gpg_advantages(scores, _check_groups(scores.shape[0], num_generations, "gpg"), mask), None


@register_advantage_estimator("grpo_passk")
def _grpo_passk(scores, mask, num_generations=None, scale_rewards="group", **_):
    g = _check_groups(scores.shape[0], num_generations, "grpo_passk")
    return grpo_passk_advantages(scores, g, mask, scale_by_std=scale_rewards != "none"), None


@register_advantage_estimator("opo")
def _opo(scores, mask, num_generations=None, **_):
    return opo_advantages(scores, _check_groups(scores.shape[0], num_generations, "opo"), mask), None


@register_advantage_estimator("gdpo")
def _gdpo(scores, mask, num_generations=None, scores_per_func=None, reward_weights=None, **_):
    g = _check_groups(scores.shape[0], num_generations, "gdpo")
    per_func = scores_per_func if scores_per_func is not None else scores
    return gdpo_token_advantages(per_func, g, mask, reward_weights), None


_OTB_INPUTS = ("token_rewards", "old_logprobs", "sum_pi_squared")


@register_advantage_estimator("optimal_token_baseline", requires=_OTB_INPUTS)
def _otb(token_rewards, mask, old_logprobs, sum_pi_squared, num_generations=None, **_):
    g = _check_groups(token_rewards.shape[0], num_generations, "optimal_token_baseline")
    return optimal_token_baseline_advantages(token_rewards, mask, old_logprobs, sum_pi_squared, g)[0], None


@register_advantage_estimator("tir_optimal_token_baseline", requires=_OTB_INPUTS)
def _tir_otb(token_rewards, mask, old_logprobs, sum_pi_squared, num_generations=None, **_):
    g = _check_groups(token_rewards.shape[0], num_generations, "tir_optimal_token_baseline")
    return optimal_token_baseline_advantages(token_rewards, mask, old_logprobs, sum_pi_squared, g,
                                             multi_turn=True)[0], None


BUILTIN_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
                      "dr_grpo", "gpg", "grpo_passk", "opo", "gdpo", "optimal_token_baseline",
                      "tir_optimal_token_baseline")
"""The estimators hf_verl ships (every registered name: :func:`~hf_verl.algorithms.registry.advantage_estimator_names`)."""


class FixedKLController:
    """A constant KL coefficient (TRL/verl); `update` is a no-op."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep `value` unchanged."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., 2019, arXiv 1909.08593; TRL/verl semantics).

    `error = clip(current_kl / target - 1, -0.2, 0.2)` and `value *= 1 + error * n_steps / horizon`.

    Args:
        init_kl_coef (`float`): starting coefficient. target (`float`): target KL, > 0.
        horizon (`float`): steps over which the coefficient adapts, > 0.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"target and horizon must be > 0, got target={target}, horizon={horizon}."
            )
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move `value` towards keeping `current_kl` at `target`, after `n_steps` samples."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
