"""`hf_verl.engine.megatron_engine.MegatronEngine`, kept importable by that name: the engine is the package
:mod:`hf_verl.engine.megatron`."""

from hf_verl.engine.megatron import MegatronEngine

__all__ = ["MegatronEngine"]
