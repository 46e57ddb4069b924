"""The parts a training engine is made of; an engine implements the parts it serves.

| part | module | what it serves |
|---|---|---|
| :class:`EngineModel` | `model.py` | the role's model, layout (`dims`, `backend`) and train / eval mode, which the local parts share |
| :class:`ScoringEngine` | `scoring.py` | `infer(batch, request)`: what a reference, old policy or critic is asked (a served reference is only this) |
| :class:`ModelScoring` | `scoring.py` | scoring by a local model: `token_logprobs`, `token_values`, `logprobs`, `values`, `sampling_statistics`, `autocast`, and `infer` over them |
| :class:`StepEngine` | `stepping.py` | the step: `forward_backward`, `optimizer_step`, the optimizer and schedule and their state, `no_sync`, `zero_grad` |
| :class:`WeightsEngine` | `weights.py` | weights out and in, HF-named (`export_weights`, `full_state_dict`, `save_pretrained`), checkpoints, `rollout_model` |
| :class:`AdapterEngine` | `adapters.py` | PEFT adapters switched off (`has_adapters`, `adapters_disabled`) |

:class:`~hf_verl.engine.base.TrainingEngine` is all of them: what every engine a role is laid out on
(:func:`~hf_verl.engine.registry.make_engine`) implements.
"""

from hf_verl.engine.parts.adapters import AdapterEngine
from hf_verl.engine.parts.model import EngineModel
from hf_verl.engine.parts.scoring import ModelScoring, ScoringEngine, TokenStats
from hf_verl.engine.parts.stepping import StepEngine
from hf_verl.engine.parts.weights import WeightsEngine

__all__ = ["AdapterEngine", "EngineModel", "ModelScoring", "ScoringEngine", "StepEngine", "TokenStats",
           "WeightsEngine"]
