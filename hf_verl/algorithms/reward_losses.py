"""The pairwise reward-model objective (Bradley-Terry) and its metrics, as pure tensor functions.

A reward model scores a whole sequence with one number, `r(x, y)`. Trained on preference pairs, the probability
that the chosen answer beats the rejected one is modelled as `sigmoid(r_chosen - r_rejected)` (Bradley & Terry,
1952; the InstructGPT reward model, Ouyang et al., 2022), so the loss is its negative log-likelihood
`-log sigmoid(r_chosen - r_rejected)`, averaged over pairs. Two options, both TRL's:

- a per-pair `margin` (Llama 2, Touvron et al., 2023): `-log sigmoid(r_chosen - r_rejected - margin)`, asking
  the chosen answer to win by at least the margin the annotators gave;
- `center_rewards_coefficient` (Eisenstein et al., 2023, eq. 2): adds `coef * mean((r_chosen + r_rejected)^2)`,
  which keeps the scores near zero (the pairwise term only sees differences, so their level would drift).

The metrics are TRL's `RewardTrainer` names: `accuracy` (share of pairs with `r_chosen > r_rejected`; a tie counts
as wrong), `margin` (the mean of `r_chosen - r_rejected`, whatever margin the data asks for), and `min_reward`,
`mean_reward`, `max_reward` over every score of the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, *, margin: torch.Tensor | None = None,
                       center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """The mean pairwise loss of a batch of pairs (see the module docstring).

    Args:
        chosen (`torch.Tensor` `(B,)`): the scores of the chosen sequences.
        rejected (`torch.Tensor` `(B,)`): the scores of the rejected sequences, pair by pair.
        margin (`torch.Tensor` `(B,)`, *optional*): how much each chosen score should exceed its rejected one.
        center_rewards_coefficient (`float`, *optional*): weight of the centring term; None: no term.

    Returns:
        `torch.Tensor`: a scalar.
    """
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen and rejected scores must pair up, got shapes {tuple(chosen.shape)} and "
                         f"{tuple(rejected.shape)}.")
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin.to(difference)
    loss = -F.logsigmoid(difference).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss


@torch.no_grad()
def pairwise_reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's reward-model metrics of one batch of pairs, as 0-d tensors (see the module docstring)."""
    scores = torch.cat([chosen, rejected]).float()
    chosen, rejected = chosen.float(), rejected.float()
    return {"accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean(),
            "min_reward": scores.min(), "mean_reward": scores.mean(), "max_reward": scores.max()}
