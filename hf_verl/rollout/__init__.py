"""Rollout engines behind one interface (:class:`~hf_verl.rollout.base.RolloutEngine`), and the registry the
front-ends choose them from (:mod:`hf_verl.rollout.registry`): :func:`register_rollout_engine` adds one from a
user's own file."""

from hf_verl.rollout.registry import (
    ROLLOUT_ENGINES,
    SERVE_TOKEN_ENV,
    RolloutEngineContext,
    make_rollout_engine,
    register_rollout_engine,
)

__all__ = ["ROLLOUT_ENGINES", "SERVE_TOKEN_ENV", "RolloutEngineContext", "make_rollout_engine",
           "register_rollout_engine"]
