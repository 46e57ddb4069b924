"""`ParallelArguments`: what the three trainer configs share about the parallel backend.

The layout itself comes from the `accelerate launch` config (see
:mod:`hf_verl.parallel.backend`); the training engine applies it. One side effect has to be undone
here: `transformers.TrainingArguments`, seeing a DeepSpeed launch, registers a global DeepSpeed
config with transformers, after which every model built or loaded in the process is created for
ZeRO-3 (partitioned at birth by `deepspeed.zero.Init`, its weight init run through gathers). hf_verl
decides per role instead, so the global registration is removed: a model given by id or path is loaded
sharded by hf_verl's own loader (:func:`~hf_verl.trainers.engine_glue.load_for_launch`:
:mod:`hf_verl.parallel.sharded_load` builds it under `zero.Init` with the role's DeepSpeed config and each rank
reads only its own partitions; docs/loading.md), and a model given as an object (or loaded whole, where the log
says why) is partitioned by the engine when it calls `deepspeed.initialize`.
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
        tp, pp = getattr(self, "tensor_model_parallel_size", 1), getattr(self, "pipeline_model_parallel_size", 1)
        return ParallelDims.data_parallel(self.world_size, self.process_index, shard=False, sp=sp, tp=tp,
                                          pp=pp).dp_size

    def _adopt_launch_cpu(self) -> None:
        """An accelerate config's `use_cpu: true`, adopted where accelerate's multi-process launcher did not pass it
        on (:func:`~hf_verl.parallel.backend.adopt_launch_cpu`); called before `TrainingArguments.__post_init__`
        sets the devices up, so that the processes join one gloo group."""
        from hf_verl.parallel.backend import adopt_launch_cpu

        if adopt_launch_cpu():
            self.use_cpu, self.dataloader_pin_memory = True, False

    def _check_sequence_parallel(self) -> None:
        """`sequence_parallel_size`, checked up front: an int >= 1 that divides the launch's processes; left at 1,
        it takes the launch's `parallelism_config` sp_size (both set and different: an error)."""
        from hf_verl.parallel.backend import resolve_sequence_parallel_size
        from hf_verl.settings import check_settings

        check_settings(self, ("sequence_parallel_size",))  # the schema's one mechanism (hf_verl.settings)
        sp = self.sequence_parallel_size = resolve_sequence_parallel_size(self.sequence_parallel_size)
        if self.world_size % sp:
            raise ValueError(f"sequence_parallel_size={sp} does not divide the {self.world_size} launched processes: "
                             f"launch a multiple of {sp} processes or choose a divisor of {self.world_size}.")

    def _take_over_deepspeed(self) -> None:
        if getattr(self, "deepspeed_plugin", None) is None:
            return
        from transformers.integrations import (
            is_deepspeed_zero3_enabled,
            unset_hf_deepspeed_config,
        )

        if is_deepspeed_zero3_enabled():
            if self.data_parallel_size >= 2:
                logger.info("DeepSpeed ZeRO-3 launch: a model given by id or path loads sharded, each rank reading "
                            "only its own partitions (or whole, with a line saying why); a model given as an object "
                            "is partitioned by hf_verl's engine")
            else:
                logger.info("DeepSpeed ZeRO-3 launch with one data-parallel rank: nothing to partition over, models "
                            "load whole")
        unset_hf_deepspeed_config()
        plugin = self.deepspeed_plugin
        if hasattr(plugin, "dschf"):
            plugin.dschf = None
