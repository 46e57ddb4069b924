"""Third-party notices that ask nothing of an hf_verl user, kept out of its runs' logs.

Only exact messages are dropped, each for a stated reason, on the logger that emits it; a user's own warnings and
every other message of those libraries pass. (Warnings raised inside Megatron-Core calls are filtered around
those calls only: :data:`hf_verl.parallel.megatron.compat.QUIET`.)

| logger | message | why it is noise here |
|---|---|---|
| `DeepSpeed` | "Setting accelerator to CPU. If you have GPU ..." | printed at import on every CPU machine, whether or not DeepSpeed is used |
"""

from __future__ import annotations

import logging

# logger name -> message prefixes dropped from it
DROPPED = {
    "DeepSpeed": ("Setting accelerator to CPU.",),
}


class _Drop(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


def install() -> None:
    """Attach the filters (idempotent); called by `import hf_verl`, before any of those libraries loads."""
    for name, prefixes in DROPPED.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in target.filters):
            target.addFilter(_Drop(prefixes))
