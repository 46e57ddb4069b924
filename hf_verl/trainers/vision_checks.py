"""The settings a run on images cannot take, refused at construction with what to change.

Rows with images (:mod:`hf_verl.data.vision`) are generated on the transformers engine (pixel inputs in the
prefill, :mod:`hf_verl.rollout.vision`) and scored padded by the accelerate engines, one process or data-parallel
(DDP, FSDP2, ZeRO: :mod:`hf_verl.engine.vision`). Megatron, Ulysses sequence parallelism, vLLM and served
generators, tool-calling rollouts, a custom `rollout_func` and padding-free packing do not take them yet.
"""

from __future__ import annotations

from typing import Any


def refuse_vision_settings(trainer: str, args: Any, backend: Any, dims: Any, *, tools: bool = False,
                           rollout_func: bool = False) -> None:
    """Raise a ValueError naming the first setting of `args` (or the launch) that a run on images cannot take."""
    refusals = [
        (backend is not None and getattr(backend, "kind", None) == "megatron",
         "the Megatron engine does not take pixel inputs: launch with an accelerate config (DDP, FSDP2 or ZeRO)"),
        (dims is not None and getattr(dims, "sp", 1) > 1,
         "Ulysses sequence parallelism splits rows that carry image features: set sequence_parallel_size=1"),
        (bool(getattr(args, "use_vllm", False)),
         ("images are generated on the transformers engine (vLLM's multimodal inputs are not wired): set "
          "use_vllm=False")),
        (getattr(args, "rollout_engine", None) not in (None, "transformers"),
         "images are generated on the transformers engine: set rollout_engine=None or 'transformers'"),
        (bool(getattr(args, "padding_free", False)),
         "rows with images are scored padded: set padding_free=False"),
        (bool(getattr(args, "stop", None)), "image prompts are generated without stop strings: set stop=None"),
        (getattr(args, "advantage_estimator", None) == "remax",
         "ReMax's greedy baseline generates without pixel inputs: choose another advantage_estimator"),
        (tools, "tool-calling rollouts do not take image prompts yet: drop tools / environment_factory"),
        (rollout_func, "a custom rollout_func gets no pixel inputs: drop rollout_func or the image columns"),
    ]
    for refused, reason in refusals:
        if refused:
            raise ValueError(f"{trainer} on a dataset with images: {reason}.")
