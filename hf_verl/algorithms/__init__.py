"""Pure tensor functions of the RL algorithms (advantages, policy losses, KL, log-probs), and the registries that
name the estimators and losses configs choose from (:mod:`hf_verl.algorithms.registry`):
:func:`register_advantage_estimator` and :func:`register_policy_loss` add one from a user's own file."""

from hf_verl.algorithms import estimators, policy_losses  # noqa: E402, F401 (the built-ins register on import)
from hf_verl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageEstimator,
    PolicyLoss,
    advantage_estimator_names,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
    resolve_policy_loss,
)

__all__ = ["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "AdvantageEstimator", "PolicyLoss", "advantage_estimator_names",
           "get_advantage_estimator", "get_policy_loss", "register_advantage_estimator", "register_policy_loss",
           "resolve_policy_loss"]
