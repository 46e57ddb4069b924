"""Weight sync: the actor's current weights into the rollout engine, streamed bucket by bucket.

Three cases, decided here once for both front-ends:

- the engine generates with the actor's own parameter tensors (a
  :class:`~hf_verl.rollout.hf_engine.TransformersEngine` on the unsharded actor): nothing is
  copied, the engine's weight version is bumped;
- every rank has its own engine (in-process vLLM, a transformers engine on a replica of a sharded
  actor): every rank streams the actor's full HF-named tensors into it, one bucket at a time;
- one shared server for all ranks (an engine whose `serves_every_rank` is set, such as
  :class:`~hf_verl.rollout.remote.RemoteEngine`): the main rank streams; on a sharded actor the other ranks still walk the buckets, since gathering each shard is a
  collective.

The actor's export (:meth:`~hf_verl.engine.base.TrainingEngine.export_weights`) gathers FSDP2
shards and ZeRO-3 partitions one tensor at a time, so the trainer never holds more than a bucket of
whole tensors beyond its own shard.
"""

from __future__ import annotations

import time

from hf_verl.engine.base import TrainingEngine
from hf_verl.parallel import comm, watchdog
from hf_verl.parallel.weight_export import DEFAULT_BUCKET_BYTES
from hf_verl.rollout.base import RolloutEngine


def shares_actor_weights(engine: RolloutEngine, actor: TrainingEngine) -> bool:
    """Whether `engine` generates with the actor's own parameter tensors (so training mutates them)."""
    return actor.shares_weights_with(getattr(engine, "model", None))


@watchdog.phase("weight_sync", role="actor")
def sync_weights(actor: TrainingEngine, engine: RolloutEngine) -> float:
    """Bring `engine` to the actor's current weights (see the module docstring); returns seconds spent.

    Call it on every rank (it is a collective for sharded actors and per-rank engines).
    """
    t0 = time.perf_counter()
    if shares_actor_weights(engine, actor):
        engine.sync_weights(engine.model.named_parameters())  # the actor's own tensors: a version bump
        return time.perf_counter() - t0
    bucket = getattr(engine, "bucket_bytes", None) or DEFAULT_BUCKET_BYTES
    dims = actor.dims
    if engine.serves_every_rank and not dims.is_main:
        if not actor.holds_full_weights:
            for _ in actor.export_weights(bucket):  # gathering is collective: walk the buckets, send nothing
                pass
    else:
        engine.sync_weights(pair for part in actor.export_weights(bucket) for pair in part)
    if engine.serves_every_rank:
        comm.barrier(dims)  # no rank generates on the server before the update is in
    return time.perf_counter() - t0
