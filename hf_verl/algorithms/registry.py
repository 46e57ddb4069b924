"""The registries of advantage estimators and policy losses: the extension points of hf_verl's algorithms.

Every built-in estimator (:mod:`hf_verl.algorithms.estimators`) and policy loss
(:mod:`hf_verl.algorithms.policy_losses`) is registered here with the same decorators a user calls from their
own file (importing :mod:`hf_verl.algorithms` imports them, so the built-ins are there before any lookup), and every front-end (`GRPOConfig`, `PPOConfig`, the facade's `TrainerConfig`) looks names up here, at
the time the config is built, so a name registered before that is accepted and run:

```python
import torch
from hf_verl.algorithms import register_advantage_estimator, register_policy_loss


@register_advantage_estimator("median_baseline")
def median_baseline(scores, mask, num_generations, **kwargs):
    grouped = scores.view(-1, num_generations)
    adv = (grouped - grouped.median(-1, keepdim=True).values).reshape(-1)
    return adv.unsqueeze(-1) * mask, None


@register_policy_loss("clipped_reinforce")
def clipped_reinforce(logp, old_logp, advantages, mask, params):
    ratio = torch.exp(logp - old_logp).clamp(max=1 + params.high).detach()
    return -ratio * advantages.unsqueeze(-1) * logp, {"ratio_capped": (ratio >= 1 + params.high).float()}

# GRPOConfig(advantage_estimator="median_baseline", policy_loss="clipped_reinforce", ...)
```

An estimator is called with keyword arguments (those its signature names, or all of them when it takes
`**kwargs`): `scores` `(B,)`, `mask` `(B, T)`, `num_generations`, `token_rewards` `(B, T)` (the score on the last
token, minus a KL penalty where the front-end puts one there), `values` `(B, T)` (the critic's, for an estimator
registered with `needs_critic=True`), `gamma`, `lam`, `scale_rewards`, `scores_per_func` `(B, K)`,
`reward_weights`, and on request (`requires=`) `greedy_scores` `(B,)` (ReMax's greedy baseline), `old_logprobs`
and `sum_pi_squared` `(B, T)` (the sampling policy's token statistics). It returns `(advantages (B, T), returns
(B, T) or None)`. Unless registered with `per_sequence=True`, it runs on the rows of every data-parallel rank
(a group may span ranks) and each rank keeps its own rows.

A policy loss is `fn(logp, old_logp, advantages, mask, params) -> (per_token_loss, stats)` as the built-ins in
:mod:`hf_verl.algorithms.policy_losses` are: `(B, T)` or `(B, 1)` per-token losses before aggregation, masking,
importance weights and the KL term, and per-token (or per-sequence) float statistics whose masked means are
logged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# inputs an estimator may ask for that cost the front-end a forward or a generation to provide
COSTLY_INPUTS = ("values", "greedy_scores", "old_logprobs", "sum_pi_squared")
ESTIMATOR_INPUTS = ("scores", "mask", "num_generations", "token_rewards", "values", "gamma", "lam",
                    "scale_rewards", "scores_per_func", "reward_weights", "greedy_scores", "old_logprobs",
                    "sum_pi_squared")
BEHAVIOURS = ("old", "sampling")
WEIGHTINGS = ("multiply", "geometric_mean", "argument")


def _accepted(fn: Callable) -> frozenset[str] | None:
    """The keyword names `fn` takes, or None when it takes `**kwargs` (every name)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered advantage estimator (see the module docstring).

    Attributes:
        name (`str`): the name configs give (`advantage_estimator=...`).
        fn (`Callable`): the estimator.
        needs_critic (`bool`): it reads the critic's `values` (GAE): run by PPO with a value model.
        per_sequence (`bool`): each row's advantages depend on that row alone, so it runs on a rank's own rows;
            otherwise on the rows of every data-parallel rank.
        uses_groups (`bool`): it compares the `num_generations` completions of a prompt (needs groups of 2+).
        requires (`tuple[str, ...]`): inputs that must be given (not None); of :data:`COSTLY_INPUTS`, the
            front-end computes the ones named here and no others.
    """

    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    needs_critic: bool = False
    per_sequence: bool = False
    uses_groups: bool = True
    requires: tuple[str, ...] = ("scores",)
    accepts: frozenset[str] | None = field(default=None, repr=False)

    def __call__(self, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the estimator on `inputs` (those it does not take are left out); checks what it requires."""
        for name in self.requires:
            if inputs.get(name) is None:
                what = " (a critic)" if name == "values" else ""
                raise ValueError(f"estimator {self.name!r} needs {name}{what}.")
        mask = inputs["mask"]
        rows = next((inputs[k] for k in ("scores", "token_rewards") if inputs.get(k) is not None), mask)
        if mask.dim() != 2 or mask.shape[0] != rows.shape[0]:
            raise ValueError(f"mask must be (B, T) with B={rows.shape[0]}, got shape {tuple(mask.shape)}.")
        kwargs = inputs if self.accepts is None else {k: v for k, v in inputs.items() if k in self.accepts}
        out = self.fn(**kwargs)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
            raise TypeError(f"advantage estimator {self.name!r} must return (advantages, returns_or_None), got "
                            f"{type(out).__name__}.")
        return out


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss (see the module docstring).

    Attributes:
        name (`str`): the name configs give (`policy_loss=...`).
        fn (`Callable`): `fn(logp, old_logp, advantages, mask, params) -> (per_token_loss, stats)`.
        behaviour (`str`): the log-probs the ratio is taken against: `"old"` (the trainer's recomputed old
            policy, the rollout's own when on-policy) or `"sampling"` (the rollout engine's, verl's bypass mode;
            the importance weights are then not applied).
        importance_weights (`str`): how engine/trainer importance weights enter: `"multiply"` (per token or
            sequence, after the loss), `"geometric_mean"` (the sequence's geometric mean of the token weights,
            for a sequence-level loss), or `"argument"` (passed to `fn` as `is_weights=`, which folds them in).
        metrics (`dict[str, str]`, *optional*): stat name -> the name it is logged under by the critic-free
            trainers (TRL's metric names); None logs every stat under its own name.
    """

    name: str
    fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    behaviour: str = "old"
    importance_weights: str = "multiply"
    metrics: dict[str, str] | None = None

    def __call__(self, logp, old_logp, advantages, mask, params, **kwargs):
        return self.fn(logp, old_logp, advantages, mask, params, **kwargs)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
"""Every registered advantage estimator by name (the built-ins and the user's)."""

POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Every registered policy loss by hf_verl name (the built-ins and the user's)."""

POLICY_LOSS_ALIASES = {"ppo": "clip", "cispo": "cispo_clip"}
"""Names given to `policy_loss` (verl's `policy_loss.loss_mode`) whose hf_verl loss differs: verl's `cispo` clips
the ratio on both sides around 1, TRL's `loss_type="cispo"` only caps it at `epsilon_high`."""


def _check_name(name: Any, kind: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a {kind} is registered under a non-empty string name, got {name!r}.")
    return name


def register_advantage_estimator(name: str, *, needs_critic: bool = False, per_sequence: bool = False,
                                 uses_groups: bool | None = None, requires: tuple[str, ...] = ("scores",),
                                 replace: bool = False) -> Callable[[Callable], Callable]:
    """Register an advantage estimator under `name` (a decorator; the function is returned unchanged).

    Args:
        name (`str`): the name configs give, e.g. `GRPOConfig(advantage_estimator=name)`.
        needs_critic (`bool`): it reads the critic's `values` (runs only with a critic; GRPO refuses it).
        per_sequence (`bool`): computed on each rank's rows alone (no statistic across rows).
        uses_groups (`bool`, *optional*): it compares a prompt's completions, so needs `num_generations >= 2`;
            default: not `needs_critic`.
        requires (`tuple[str, ...]`): inputs that must be given; naming `greedy_scores`, `old_logprobs` or
            `sum_pi_squared` makes the front-end compute them (a greedy generation, a forward of the actor).
        replace (`bool`): allow replacing an estimator already registered under `name`.

    Raises:
        ValueError: `name` is taken (without `replace=True`), or `requires` names an unknown input.

    Example:
        ```python
        @register_advantage_estimator("centred")
        def centred(scores, mask, num_generations, **kwargs):
            g = scores.view(-1, num_generations)
            return (g - g.mean(-1, keepdim=True)).reshape(-1, 1) * mask, None
        ```
    """
    _check_name(name, "advantage estimator")
    unknown = sorted(set(requires) - set(ESTIMATOR_INPUTS))
    if unknown:
        raise ValueError(f"register_advantage_estimator({name!r}): requires names unknown inputs {unknown}; the "
                         f"inputs are {ESTIMATOR_INPUTS}.")

    def decorate(fn: Callable) -> Callable:
        if name in ADVANTAGE_ESTIMATORS and not replace:
            raise ValueError(f"an advantage estimator named {name!r} is already registered "
                             f"({ADVANTAGE_ESTIMATORS[name].fn.__module__}); pass replace=True to replace it.")
        needs = tuple(requires) + (("values",) if needs_critic and "values" not in requires else ())
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(
            name, fn, needs_critic=needs_critic, per_sequence=per_sequence,
            uses_groups=(not needs_critic) if uses_groups is None else uses_groups, requires=needs,
            accepts=_accepted(fn))
        return fn

    return decorate


def register_policy_loss(name: str, *, behaviour: str = "old", importance_weights: str = "multiply",
                         metrics: dict[str, str] | None = None, replace: bool = False
                         ) -> Callable[[Callable], Callable]:
    """Register a policy loss under `name` (a decorator; the function is returned unchanged).

    Args:
        name (`str`): the name configs give as `policy_loss=name`.
        behaviour (`str`): `"old"` or `"sampling"` (see :class:`PolicyLoss`).
        importance_weights (`str`): `"multiply"`, `"geometric_mean"` or `"argument"` (see :class:`PolicyLoss`).
        metrics (`dict[str, str]`, *optional*): which returned stats the trainers log, under which names; None:
            every stat under its own name.
        replace (`bool`): allow replacing a loss already registered under `name`.

    Raises:
        ValueError: `name` is taken (without `replace=True`) or is an alias, or a mode is unknown.
    """
    _check_name(name, "policy loss")
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"register_policy_loss({name!r}): behaviour must be one of {BEHAVIOURS}, got {behaviour!r}.")
    if importance_weights not in WEIGHTINGS:
        raise ValueError(f"register_policy_loss({name!r}): importance_weights must be one of {WEIGHTINGS}, got "
                         f"{importance_weights!r}.")

    def decorate(fn: Callable) -> Callable:
        # `policy_loss=<alias>` names another loss (verl's); TRL's capped "cispo" form is hf_verl's own under it
        if name in POLICY_LOSS_ALIASES and not fn.__module__.startswith("hf_verl."):
            raise ValueError(f"{name!r} is an alias of the policy loss {POLICY_LOSS_ALIASES[name]!r}; register under "
                             "another name.")
        if name in POLICY_LOSSES and not replace:
            raise ValueError(f"a policy loss named {name!r} is already registered ({POLICY_LOSSES[name].fn.__module__}); "
                             "pass replace=True to replace it.")
        POLICY_LOSSES[name] = PolicyLoss(name, fn, behaviour, importance_weights,
                                         None if metrics is None else dict(metrics))
        return fn

    return decorate


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`.

    Raises:
        ValueError: naming the registered estimators and how to add one.
    """
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {tuple(ADVANTAGE_ESTIMATORS)}, or "
                         "register your own with @hf_verl.algorithms.register_advantage_estimator(name).") from None


def resolve_policy_loss(name: str) -> str:
    """The registered name of a policy loss given by hf_verl's or verl's name.

    Raises:
        ValueError: naming the registered losses and how to add one.
    """
    name = POLICY_LOSS_ALIASES.get(name, name)
    if name not in POLICY_LOSSES:
        known = sorted(set(POLICY_LOSSES) | set(POLICY_LOSS_ALIASES))
        raise ValueError(f"unknown policy loss {name!r}; choose one of {known}, or register your own with "
                         "@hf_verl.algorithms.register_policy_loss(name).")
    return name


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name` (or an alias of it)."""
    return POLICY_LOSSES[resolve_policy_loss(name)]


def advantage_estimator_names(*, critic: bool | None = None) -> tuple[str, ...]:
    """The registered estimator names; `critic=False`: those that run without a critic, `True`: those that need
    one."""
    return tuple(n for n, e in ADVANTAGE_ESTIMATORS.items() if critic is None or e.needs_critic == critic)
