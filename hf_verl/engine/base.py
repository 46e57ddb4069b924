"""`TrainingEngine`: what every model role (actor, critic, reference, reward model) laid out in this process offers
the RL code.

The trainers and the facade never touch a model directly. They ask its engine for token log-probs / entropy /
values of a batch (`infer`), hand it every micro-batch of an optimizer step with a loss function
(`forward_backward`, :mod:`hf_verl.engine.step`) and then `optimizer_step`, stream its full HF-named weights to a
rollout engine, save and load it, and switch it between train and eval. How the model is laid out (one device, DDP
replicas, FSDP2 shards, ZeRO partitions, Megatron-Core tensor and pipeline ranks) is the engine's business alone: it
gathers inside when a result needs whole rows.

`TrainingEngine` is the composition of the parts in :mod:`hf_verl.engine.parts`, each an abstract base class of
its own, so that code needing one part can name it and an engine serving one part implements only that:

- the step (:class:`~hf_verl.engine.parts.stepping.StepEngine`): `forward_backward`, the optimizer and schedule;
- scoring (:class:`~hf_verl.engine.parts.scoring.ModelScoring`, a
  :class:`~hf_verl.engine.parts.scoring.ScoringEngine`): the forward primitives `token_logprobs` / `token_values`,
  the rollout-level `logprobs` / `values` / `sampling_statistics`, and `infer`;
- weights and checkpoints (:class:`~hf_verl.engine.parts.weights.WeightsEngine`);
- adapters (:class:`~hf_verl.engine.parts.adapters.AdapterEngine`).

A role that only scores, such as a reference served behind a URL
(:class:`~hf_verl.engine.remote_reference.RemoteReference`), is a `ScoringEngine` and no `TrainingEngine`:
`isinstance(engine, ScoringEngine)` asks whether a role scores, `isinstance(engine, TrainingEngine)` whether it
is laid out here with every part.
"""

from __future__ import annotations

from hf_verl.engine.parts import AdapterEngine, ModelScoring, StepEngine, TokenStats, WeightsEngine

__all__ = ["TokenStats", "TrainingEngine"]


class TrainingEngine(StepEngine, ModelScoring, WeightsEngine, AdapterEngine):
    """One model role on one parallel layout, with every part (see the module docstring).

    Attributes:
        role (`str`): "actor", "critic", "reference" or "reward".
        dims ([`ParallelDims`]): the layout; the only source of ranks and groups.
        backend ([`BackendSpec`]): plain, DDP, FSDP2, DeepSpeed ZeRO or Megatron.
        trainable (`bool`): whether the engine runs backward / optimizer steps.
        padding_free / shared_prefix (`bool`, *optional*): the layout switches of engines that lay rows out
            themselves (:class:`~hf_verl.engine.hf_layouts.HFLayouts`).
    """
