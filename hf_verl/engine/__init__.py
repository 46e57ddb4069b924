"""Training engines: every model role (actor, critic, reference, reward model) behind one interface."""

from hf_verl.engine.base import TokenStats, TrainingEngine

__all__ = ["TokenStats", "TrainingEngine"]
