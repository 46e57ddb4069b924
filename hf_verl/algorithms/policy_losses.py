"""Per-token policy-gradient losses by name (TRL's loss types and verl's policy losses), as pure functions.

Every loss takes the current log-probs `logp` `(B, T)` (with gradient), the behaviour log-probs
`old_logp` `(B, T)`, advantages `(B,)` or `(B, T)`, the 0/1 loss `mask` `(B, T)` and a
:class:`PolicyLossParams`, and returns `(per_token_loss, stats)`: the per-token loss, of shape `(B, T)`
or `(B, 1)` for a sequence-level loss (it broadcasts over the tokens), before aggregation
(:func:`~hf_verl.algorithms.policy_loss.aggregate_loss`) and before any importance-sampling, masking or
KL term; `stats` hold per-token (or per-sequence) float indicators whose masked means are logged.

The importance ratio is `w = exp(log_w)` with `log_w` from :func:`log_importance_weights`: per token,
or per sequence (GSPO, Zheng et al., 2025: the mean log-ratio over the sequence's tokens).

Losses (`name`: formula, source):

- ``clip`` (TRL grpo/bnpo/dr_grpo/dapo/luspo; verl ``vanilla``): `-min(w A, clip(w, 1-eps_low, 1+eps_high) A)`,
  with `w` capped at `delta` first when set (two-sided clipping, TRL) and, for `A < 0`, the loss capped at
  `-dual_clip x A` (dual clip, Ye et al., 2020; verl ``clip_ratio_c``).
- ``sequence_clip`` (TRL's RLOO): ``clip`` on the sequence's ratio, the product of its token ratios; `(B, 1)`.
- ``gspo`` (Zheng et al., 2025; verl): ``clip`` on the sequence-level ratio, written per token
  (`log w_t = sg[log w_seq] + logp_t - sg[logp_t]`, equal in value to `w_seq`).
- ``cispo`` (MiniMax-M1, 2025): `-sg[min(w, eps_high)] A logp` (TRL's `epsilon_high` is the cap itself).
- ``sapo`` (Gao et al., 2025): soft gate `-(4 / tau) sigmoid(tau (w - 1)) A`, `tau` per sign of `A`.
- ``vespo``: `-sg[phi(W)] A logp` with `W` the sequence ratio (a product, in log space) and
  `phi(W) = exp(lambda) W^k exp(-lambda W)`, `(k, lambda)` per sign of `A` (TRL's `get_gamma_weights`).

The masks TRL applies on top of any loss are functions here too: :func:`off_policy_sequence_mask`
(DeepSeek-V3.2's off-policy sequence masking) and :func:`high_entropy_mask` (Wang et al., 2025, the
80/20 rule: only the highest-entropy tokens carry gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_verl.algorithms.registry import (  # noqa: F401 (resolve_policy_loss and the tables: their public home)
    POLICY_LOSS_ALIASES,
    POLICY_LOSSES,
    register_policy_loss,
    resolve_policy_loss,
)

IS_LEVELS = ("token", "sequence")
# TRL's clip-ratio metrics of the clipped losses (stat -> logged name)
_CLIP_METRICS = {"clip_low": "clip_ratio/low_mean", "clip_high": "clip_ratio/high_mean",
                 "clip_region": "clip_ratio/region_mean"}


@dataclass(frozen=True)
class PolicyLossParams:
    """The knobs of every policy loss (each loss reads its own; defaults are TRL's and verl's).

    Args:
        clip_low / clip_high (`float`): the PPO clip range `[1 - clip_low, 1 + clip_high]` (`clip_high`
            None: `clip_low`). For ``cispo``, `clip_high` is the cap on the ratio (TRL's `epsilon_high`).
        dual_clip (`float`, *optional*): dual-clip constant `c > 1` (verl `clip_ratio_c`).
        delta (`float`, *optional*): two-sided clipping: the ratio is capped at `delta` (> 1) in the
            unclipped branch (TRL `delta`).
        importance_sampling_level (`str`): ``"token"`` or ``"sequence"`` (GSPO).
        sapo_temperature_pos / sapo_temperature_neg (`float`): SAPO's gate temperatures.
        vespo_k_pos / vespo_lambda_pos / vespo_k_neg / vespo_lambda_neg (`float`): VESPO's gamma weights.
        clip_cov_ratio / clip_cov_lb / clip_cov_ub: Clip-Cov's share of tokens and covariance window.
        kl_cov_ratio / kl_cov_coef: KL-Cov's share of tokens and penalty weight (verl's `ppo_kl_coef`).
        dro_beta: DRO's quadratic penalty. bypass_loss_type / rollout_is / rollout_is_threshold: `bypass_mode`.
    """

    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    kl_cov_coef: float = 1.0
    dro_beta: float | None = None
    bypass_loss_type: str = "ppo_clip"
    rollout_is: str | None = "sequence"
    rollout_is_threshold: float = 2.0

    @property
    def high(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high

    def validate(self) -> None:
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got "
                             f"{self.importance_sampling_level!r}.")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}.")
        if self.delta is not None and self.delta <= 1.0:
            raise ValueError(f"delta (two-sided clipping) must be > 1, got {self.delta}; TRL recommends "
                             "a value above 1 + epsilon_high.")
        if min(self.sapo_temperature_pos, self.sapo_temperature_neg) <= 0:
            raise ValueError("sapo_temperature_pos and sapo_temperature_neg must be > 0.")


def _col(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def log_importance_weights(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                           level: str = "token") -> torch.Tensor:
    """`log(pi / pi_old)`: per token `(B, T)`, or the masked mean over each sequence `(B, 1)` (GSPO)."""
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level == "sequence":
        maskf = mask.to(log_ratio.dtype)
        return ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {level!r}.")


def _clip_indicators(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> dict[str, torch.Tensor]:
    low_c = ((ratio < 1.0 - low) & (adv < 0)).float()
    high_c = ((ratio > 1.0 + high) & (adv > 0)).float()
    return {"low_clip": low_c, "high_clip": high_c, "region_clip": torch.clamp(low_c + high_c, max=1.0)}


@register_policy_loss("clip", metrics=_CLIP_METRICS)
def clip_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """PPO-clip on the token or sequence ratio, with two-sided (`delta`) and dual clipping."""
    adv = _col(advantages)
    ratio = torch.exp(log_importance_weights(logp, old_logp, mask, p.importance_sampling_level))
    clipped = torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.high)
    unclipped = ratio if p.delta is None else torch.clamp(ratio, max=p.delta)
    loss = -torch.min(unclipped * adv, clipped * adv)
    if p.dual_clip is not None:
        loss = torch.where(adv < 0, torch.min(loss, -p.dual_clip * adv), loss)
    return loss, _clip_indicators(ratio.detach(), adv, p.clip_low, p.high)


@register_policy_loss("gspo", metrics=_CLIP_METRICS)
def gspo_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """GSPO-token: PPO-clip with every token carrying its sequence's ratio in value and its own log-prob's
    gradient (`log w_t = sg[mean log ratio] + logp_t - sg[logp_t]`)."""
    adv = _col(advantages)
    seq = log_importance_weights(logp, old_logp, mask, "sequence").detach()
    log_w = (seq + logp - logp.detach()).clamp(max=10.0)
    ratio = torch.exp(log_w)
    clipped = torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.high)
    loss = -torch.min(ratio * adv, clipped * adv)
    return loss, _clip_indicators(ratio.detach(), adv, p.clip_low, p.high)


@register_policy_loss("sequence_clip", metrics=_CLIP_METRICS)
def sequence_clip_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """TRL's RLOO loss: PPO-clip on the sequence's ratio `exp(sum_t (logp_t - old_t))` (a product of the token ratios,
    not GSPO's geometric mean), one loss per sequence, `(B, 1)`; aggregated as a mean over sequences (`grpo`)."""
    adv = _col(advantages)
    maskf = mask.to(logp.dtype)
    ratio = torch.exp(((logp - old_logp) * maskf).sum(-1, keepdim=True))
    clipped = torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.high)
    loss = -torch.min(ratio * adv, clipped * adv)
    return loss, _clip_indicators(ratio.detach(), adv, p.clip_low, p.high)


@register_policy_loss("cispo", metrics={"cispo_clip": "cispo_clip_ratio"})
def cispo_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """CISPO: REINFORCE weighted by the ratio capped at `clip_high` and detached."""
    adv = _col(advantages)
    ratio = torch.exp(log_importance_weights(logp, old_logp, mask, p.importance_sampling_level))
    weight = torch.clamp(ratio, max=p.high).detach()
    loss = -weight * adv * logp
    return loss, {"cispo_clip": ((ratio.detach() > p.high) & (adv > 0)).float()}


@register_policy_loss("sapo", metrics={})
def sapo_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """SAPO: the hard clip replaced by a sigmoid gate `(4 / tau) sigmoid(tau (w - 1))` (slope 1 at w = 1)."""
    adv = _col(advantages)
    ratio = torch.exp(log_importance_weights(logp, old_logp, mask, p.importance_sampling_level))
    tau = torch.where(adv > 0, p.sapo_temperature_pos, p.sapo_temperature_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -gate * adv, {}


@torch.no_grad()
def vespo_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  is_ratio: torch.Tensor | None, p: PolicyLossParams) -> torch.Tensor:
    """VESPO's detached gamma weights `phi(W)`, `(B, 1)`, with `W` the product of the token ratios (times the
    engine/trainer importance ratio `is_ratio` when given), clamped to `[1e-8, e^20]` in log space."""
    floor = math.log(1e-8)
    maskf = mask.to(log_ratio.dtype)
    log_w = (log_ratio.clamp(-20.0, 20.0) * maskf).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.log(is_ratio).clamp(floor, 20.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    nonneg = _col(advantages) >= 0
    k = torch.where(nonneg, p.vespo_k_pos, p.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, p.vespo_lambda_pos, p.vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@register_policy_loss("vespo", importance_weights="argument", metrics={"vespo_phi": "vespo/phi_seq_mean"})
def vespo_loss(logp, old_logp, advantages, mask, p: PolicyLossParams, is_weights: torch.Tensor | None = None):
    """VESPO: REINFORCE weighted by the detached gamma weight of the sequence ratio."""
    phi = vespo_weights(advantages, (logp - old_logp).detach(), mask, is_weights, p)
    return -phi * _col(advantages) * logp, {"vespo_phi": phi.expand_as(logp)}


def off_policy_sequence_mask(advantages: torch.Tensor, logp: torch.Tensor, sampling_logp: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2): keep a sequence, `(B, 1)` of 0/1, when its advantage is
    >= 0 or the mean over its tokens of `sampling_logp - logp` (NaN counted as 0) is <= `threshold`."""
    maskf = mask.to(logp.dtype)
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    mean_kl = (kl * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1.0)
    return ((_col(advantages) >= 0) | (mean_kl <= threshold)).to(maskf.dtype)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold_value: float | None) -> torch.Tensor:
    """Tokens of the mask whose entropy is >= `threshold_value` (a quantile of the entropies of every rank,
    see :func:`entropy_quantile`); all False when it is None (no token anywhere)."""
    if threshold_value is None:
        return torch.zeros_like(mask, dtype=torch.bool)
    return ((entropies * mask.to(entropies.dtype)) >= threshold_value) & mask.bool()


def entropy_quantile(all_entropies: torch.Tensor, q: float) -> float | None:
    """The `q`-quantile (linear interpolation, as `torch.quantile`) of the masked entropies gathered from every
    rank; None when there are none."""
    if all_entropies.numel() == 0:
        return None
    return torch.quantile(all_entropies.float(), q).item()


def _verl_ratio(logp: torch.Tensor, old_logp: torch.Tensor, clamp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-ratio, ratio) with verl's clamp of the log-ratio to [-20, 20] (when `clamp`)."""
    d = logp - old_logp
    d = d.clamp(-20.0, 20.0) if clamp else d
    return d, torch.exp(d)


@register_policy_loss("vanilla", metrics={})
def vanilla_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """verl's `vanilla`: PPO-clip with dual clip (constant `dual_clip`, verl's default 3)."""
    adv = _col(advantages)
    _, ratio = _verl_ratio(logp, old_logp)
    c = 3.0 if p.dual_clip is None else p.dual_clip
    p1, p2 = -adv * ratio, -adv * torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.high)
    c1 = torch.max(p1, p2)
    loss = torch.where(adv < 0, torch.min(-adv * c, c1), c1)
    stats = {"pg_clip": (p2 > p1).float(), "pg_clip_lower": ((c1 > -adv * c) & (adv < 0)).float()}
    stats.update(_clip_indicators(ratio.detach(), adv, p.clip_low, p.high))
    return loss, stats


@register_policy_loss("cispo_clip", metrics={})
def cispo_clip_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """verl's `cispo`: REINFORCE weighted by the detached ratio clipped to `[1 - clip_low, 1 + clip_high]`."""
    adv = _col(advantages)
    _, ratio = _verl_ratio(logp, old_logp)
    clipped = torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.high)
    return -clipped.detach() * adv * logp, {"pg_clip": (ratio != clipped).float()}


@register_policy_loss("gpg", metrics={})
def gpg_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """GPG (Chu et al., 2025): plain REINFORCE, `-A logp` (no ratio, no clip)."""
    return -logp * _col(advantages), {}


def _dppo(logp, old_logp, advantages, p: PolicyLossParams, kind: str):
    adv = _col(advantages)
    _, ratio = _verl_ratio(logp, old_logp)
    c = 20.0 if p.dual_clip is None else p.dual_clip
    weight = torch.clamp(ratio, max=c).detach()
    with torch.no_grad():
        prob, old_prob = logp.exp(), old_logp.exp()
        if kind == "tv":
            valid = torch.where(adv > 0, prob - old_prob <= p.high, prob - old_prob >= -p.clip_low)
        else:
            bkl = old_prob * (old_logp - logp) + (1 - old_prob) * torch.log((1 - old_prob + 1e-8) / (1 - prob + 1e-8))
            valid = torch.where(adv > 0, (bkl <= p.high) | (prob <= old_prob), (bkl <= p.clip_low) | (prob >= old_prob))
        valid = valid.to(logp.dtype)
    loss = -adv * weight * logp * valid
    return loss, {"pg_clip": 1.0 - valid, "pg_clip_lower": (ratio.detach() > c).float() * valid}


@register_policy_loss("dppo_tv", metrics={})
def dppo_tv_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """DPPO with a total-variation trust region: a token trains only while its probability moved by less than
    `clip_high` up (A > 0) / `clip_low` down (A <= 0); REINFORCE weighted by the ratio truncated at `dual_clip`
    (default 20)."""
    return _dppo(logp, old_logp, advantages, p, "tv")


@register_policy_loss("dppo_kl", metrics={})
def dppo_kl_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """DPPO with a binary-KL trust region (`clip_high` for A > 0, `clip_low` otherwise)."""
    return _dppo(logp, old_logp, advantages, p, "kl")


@register_policy_loss("geo_mean", importance_weights="geometric_mean", metrics={})
def geo_mean_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """GMPO (Zhao et al., 2025): the geometric mean of the per-token ratios, clipped in log space to
    `[-clip_low, clip_high]` on the side the advantage's sign makes pessimistic, times the sequence's mean
    advantage: one loss per sequence, `(B, 1)`."""
    adv = _col(advantages).expand_as(logp)
    d = logp - old_logp
    sign = torch.sign(adv)
    clipped = d.clamp(-p.clip_low, p.high)
    d_star = sign * torch.min(sign * d, sign * clipped)
    maskf = mask.to(d.dtype)
    n = maskf.sum(-1, keepdim=True) + 1e-8
    seq_ratio = torch.exp((d_star * maskf).sum(-1, keepdim=True) / n)
    seq_adv = (adv * maskf).sum(-1, keepdim=True) / n
    was_clipped = (d != clipped).float()
    return -seq_adv * seq_ratio, {"pg_clip": was_clipped * (adv > 0), "pg_clip_lower": was_clipped * (adv < 0)}


@register_policy_loss("dro", metrics={})
def dro_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """DRO: `-(A logp - beta / 2 (logp - old)^2)`, a quadratic log-ratio penalty (`dro_beta` > 0)."""
    if p.dro_beta is None or p.dro_beta <= 0:
        raise ValueError(f"policy loss 'dro' needs dro_beta > 0, got {p.dro_beta}.")
    d = logp - old_logp
    return -(logp * _col(advantages) - 0.5 * p.dro_beta * d.square()), {}


@register_policy_loss("clip_cov", metrics={})
def clip_cov_loss(logp, old_logp, advantages, mask, p: PolicyLossParams, generator: torch.Generator | None = None):
    """Clip-Cov (Cui et al., 2025): PPO-clip where a random `clip_cov_ratio` share of the tokens whose
    advantage/log-prob covariance lies in `(clip_cov_lb, clip_cov_ub)` (and that are not already clipped) gets
    no gradient. The draw uses `generator` (default: torch's global generator)."""
    adv = _col(advantages).expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    p1, p2 = -adv * ratio, -adv * torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.high)
    with torch.no_grad():
        m = mask.bool()
        maskf = mask.to(logp.dtype)
        n = maskf.sum() + 1e-8
        adv_mean = (adv * maskf).sum() / n
        lp = logp.detach()
        cov = (adv - adv_mean) * (lp - (lp * maskf).sum() / n)
        cov = cov.masked_fill(~m | ((p2 > p1) & m), float("-inf"))
        candidates = torch.nonzero((cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & m)
        keep = torch.ones_like(logp)
        if len(candidates):
            count = max(int(p.clip_cov_ratio * maskf.sum().item()), 1)
            chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count]]
            keep[chosen[:, 0], chosen[:, 1]] = 0.0
    return torch.max(p1, p2) * keep, {"pg_clip": 1.0 - keep}


@register_policy_loss("kl_cov", metrics={})
def kl_cov_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """KL-Cov (Cui et al., 2025): `-A w`, plus `kl_cov_coef x |logp - old|` on the `kl_cov_ratio` share of
    tokens with the largest advantage/log-prob covariance."""
    adv = _col(advantages).expand_as(logp)
    d = logp - old_logp
    loss = -adv * torch.exp(d)
    with torch.no_grad():
        flat = mask.bool().flatten().nonzero().squeeze(-1)
        selected = flat.new_empty(0)
        if flat.numel():
            a, lp = adv.flatten()[flat], logp.detach().flatten()[flat]
            cov = (a - a.mean()) * (lp - lp.mean())
            k = max(1, int(flat.numel() * p.kl_cov_ratio))
            selected = flat[torch.topk(cov, k, largest=True).indices]
    penalty = torch.zeros_like(loss).flatten()
    penalty = penalty.index_put((selected,), p.kl_cov_coef * d.abs().flatten()[selected])
    return loss + penalty.view_as(loss), {}


@register_policy_loss("bypass_mode", behaviour="sampling", metrics={})
def bypass_loss(logp, old_logp, advantages, mask, p: PolicyLossParams):
    """verl's `bypass_mode`: the loss against the rollout engine's own log-probs (no trainer re-scoring), as
    PPO-clip (``bypass_loss_type="ppo_clip"``, verl's `vanilla`) or as REINFORCE weighted by truncated importance
    weights (``"reinforce"``: token or sequence ratios, `rollout_is`, capped at `rollout_is_threshold`). The caller
    passes the engine's log-probs as `old_logp`."""
    if p.bypass_loss_type == "ppo_clip":
        return vanilla_loss(logp, old_logp, advantages, mask, p)
    if p.bypass_loss_type != "reinforce":
        raise ValueError(f"bypass_loss_type must be 'ppo_clip' or 'reinforce', got {p.bypass_loss_type!r}.")
    adv = _col(advantages)
    weight = None
    with torch.no_grad():
        d = logp - old_logp
        maskf = mask.to(d.dtype)
        if p.rollout_is == "token":
            weight = torch.exp(d.clamp(-20.0, 20.0))
        elif p.rollout_is == "sequence":
            weight = torch.exp((d * maskf).sum(-1, keepdim=True).clamp(-20.0, 20.0)).expand_as(d)
        elif p.rollout_is is not None:
            raise ValueError(f"rollout_is must be 'token', 'sequence' or None, got {p.rollout_is!r}.")
        if weight is not None:
            weight = torch.clamp(weight * maskf, max=p.rollout_is_threshold)
    loss = -adv * logp
    return (loss if weight is None else loss * weight), {}


BUILTIN_POLICY_LOSSES = ("clip", "vanilla", "gspo", "sequence_clip", "cispo", "cispo_clip", "sapo", "vespo", "gpg",
                         "dppo_tv", "dppo_kl",
                         "geo_mean", "dro", "clip_cov", "kl_cov", "bypass_mode")
"""The policy losses hf_verl ships, registered as a user registers one (:func:`register_policy_loss`)."""
