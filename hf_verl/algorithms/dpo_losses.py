"""The DPO loss family on per-sequence log-probabilities, as pure functions.

Every function here takes the summed log-probabilities of the chosen and rejected completions under the
policy and the reference, each a tensor of shape `(B,)`, and returns per-example losses of shape `(B,)`
(or their weighted mean, for `combined_dpo_loss`). The semantics follow TRL 1.16's `DPOTrainer`, loss type
by loss type, with three deliberate departures:

- `bco_pair` takes the reward shift `delta` as an explicit argument (`bco_delta`). TRL 1.16 uses no shift
  (`delta = 0`, the default here); the BCO paper and older TRL releases use a running mean of the rewards,
  which the caller keeps and passes in.
- `robust` rejects a `label_smoothing` outside `[0, 0.5)` with an error, where TRL only logs a warning.
- `ipo` and `sigmoid_norm` divide the scores by the completion lengths, as TRL does from its completion mask;
  here the lengths are explicit arguments and are required for those two losses.

WPO weighting (`use_weighting` in TRL) and length-desensitization (`ld_alpha`) act on per-token
log-probabilities and are left to the caller: multiply the per-example losses by the pair weights, or pass
log-probabilities that are already length-desensitized.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# The f-DPO reparameterization leaves a beta * log Z(x) term that cancels only in the chosen-minus-rejected
# score difference, so only the losses built on that difference accept another f-divergence.
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
_LENGTH_NORMALIZED = ("ipo", "sigmoid_norm")
# Largest exponent kept finite after casting back, per dtype (alpha-divergence scores).
_EXP_CLAMP = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0, torch.float64: 80.0}


def f_divergence_scores(
    logratios: torch.Tensor, f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5
) -> torch.Tensor:
    """
    Maps log-ratios `log(pi / pi_ref)` through `f'(t)` of the chosen f-divergence, `t = pi / pi_ref`.

    Args:
        logratios (`torch.Tensor`):
            Per-sequence `policy_logps - ref_logps`.
        f_divergence_type (`str`, *optional*, defaults to `"reverse_kl"`):
            `"reverse_kl"`: `log t` (standard DPO); `"forward_kl"`: `1 - 1/t`; `"js_divergence"`:
            `log(2t / (t + 1))`; `"alpha_divergence"`: `(t^(alpha-1) - 1) / (alpha - 1)`, from "Beyond Reverse
            KL: Generalizing Direct Preference Optimization with Diverse Divergence Constraints" (arXiv:2309.16240).
        f_alpha_divergence_coef (`float`, *optional*, defaults to `0.5`):
            The `alpha` of the alpha-divergence; `alpha = 1` is the reverse-KL limit.

    Returns:
        `torch.Tensor`: the scores, same shape and dtype as `logratios`.
    """
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        alpha = f_alpha_divergence_coef
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        exponent = ((alpha - 1.0) * logratios).float().clamp(max=_EXP_CLAMP.get(logratios.dtype, 80.0))
        return (torch.exp(exponent) - 1.0).to(logratios.dtype) / (alpha - 1.0)
    raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}; choose one of {F_DIVERGENCE_TYPES}.")


def implicit_rewards(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DPO implicit rewards `beta * (policy_logps - ref_logps)` of chosen and rejected, detached, each `(B,)`."""
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return chosen_rewards, rejected_rewards


def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, float]:
    """TRL's reward metrics from the implicit rewards: `rewards/{chosen,rejected,margins,accuracies}` batch means."""
    return {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
    }


def _check_arguments(loss_type: str, label_smoothing: float, f_divergence_type: str) -> None:
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose one of {DPO_LOSS_TYPES}.")
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}; choose one of {F_DIVERGENCE_TYPES}.")
    if f_divergence_type != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(
            f"f_divergence_type={f_divergence_type!r} is only defined for loss types {F_DIVERGENCE_LOSS_TYPES}, "
            f"not {loss_type!r}; use f_divergence_type='reverse_kl' with {loss_type!r}."
        )
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"loss_type='robust' needs label_smoothing in [0, 0.5) (the assumed label-flip rate), got "
            f"{label_smoothing}; set label_smoothing to e.g. 0.1, or below 0.5."
        )
    if loss_type == "exo_pair" and not 0.0 < label_smoothing < 1.0:
        raise ValueError(
            f"loss_type='exo_pair' needs label_smoothing in (0, 1), got {label_smoothing}; "
            "the EXO paper recommends label_smoothing=1e-3."
        )


def dpo_loss(
    loss_type: str,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    bco_delta: float | torch.Tensor = 0.0,
    chosen_nll: torch.Tensor | None = None,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    Per-example loss of one DPO-family `loss_type`.

    Notation: `c = chosen_logps - ref_chosen_logps`, `r = rejected_logps - ref_rejected_logps` (the log-ratios),
    `s_c, s_r` the f-divergence scores of `c, r` (equal to `c, r` for reverse KL), `d = s_c - s_r`, `b = beta`,
    `eps = label_smoothing`, `sigma` the logistic function.

    - `sigmoid`: `-log sigma(b d)`. "Direct Preference Optimization" (arXiv:2305.18290).
    - `hinge`: `max(0, 1 - b d)`. "Statistical Rejection Sampling Improves Preference Optimization" (arXiv:2309.06657).
    - `ipo`: `(s_c / n_c - s_r / n_r - 1 / (2 b))^2`, `n` the completion lengths. "A General Theoretical Paradigm to
      Understand Learning from Human Preferences" (arXiv:2310.12036).
    - `exo_pair`: `KL(q || p)`, `q = (sigma(b d), sigma(-b d))`, `p = (1 - eps, eps)`. "Towards Efficient Exact
      Optimization of Language Model Alignment" (arXiv:2402.00856).
    - `nca_pair`: `-log sigma(b c) - log sigma(-b c) / 2 - log sigma(-b r) / 2`. "Noise Contrastive Alignment of
      Language Models with Explicit Rewards" (arXiv:2402.05369).
    - `robust`: `(-(1 - eps) log sigma(b d) + eps log sigma(-b d)) / (1 - 2 eps)`. "Provably Robust DPO: Aligning
      Language Models with Noisy Feedback" (arXiv:2403.00409).
    - `bco_pair`: `-log sigma(b c - delta) - log sigma(-(b r - delta))`. "Binary Classifier Optimization for Large
      Language Model Alignment" (arXiv:2404.04656).
    - `sppo_hard`: `(c - 1 / (2 b))^2 + (r + 1 / (2 b))^2`. "Self-Play Preference Optimization for Language Model
      Alignment" (arXiv:2405.00675), with hard win probabilities 1 and 0.
    - `aot`: `-(1 - eps) log sigma(b x) - eps log sigma(-b x)`, `x = sort(pi_c - pi_r) - sort(ref_c - ref_r)` over
      the batch. "Distributional Preference Alignment of LLMs via Optimal Transport" (arXiv:2406.05882).
    - `aot_unpaired`: as `aot` with `x = sort(c) - sort(r)` (same paper).
    - `apo_zero`: `1 - sigma(b c) + sigma(b r)`. "Anchored Preference Optimization and Contrastive Revisions"
      (arXiv:2408.06266), Eq. 7.
    - `apo_down`: `sigma(b c) + 1 - sigma(b (c - r))` (same paper, Eq. 8).
    - `discopop`: `(1 - w) (-log sigma(b d)) + w exp(-b d)`, `w = sigma(b d / tau)`. "Discovering Preference
      Optimization Algorithms with and for Large Language Models" (arXiv:2406.08414).
    - `sft`: `chosen_nll`, the negative log-likelihood of the chosen completions.
    - `sigmoid_norm`: `-log sigma(b (s_c / n_c - s_r / n_r))`, length-normalized DPO (TRL).

    Args:
        loss_type (`str`):
            One of `DPO_LOSS_TYPES`.
        chosen_logps, rejected_logps (`torch.Tensor`):
            Per-sequence summed policy log-probabilities of the chosen and rejected completions, shape `(B,)`.
        ref_chosen_logps, ref_rejected_logps (`torch.Tensor`):
            The same under the reference model, shape `(B,)`.
        beta (`float`, *optional*, defaults to `0.1`):
            Deviation from the reference; for `ipo` the regularization `tau` of the paper.
        label_smoothing (`float`, *optional*, defaults to `0.0`):
            Assumed rate of flipped preference labels, used by `robust` (in `[0, 0.5)`), `exo_pair` (in `(0, 1)`),
            `aot` and `aot_unpaired`.
        f_divergence_type (`str`, *optional*, defaults to `"reverse_kl"`):
            One of `F_DIVERGENCE_TYPES`; anything but `"reverse_kl"` only for `F_DIVERGENCE_LOSS_TYPES`.
        f_alpha_divergence_coef (`float`, *optional*, defaults to `0.5`):
            The `alpha` of `"alpha_divergence"` (TRL's default).
        discopop_tau (`float`, *optional*, defaults to `0.05`):
            Temperature of the DiscoPOP mixing weight.
        bco_delta (`float` or `torch.Tensor`, *optional*, defaults to `0.0`):
            Reward shift of `bco_pair`: `0.0` reproduces TRL 1.16; the BCO paper uses a running mean of the
            detached implicit rewards of chosen and rejected, kept by the caller.
        chosen_nll (`torch.Tensor`, *optional*):
            Required for `sft`: a scalar (TRL: the mean per-token NLL over all chosen tokens of the batch),
            broadcast to `(B,)`, or per-example values of shape `(B,)`.
        chosen_lengths, rejected_lengths (`torch.Tensor`, *optional*):
            Required for `ipo` and `sigmoid_norm`: the number of completion tokens of each sequence, `(B,)`
            (clamped to at least 1). Pass ones if the log-probabilities are already per-token means.

    Returns:
        `torch.Tensor`: per-example losses, shape `(B,)`; `aot` and `aot_unpaired` pair examples by rank after
        sorting, so their `i`-th entry is not tied to the `i`-th input pair.
    """
    _check_arguments(loss_type, label_smoothing, f_divergence_type)
    if chosen_logps.dim() != 1 or any(
        t.shape != chosen_logps.shape for t in (rejected_logps, ref_chosen_logps, ref_rejected_logps)
    ):
        raise ValueError("chosen_logps, rejected_logps and the two reference log-probs must all have shape (B,).")
    c = chosen_logps - ref_chosen_logps
    r = rejected_logps - ref_rejected_logps
    s_c = f_divergence_scores(c, f_divergence_type, f_alpha_divergence_coef)
    s_r = f_divergence_scores(r, f_divergence_type, f_alpha_divergence_coef)
    d = s_c - s_r
    b, eps = beta, label_smoothing

    if loss_type in _LENGTH_NORMALIZED:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                f"loss_type={loss_type!r} divides by the completion lengths, as TRL does; pass chosen_lengths and "
                "rejected_lengths (token counts, shape (B,)), or ones if the log-probs are per-token means."
            )
        d = s_c / chosen_lengths.clamp(min=1) - s_r / rejected_lengths.clamp(min=1)

    if loss_type in ("sigmoid", "sigmoid_norm"):
        return -F.logsigmoid(b * d)
    if loss_type == "hinge":
        return torch.relu(1 - b * d)
    if loss_type == "ipo":
        return (d - 1 / (2 * b)) ** 2
    if loss_type == "exo_pair":
        q_w, q_l = torch.sigmoid(b * d), torch.sigmoid(-b * d)
        return q_w * (F.logsigmoid(b * d) - math.log1p(-eps)) + q_l * (F.logsigmoid(-b * d) - math.log(eps))
    if loss_type == "nca_pair":
        return -F.logsigmoid(b * c) - 0.5 * F.logsigmoid(-b * c) - 0.5 * F.logsigmoid(-b * r)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(b * d) + eps * F.logsigmoid(-b * d)) / (1 - 2 * eps)
    if loss_type == "bco_pair":
        return -F.logsigmoid(b * c - bco_delta) - F.logsigmoid(-(b * r - bco_delta))
    if loss_type == "sppo_hard":
        return (c - 0.5 / b) ** 2 + (r + 0.5 / b) ** 2
    if loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            policy_margins = torch.sort(chosen_logps - rejected_logps).values
            x = policy_margins - torch.sort(ref_chosen_logps - ref_rejected_logps).values
        else:
            x = torch.sort(c).values - torch.sort(r).values
        return -(1 - eps) * F.logsigmoid(b * x) - eps * F.logsigmoid(-b * x)
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(b * c) + torch.sigmoid(b * r)
    if loss_type == "apo_down":
        return torch.sigmoid(b * c) + 1 - torch.sigmoid(b * (c - r))
    if loss_type == "discopop":
        w = torch.sigmoid(b * d / discopop_tau)
        return -F.logsigmoid(b * d) * (1 - w) + torch.exp(-b * d) * w
    # sft
    if chosen_nll is None:
        raise ValueError("loss_type='sft' needs chosen_nll: the mean per-token NLL of the chosen completions.")
    return chosen_nll.expand_as(chosen_logps) if chosen_nll.dim() == 0 else chosen_nll


def combined_dpo_loss(
    loss_types: list[str],
    loss_weights: list[float] | None,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    pair_weights: torch.Tensor | None = None,
    **loss_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """
    Weighted sum of batch-mean DPO losses, `sum_k w_k * mean(dpo_loss(loss_types[k], ...))`, as TRL combines a
    list of `loss_type`s (e.g. MPO: `["sigmoid", "bco_pair", "sft"]` with weights `[0.8, 0.2, 1.0]`).

    Args:
        loss_types (`list[str]`):
            Distinct entries of `DPO_LOSS_TYPES`.
        loss_weights (`list[float]` or `None`):
            One weight per loss type; `None` weighs each by 1.
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps (`torch.Tensor`):
            As in [`dpo_loss`].
        pair_weights (`torch.Tensor` `(B,)`, *optional*):
            Per-pair weights multiplying every loss type's per-pair loss before the mean (WPO, `wpo_weights`).
        **loss_kwargs:
            The keyword arguments of [`dpo_loss`] (`beta`, `label_smoothing`, ...), shared by all loss types.

    Returns:
        `tuple[torch.Tensor, dict[str, torch.Tensor]]`: the scalar total (differentiable), and each loss type's
        unweighted batch-mean loss, detached, for logging.
    """
    if not loss_types:
        raise ValueError(f"loss_types is empty; give at least one of {DPO_LOSS_TYPES}.")
    if len(set(loss_types)) != len(loss_types):
        raise ValueError(f"loss_types {loss_types} repeats a loss type; list each once and add up its weights.")
    if loss_weights is None:
        loss_weights = [1.0] * len(loss_types)
    if len(loss_weights) != len(loss_types):
        raise ValueError(
            f"loss_weights has {len(loss_weights)} entries for {len(loss_types)} loss_types {loss_types}; "
            "give one weight per loss type, or None for equal weights."
        )
    for loss_type in loss_types:  # validate all before computing any
        _check_arguments(
            loss_type, loss_kwargs.get("label_smoothing", 0.0), loss_kwargs.get("f_divergence_type", "reverse_kl")
        )
    total = chosen_logps.new_zeros(())
    means = {}
    for loss_type, weight in zip(loss_types, loss_weights):
        per_pair = dpo_loss(loss_type, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, **loss_kwargs)
        mean = (per_pair * pair_weights).mean() if pair_weights is not None else per_pair.mean()
        total = total + weight * mean
        means[loss_type] = mean.detach()
    return total, means


def ld_token_weights(owner: torch.Tensor, num_sequences: int, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's per-token weights (Liu et al., 2024, arXiv 2409.06411): a completion token counts fully up to
    the length of the shorter answer of its pair and `ld_alpha` beyond it.

    Args:
        owner (`torch.Tensor` `(N,)`): the sequence of each scored completion token, tokens of one sequence
            contiguous and in order; sequences `0..B-1` are the chosen answers, `B..2B-1` the rejected ones.
        num_sequences (`int`): `2B`. ld_alpha (`float`): the weight of the tokens past the shared length.
    """
    counts = torch.bincount(owner, minlength=num_sequences)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(owner.numel(), device=owner.device) - starts[owner] + 1  # 1-based within its answer
    chosen, rejected = counts.chunk(2)
    shared = torch.minimum(chosen, rejected).repeat(2)
    inside = position <= shared[owner]
    return torch.where(inside, 1.0, float(ld_alpha))


def wpo_weights(token_logps: torch.Tensor, token_log_sum_sq: torch.Tensor, owner: torch.Tensor,
                num_sequences: int) -> torch.Tensor:
    """WPO's per-pair weights (Zhou et al., 2024, arXiv 2406.11827, eq. 2): each answer's
    `exp(mean_t(logp_t - log sum_v p_v^2))` (the probability of the answer under the policy, aligned by the
    expected probability of a sampled token), chosen times rejected, without gradient; `(B,)`."""
    aligned = (token_logps - token_log_sum_sq).detach()
    sums = torch.zeros(num_sequences, dtype=aligned.dtype, device=aligned.device).index_add(0, owner, aligned)
    counts = torch.bincount(owner, minlength=num_sequences).clamp(min=1).to(aligned.dtype)
    weights = torch.exp(sums / counts)
    chosen, rejected = weights.chunk(2)
    return chosen * rejected
