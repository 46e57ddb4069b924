"""Rollout engines behind one interface (:class:`~hf_verl.rollout.base.RolloutEngine`)."""
