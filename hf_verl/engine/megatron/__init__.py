"""The Megatron-Core training engine (`backend="megatron"`): tensor and pipeline parallelism through hf_verl's bridge.

| module | holds |
|---|---|
| `engine.py` | :class:`MegatronEngine`: its construction (process groups, the stage, Megatron's DDP), views and the step |
| `scoring.py` | the scoring part: each request's forward as a plan the schedule runs; the vocabulary-parallel head |
| `optimizer.py` | the optimizer half of the step: Megatron's distributed optimizer and transformers' LR schedule |
| `weights.py` | the weights part: HF weights in (the bridge), export bucket by bucket, `save_pretrained`, checkpoints |
| `adapters.py` | the adapters part: a PEFT LoRA actor's adapters on the stage, the reference with them off, their export |

Imported on use (:func:`hf_verl.engine.registry.make_engine` with a layout whose engine is "megatron"): the
backend is optional.
"""

from hf_verl.engine.megatron.engine import MegatronEngine

__all__ = ["MegatronEngine"]
