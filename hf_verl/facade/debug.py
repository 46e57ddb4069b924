"""Tracing and debug records of the facade: trace ids, a trace-aware logger, tensor records.

Each rollout gets a `trace_id` (12 hex characters of a uuid4). It is the current trace of the
rollout and of the `compute_loss` / `step` calls that use it: every log line of those calls goes
through :class:`TraceLogger`, which prefixes `[trace=<id>]` and sets `record.trace_id`, and
:func:`current_trace_id` exposes it to user code (a reward function, say) through a contextvar.

With debug mode on, :class:`DebugRecorder` writes one JSON line per tensor crossing a role
boundary (`name`, `shape`, `dtype`, `device`, the boundary, the trace id) and logs the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import resource
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch

_TRACE: contextvars.ContextVar[str | None] = contextvars.ContextVar("hf_verl_trace_id", default=None)
DEFAULT_DEBUG_FILE = "hf_verl_debug.jsonl"


def new_trace_id() -> str:
    """A short random id (12 hex characters of a uuid4)."""
    return uuid.uuid4().hex[:12]


def current_trace_id() -> str | None:
    """The trace id of the rollout / loss / step being run, or None outside one."""
    return _TRACE.get()


@contextlib.contextmanager
def trace(trace_id: str) -> Iterator[str]:
    """Make `trace_id` current for the duration of the block."""
    token = _TRACE.set(trace_id)
    try:
        yield trace_id
    finally:
        _TRACE.reset(token)


class TraceLogger(logging.LoggerAdapter):
    """A logger adapter that stamps the current trace id on every record (`record.trace_id`)."""

    def process(self, msg: Any, kwargs: dict) -> tuple[Any, dict]:
        tid = current_trace_id()
        extra = dict(kwargs.get("extra") or {})
        extra.setdefault("trace_id", tid)
        kwargs["extra"] = extra
        return (f"[trace={tid}] {msg}" if tid else msg), kwargs


def peak_memory_mb(device: torch.device | None = None) -> float:
    """Peak memory in MiB: `torch.cuda.max_memory_allocated` on CUDA, else the process's peak RSS."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def describe(value: Any) -> dict[str, Any]:
    """Shape, dtype and device of a tensor."""
    return {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
            "device": str(value.device)}


class DebugRecorder:
    """Records the tensors crossing each role boundary to the log and to a JSONL file.

    Args:
        path (`str`): the JSONL file (appended to).
        logger (`logging.LoggerAdapter`): where each record is also logged (INFO).
    """

    def __init__(self, path: str, logger: logging.LoggerAdapter) -> None:
        self.path = path
        self.logger = logger

    def record(self, boundary: str, tensors: Mapping[str, Any], **fields: Any) -> None:
        """Write one record per tensor of `tensors` (non-tensors and None are skipped)."""
        rows = []
        for name, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                continue
            row = {"time": time.time(), "trace_id": current_trace_id(), "boundary": boundary,
                   "name": name, **describe(value), **fields}
            rows.append(row)
            self.logger.info("debug %s: %s shape=%s dtype=%s device=%s", boundary, name,
                             row["shape"], row["dtype"], row["device"])
        if rows:
            folder = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(folder, exist_ok=True)
            with open(self.path, "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
