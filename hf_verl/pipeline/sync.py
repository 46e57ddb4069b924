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

**Delta sync** (`weight_sync="delta"`, and `"auto"` for an engine whose bytes cross a wire: `hf-verl serve` through
:class:`~hf_verl.rollout.remote.RemoteEngine`): the sending rank keeps what it last sent at the engine's dtype and
streams, per tensor, nothing, a sparse delta or the whole tensor, whichever is smallest
(:mod:`hf_verl.parallel.weight_delta`); exact at the engine's dtype. The engine's `last_sync_stats` holds the bytes
sent and the bytes a full sync would have sent.
"""

from __future__ import annotations

import logging
import time
import weakref

from hf_verl.engine.base import TrainingEngine
from hf_verl.parallel import comm, watchdog
from hf_verl.parallel.weight_delta import DeltaTracker
from hf_verl.parallel.weight_export import DEFAULT_BUCKET_BYTES
from hf_verl.rollout.base import RolloutEngine

logger = logging.getLogger(__name__)
_TRACKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> what it was last sent


def uses_delta_sync(engine: RolloutEngine) -> bool:
    """Whether syncs of `engine` send only what changed (its `weight_sync_mode`, see the module docstring).

    Raises:
        ValueError: `"delta"` for an engine that takes whole tensors only.
    """
    mode = getattr(engine, "weight_sync_mode", "auto")
    if mode not in ("auto", "full", "delta", "adapter"):
        raise ValueError(f"weight_sync must be 'auto', 'full', 'delta' or 'adapter', got {mode!r}.")
    if mode == "delta" and not engine.accepts_weight_deltas:
        raise ValueError(f"weight_sync='delta' needs a rollout engine that applies sparse deltas (hf-verl serve "
                         f"through the remote engine); {type(engine).__name__} takes whole tensors: set "
                         "weight_sync='auto' or 'full'.")
    return mode == "delta" or (mode == "auto" and engine.accepts_weight_deltas)


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
    if getattr(engine, "weight_sync_mode", "auto") == "adapter":
        _sync_adapter(actor, engine, bucket, send=dims.is_main or not engine.serves_every_rank)
    elif engine.serves_every_rank and not dims.is_main:
        if not actor.holds_full_weights:
            for _ in actor.export_weights(bucket):  # gathering is collective: walk the buckets, send nothing
                pass
    elif uses_delta_sync(engine):
        tracker = _TRACKERS.setdefault(engine, DeltaTracker())
        try:
            engine.sync_weights(tracker.encode((pair for part in actor.export_weights(bucket) for pair in part),
                                               engine.weight_dtype()))
        except BaseException:
            tracker.forget()  # the engine's state is unknown now: the next sync sends everything
            raise
        engine.last_sync_stats = dict(tracker.stats)
        logger.info("delta weight sync: %d of %d bytes (%.1f%%; %d tensors unchanged, %d sparse, %d whole)",
                    tracker.stats["bytes"], tracker.stats["full_bytes"],
                    100.0 * tracker.stats["bytes"] / max(tracker.stats["full_bytes"], 1), tracker.stats["skipped"],
                    tracker.stats["sparse"], tracker.stats["whole"])
    else:
        engine.sync_weights(pair for part in actor.export_weights(bucket) for pair in part)
    if engine.serves_every_rank:
        comm.barrier(dims)  # no rank generates on the server before the update is in
    return time.perf_counter() - t0


_ADAPTER_SENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> adapter created on it


def holds_adapter_base(engine: RolloutEngine, name: str) -> None:
    """Record that `engine` already holds the actor's base weights and its LoRA adapter `name` (asynchronous
    rollout's copy of a PEFT actor, made in this process with its adapters unmerged): its adapter-only syncs send the
    adapters alone from the first one."""
    _ADAPTER_SENT[engine] = name


def _sync_adapter(actor: TrainingEngine, engine: RolloutEngine, bucket: int, send: bool = True) -> None:
    """`weight_sync="adapter"`: a PEFT actor's base weights once, then only its LoRA adapters (see
    :meth:`~hf_verl.rollout.remote.RemoteEngine.sync_adapter` and
    :meth:`~hf_verl.rollout.hf_engine.TransformersEngine.sync_adapter`). `engine.last_sync_stats` holds the bytes of
    each part sent.

    Raises:
        ValueError: an engine that takes no adapters, an actor without LoRA adapters, or an actor that trains
            weights other than its adapters (`modules_to_save`: they would never reach the engine).
    """
    from hf_verl.parallel.weight_export import unwrap_model
    from hf_verl.rollout.adapters import dequantized_base, is_lora_key, lora_config_dict

    if not getattr(engine, "accepts_adapters", False):
        raise ValueError(f"weight_sync='adapter' needs a rollout engine that loads LoRA adapters (hf-verl serve "
                         f"through the remote engine, the transformers engine); {type(engine).__name__} does not: "
                         "set weight_sync='auto' (merged weights).")
    model = unwrap_model(actor.model)
    if not hasattr(model, "peft_config"):
        raise ValueError(f"weight_sync='adapter' needs a PEFT LoRA actor (peft_config=...); the actor is a "
                         f"{type(model).__name__}: set weight_sync='auto'.")
    trained = [n for n, p in model.named_parameters()
               if (p.requires_grad and not is_lora_key(n)) or ".modules_to_save." in n]
    if trained:
        raise ValueError(f"weight_sync='adapter' sends the LoRA tensors only, but the actor also trains {trained[:3]} "
                         "(modules_to_save?): set weight_sync='auto' (merged weights), or train the adapters alone.")
    name = model.active_adapter
    config = lora_config_dict(model, name)
    first = engine not in _ADAPTER_SENT
    sent = {"adapter_bytes": 0, "base_bytes": 0}

    def counted(pairs, part):
        for name_, tensor in pairs:
            sent[part] += tensor.numel() * tensor.element_size()
            yield name_, tensor

    base = None
    if first:  # a QLoRA base goes dequantized, once
        exported = (pair for part in actor.export_weights(bucket, lora="base") for pair in part)
        base = counted(dequantized_base(model, exported), "base_bytes")
    adapter = counted((pair for part in actor.export_weights(bucket, lora="adapter") for pair in part),
                      "adapter_bytes")
    if send:
        engine.sync_adapter(name, config, base, adapter)
    elif not actor.holds_full_weights:  # gathering is collective: walk what the main rank sends
        for _ in (base or ()):
            pass
        for _ in adapter:
            pass
    _ADAPTER_SENT[engine] = name
    engine.last_sync_stats = sent
    logger.debug("adapter weight sync: %d adapter bytes, %d base bytes", sent["adapter_bytes"], sent["base_bytes"])
