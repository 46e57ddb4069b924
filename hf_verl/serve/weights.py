"""Versioned weight updates of the rollout server: buckets staged until the last one, checked, applied at once.

A bucket is one safetensors body (`POST /v1/weights?update=<id>&index=<i>&last=0|1`), decoded into views of
the received bytes (:mod:`hf_verl.rollout.tensor_wire`), so that staging holds one copy of the update. Every
bucket is checked against the served model (names, shapes, floating-point kinds) when it arrives; anything
that is not such a bucket is a 400, whatever the bytes. The update is applied under the generation lock when
its last bucket has come, so a partial update is never served; the buckets of an update that never completes
expire after `staging_timeout_s`. Each applied update bumps the engine's weight version once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time

import torch

from hf_verl.parallel.weight_delta import DELTA_INDEX, DELTA_VALUE, split_entries
from hf_verl.rollout.base import RolloutEngine
from hf_verl.serve.errors import ServeError

logger = logging.getLogger(__name__)

MAX_BUCKETS = 1_000_000  # per update; an index beyond it is a malformed request
_UPDATE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def bucket_query(update: str | None, index: str | None, last: str | None) -> tuple[str, int, bool]:
    """The checked `update`, `index` and `last` query fields of a bucket upload."""
    if not update:
        raise ServeError(400, "a bucket needs ?update=<id>&index=<i>&last=0|1", param="update", close=True)
    if not _UPDATE_ID.fullmatch(update):
        raise ServeError(400, "update must be 1 to 128 letters, digits, '_', '.' or '-'", "update", close=True)
    try:
        number = int(index or "0")
    except ValueError:
        raise ServeError(400, "index must be an integer", "index", close=True) from None
    if not 0 <= number < MAX_BUCKETS:
        raise ServeError(400, f"index must be in [0, {MAX_BUCKETS})", "index", close=True)
    if (last or "0") not in ("0", "1"):
        raise ServeError(400, "last must be 0 or 1", "last", close=True)
    return update, number, last == "1"


class WeightReceiver:
    """Stage, check and apply weight updates for `engine` (see the module docstring).

    Args:
        engine ([`RolloutEngine`]): receives the updates (its `model`, when it has one, is checked against).
        lock (`threading.Lock`): held by generation; an update is applied under it.
        staging_timeout_s (`float`): staged buckets of an update not completed within this expire.
    """

    def __init__(self, engine: RolloutEngine, lock: threading.Lock, staging_timeout_s: float = 600.0) -> None:
        self.engine, self.lock, self.staging_timeout_s = engine, lock, staging_timeout_s
        self._staged: dict[str, dict] = {}
        self._staged_lock = threading.Lock()

    def receive_bucket(self, update: str, index: int, last: bool, payload: torch.Tensor,
                       in_flight: bool = False) -> dict:
        """Stage one bucket (`payload`: the body as a 1-D uint8 tensor); apply the update at its last."""
        from hf_verl.rollout.tensor_wire import decode

        try:
            tensors = decode(payload)  # views into the body: the bucket is held once
        except Exception as err:  # noqa: BLE001 (untrusted bytes: whatever fails, it is not a bucket)
            raise ServeError(400, f"body is not a safetensors bucket ({type(err).__name__}: {err}); the weights are "
                                  "unchanged", close=True) from None
        self.check(tensors)
        now = time.monotonic()
        with self._staged_lock:
            for key in [k for k, v in self._staged.items() if now - v["t"] > self.staging_timeout_s]:
                logger.warning("dropping incomplete weight update %s (no last bucket in time)", key)
                del self._staged[key]
            entry = self._staged.setdefault(update, {"t": now, "buckets": {}, "last": None})
            entry["t"] = now
            entry["buckets"][index] = tensors
            if last:
                entry["last"] = index
            complete = entry["last"] is not None and len(entry["buckets"]) == entry["last"] + 1
            if complete:
                del self._staged[update]
        if not complete:
            return {"applied": False, "received": index, "weight_version": self.engine.weight_version}
        merged = {}
        for i in sorted(entry["buckets"]):
            merged.update(entry["buckets"][i])
        return self.apply(merged, in_flight=in_flight)

    def receive_path(self, path) -> dict:
        """Load and apply a safetensors file, or every `.safetensors` file of a folder, from the server's disk."""
        from safetensors.torch import load_file

        if not isinstance(path, str):
            raise ServeError(400, f"'path' must be a string, got {type(path).__name__}", "path", close=True)
        if os.path.isdir(path):
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        elif os.path.isfile(path):
            files = [path]
        else:
            raise ServeError(400, f"no safetensors file or folder at {path!r}", "path", close=True)
        if not files:
            raise ServeError(400, f"{path!r} holds no .safetensors files", "path", close=True)
        tensors = {}
        for f in files:
            try:
                tensors.update(load_file(f))
            except Exception as err:  # noqa: BLE001 (safetensors raises its own error types)
                raise ServeError(400, f"{f!r} is not a readable safetensors file ({type(err).__name__}: {err}); "
                                      "the weights are unchanged", "path", close=True) from None
        self.check(tensors)
        return self.apply(tensors)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Refuse (400) names the model lacks, other shapes, and integer tensors for floating weights."""
        model = getattr(self.engine, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            return
        targets = model.state_dict()
        deltas = {k: v for k, v in tensors.items() if k.endswith((DELTA_INDEX, DELTA_VALUE))}
        if deltas:
            self._check_deltas(deltas, targets)
            tensors = {k: v for k, v in tensors.items() if k not in deltas}
        unknown = [k for k in tensors if k not in targets]
        if unknown:
            raise ServeError(400, f"unknown parameter name(s) {unknown[:5]}; names must be the model's state_dict "
                                  "keys; the weights are unchanged", close=True)
        bad = [f"{k}: {tuple(v.shape)} for {tuple(targets[k].shape)}" for k, v in tensors.items()
               if tuple(v.shape) != tuple(targets[k].shape)]
        if bad:
            raise ServeError(400, f"shape mismatch for {bad[:5]}; the weights are unchanged", close=True)
        odd = [k for k, v in tensors.items() if not v.is_floating_point() and targets[k].is_floating_point()]
        if odd:
            raise ServeError(400, f"non-floating tensors for floating weights {odd[:5]}; the weights are unchanged",
                             close=True)

    @staticmethod
    def _check_deltas(deltas: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
        """Sparse deltas (:mod:`hf_verl.parallel.weight_delta`): a known floating parameter, integer indices within
        it, floating values."""
        for key, tensor in deltas.items():
            name = key[: -len(DELTA_INDEX)] if key.endswith(DELTA_INDEX) else key[: -len(DELTA_VALUE)]
            target = targets.get(name)
            if target is None:
                raise ServeError(400, f"delta for unknown parameter {name!r}; the weights are unchanged", close=True)
            if tensor.dim() != 1:
                raise ServeError(400, f"{key!r} must be 1-D; the weights are unchanged", close=True)
            if key.endswith(DELTA_INDEX):
                if tensor.is_floating_point() or (tensor.numel() and (int(tensor.min()) < 0 or
                                                                      int(tensor.max()) >= target.numel())):
                    raise ServeError(400, f"{key!r} must hold integer indices within the {target.numel()} elements "
                                          f"of {name!r}; the weights are unchanged", close=True)
            elif not tensor.is_floating_point() and target.is_floating_point():
                raise ServeError(400, f"non-floating delta values for {name!r}; the weights are unchanged",
                                 close=True)

    def apply(self, tensors: dict[str, torch.Tensor], in_flight: bool = False) -> dict:
        """Load `tensors` into the engine under the generation lock; one version bump. `in_flight` (an engine
        that takes weights between two decode steps, :attr:`RolloutEngine.supports_in_flight_updates`): without
        waiting for the generation in progress, which continues under the new weights."""
        try:
            split_entries(tensors)  # every sparse delta complete (index and values, of one length)
        except ValueError as err:
            raise ServeError(400, f"{err} The weights are unchanged.", close=True) from None
        if any(k.endswith(DELTA_VALUE) for k in tensors) and not isinstance(getattr(self.engine, "model", None),
                                                                          torch.nn.Module):
            raise ServeError(400, f"sparse weight deltas need the model in this process; this server's "
                                  f"{type(self.engine).__name__} does not expose it: sync with weight_sync='full'",
                             close=True)
        if in_flight and not self.engine.supports_in_flight_updates:
            raise ServeError(400, f"in_flight=1: this server's {type(self.engine).__name__} cannot take weights while "
                                  "it generates; send the update without in_flight", close=True)
        with contextlib.nullcontext() if in_flight else self.lock:
            self.engine.sync_weights(tensors.items())
            version = self.engine.weight_version
        logger.info("applied a weight update of %d tensors%s; weight version %d", len(tensors),
                    " in flight" if in_flight else "", version)
        return {"applied": True, "weight_version": version, "num_tensors": len(tensors)}
