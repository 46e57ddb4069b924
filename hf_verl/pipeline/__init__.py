"""The RL pipeline, once: the phases both front-ends (the TRL-style trainers and the role facade) run.

Plain functions over training engines (:mod:`hf_verl.engine`), rollout engines
(:mod:`hf_verl.rollout`), reward sources (:mod:`hf_verl.rewards`) and the one batch type
(:class:`~hf_verl.data.batch.RolloutBatch`), in the order a step runs them:

- :mod:`~hf_verl.pipeline.generation`: generate completions into a batch, score them;
- :mod:`~hf_verl.pipeline.phases`: reference / old log-probs, critic values, advantages over the
  data-parallel round, importance weights;
- :mod:`~hf_verl.pipeline.losses`: the policy loss and the value loss of a micro-batch;
- :mod:`~hf_verl.pipeline.sync`: the actor's weights into the rollout engine;
- :mod:`~hf_verl.pipeline.prefetch`: generating the next rollout while the current one trains.

A front-end decides *when* each phase runs (Trainer callbacks and buffers, or the user's loop)
and with which settings; the phases decide *how*.
"""
