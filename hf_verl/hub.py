"""Resolving Hub ids of model roles without waiting on the network.

`from_pretrained` on an id that is not cached, with `HF_HUB_OFFLINE` set, would still retry the
network with back-off before failing; :func:`check_resolvable` answers at once from the local cache
and names the role (actor, critic, reference, reward) and what to do.
"""

from __future__ import annotations

import os


class RoleLoadError(OSError):
    """A role given as a Hub id or path could not be loaded."""


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def check_resolvable(role: str, model_id: str) -> None:
    """Fail fast, naming `role` and `model_id`, if an offline id is neither a folder nor cached.

    Raises:
        RoleLoadError: an `OSError` saying the id is not a local folder and not in the Hub cache.
    """
    if os.path.isdir(model_id) or not offline():
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        raise RoleLoadError(
            f"cannot load the {role} model {model_id!r}: {model_id!r} is not a local folder and is not in the Hub "
            f"cache ({os.environ.get('HF_HOME', '~/.cache/huggingface')}), and HF_HUB_OFFLINE is set. Download it "
            "first (`hf download <id>`), pass a local path, or pass a loaded model."
        )
