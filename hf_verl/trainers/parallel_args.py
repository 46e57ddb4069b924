"""`ParallelArguments`: what the three trainer configs share about the parallel backend.

The layout itself comes from the `accelerate launch` config (see
:mod:`hf_verl.parallel.backend`); the training engine applies it. One side effect has to be undone
here: `transformers.TrainingArguments`, seeing a DeepSpeed launch, registers a global DeepSpeed
config with transformers, after which every model built or loaded in the process is created for
ZeRO-3 (partitioned at birth by `deepspeed.zero.Init`, its weight init run through gathers). hf_verl
partitions each role itself when it calls `deepspeed.initialize`, and copies the unpartitioned
policy for the reference and the rollout engine first, so models are to be loaded whole: the
global registration is removed. (Loading huge models partitioned at birth is therefore not
available yet; every rank briefly holds the full weights on the CPU.)
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class ParallelArguments:
    """Mixed into the trainer configs (after `TrainingArguments.__post_init__` has run)."""

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks of this launch, from :class:`~hf_verl.parallel.dims.ParallelDims` (the
        processes not taken by sequence / tensor / pipeline parallelism): global batch sizes count them."""
        from hf_verl.parallel.dims import ParallelDims

        sp = getattr(self, "sequence_parallel_size", 1)
        return ParallelDims.data_parallel(self.world_size, self.process_index, shard=False, sp=sp).dp_size

    def _check_sequence_parallel(self) -> None:
        """`sequence_parallel_size`: an int >= 1 that divides the launch's processes (checked up front), and
        no accelerate `parallelism_config` that splits sequences or tensors itself."""
        from hf_verl.parallel.backend import check_accelerate_parallelism

        check_accelerate_parallelism()
        sp = self.sequence_parallel_size
        if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
            raise ValueError(f"sequence_parallel_size must be an int >= 1, got {sp!r}.")
        if self.world_size % sp:
            raise ValueError(f"sequence_parallel_size={sp} does not divide the {self.world_size} launched processes: "
                             f"launch a multiple of {sp} processes or choose a divisor of {self.world_size}.")

    def _take_over_deepspeed(self) -> None:
        if getattr(self, "deepspeed_plugin", None) is None:
            return
        from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

        if is_deepspeed_zero3_enabled():
            logger.info("DeepSpeed ZeRO-3 launch: models load whole and hf_verl's engine partitions them")
        unset_hf_deepspeed_config()
        plugin = self.deepspeed_plugin
        if hasattr(plugin, "dschf"):
            plugin.dschf = None
