"""Megatron-Core tensor and pipeline parallelism for hf_verl's model roles.

- :mod:`.bridge`: the HF <-> Megatron weight mechanism (direct / column / row / replicated mappings, fused QKV
  per query group, gate+up fused into fc1, vocabulary padding), :mod:`.families`: the mapping tables per model
  family (data only);
- :mod:`.model`: HF config -> Megatron `TransformerConfig` and one pipeline stage's `GPTModel`;
- :mod:`.engine`: :class:`~.engine.MegatronEngine`, the training engine (Megatron's schedules, DDP and
  distributed optimizer; vocabulary-parallel log-probs, :mod:`.vocab`);
- :mod:`.launch`: the layout of a launch; :mod:`.compat`: Megatron-Core on a machine without a GPU.

Selected with `backend="megatron"` (and `tensor_model_parallel_size` / `pipeline_model_parallel_size`) in the
trainer configs or the facade's config, or an accelerate `MEGATRON_LM` launch config; see docs/megatron.md.
Nothing here is imported by `import hf_verl`: megatron-core is an optional extra.
"""

from __future__ import annotations

import importlib.util
import sys


def megatron_core_found() -> bool:
    """Whether `megatron.core` is installed, looked up on the path without importing anything of megatron (not
    even its top-level package, which `importlib.util.find_spec("megatron.core")` would import): importing it
    prints Transformer Engine / Apex notices in every process of a run that may never use it."""
    if "megatron.core" in sys.modules:
        return True
    try:
        top = importlib.util.find_spec("megatron")  # a top-level lookup imports nothing
    except (ImportError, ValueError):
        return False
    locations = None if top is None else top.submodule_search_locations
    if not locations:
        return False
    for finder in sys.meta_path:  # what importlib does for a submodule, minus importing the parent package
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is not None and find_spec("megatron.core", list(locations)) is not None:
            return True
    return False
