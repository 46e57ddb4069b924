"""Parallel layouts and distributed helpers: `ParallelDims`, the launch's backend, FSDP2 / DeepSpeed as functions
over a model, collectives, the watchdog, sharded loading, Ulysses attention, the Megatron bridge. The layout planner
that decides over them is :mod:`hf_verl.planner`."""
