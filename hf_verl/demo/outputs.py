"""Where the demo's runs go: one folder per run under the output root, a `latest` pointer, the trained model.

Layout under the root (`hf-verl demo --output-dir`, `hf_verl_demo/` by default)::

    hf_verl_demo/
      grpo/20261206-073352-seed0/   one run: metrics.jsonl, reward.png, summary.json
        model/                      the trained policy and its tokenizer (`save_pretrained` layout;
                                    PPO's also holds its critic under model/critic/)
      ppo/...  dpo/...
      latest -> grpo/20261206-073352-seed0

A run never reuses a folder, so runs do not overwrite each other. `model/` loads with
`AutoModelForCausalLM.from_pretrained` and serves with `hf-verl serve`.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

LATEST = "latest"
MODEL_DIR = "model"


def new_run_dir(root: str, algo: str, seed: int, now: float | None = None) -> str:
    """Create and return a fresh folder `<root>/<algo>/<YYYYmmdd-HHMMSS>-seed<seed>` (a `-2`, `-3`, ... suffix
    when a run of the same second already took the name)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = os.path.join(root, algo, f"{stamp}-seed{seed}")
    os.makedirs(os.path.dirname(base), exist_ok=True)
    path, n = base, 1
    while True:
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1
            path = f"{base}-{n}"


def point_latest(root: str, run_dir: str) -> str:
    """Point `<root>/latest` at `run_dir` (a relative symlink, swapped in atomically); where the file system has
    no symlinks, `<root>/latest.txt` holds the run's path relative to `root` instead. Returns the pointer's path."""
    link = os.path.join(root, LATEST)
    target = os.path.relpath(run_dir, root)
    if os.path.exists(link) and not os.path.islink(link):
        logger.warning("%s exists and is not a link; not touching it (this run is in %s)", link, run_dir)
        return link
    tmp = f"{link}.tmp{os.getpid()}"
    try:
        os.symlink(target, tmp, target_is_directory=True)
        os.replace(tmp, link)
        return link
    except OSError:
        if os.path.lexists(tmp):
            os.remove(tmp)
        note = os.path.join(root, f"{LATEST}.txt")
        with open(note, "w") as f:
            f.write(target + "\n")
        return note


def latest_run(root: str) -> str:
    """The folder of the last run under `root` (through `latest` or `latest.txt`)."""
    link = os.path.join(root, LATEST)
    if os.path.isdir(link):
        return os.path.realpath(link)
    with open(os.path.join(root, f"{LATEST}.txt")) as f:
        return os.path.join(root, f.read().strip())


def save_trained_model(trainer, model_dir: str) -> str:
    """The trained policy and its tokenizer, written by the trainer's own `save_model` (whole HF weights as
    safetensors, `config.json`, `generation_config.json`, the tokenizer files); returns `model_dir`."""
    trainer.save_model(model_dir)
    logger.info("saved the trained model to %s", model_dir)
    return model_dir
