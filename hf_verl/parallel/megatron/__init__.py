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
