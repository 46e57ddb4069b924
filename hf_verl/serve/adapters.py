"""LoRA adapters on the served model: vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

`load_lora_adapter` takes vLLM's body, `{"lora_name": ..., "lora_path": <a PEFT adapter folder on the server's
disk>}` (`"load_inplace": true` replaces an adapter of that name), or hf_verl's inline form
`{"lora_name": ..., "lora_config": <a peft LoraConfig as a dict>}`, which creates the adapter with PEFT's
initialisation so that its weights can then be streamed through `POST /v1/weights` under the PEFT model's own names
(adapter-only weight sync: the base weights stay, only the adapters move). A request whose `model` names a loaded
adapter is generated with it; one naming the served model, with every adapter off. Both routes change what is
served: they require the server's token, and each bumps the weight version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Any

import torch

from hf_verl.rollout.base import RolloutEngine
from hf_verl.serve.errors import ServeError

logger = logging.getLogger(__name__)


class AdapterHost:
    """The LoRA adapters loaded on `engine`'s model (a transformers engine), under the generation `lock`."""

    def __init__(self, engine: RolloutEngine, lock: threading.Lock) -> None:
        self.engine, self.lock = engine, lock
        self.names: list[str] = []

    def _model(self) -> torch.nn.Module:
        model = getattr(self.engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ServeError(400, f"LoRA adapters need the model in this process; this server's "
                                  f"{type(self.engine).__name__} does not expose it: serve with --engine transformers "
                                  "(or use vllm serve --enable-lora)", "lora_name")
        return model

    def load(self, body: Any) -> dict:
        """Load (or, with `load_inplace`, replace) an adapter; see the module docstring."""
        from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model

        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
            raise ServeError(400, "load_lora_adapter needs {\"lora_name\": <name>, \"lora_path\": <folder>} or "
                                  "{\"lora_name\": <name>, \"lora_config\": {...}}", "lora_name")
        name, path, config = body["lora_name"], body.get("lora_path"), body.get("lora_config")
        if (path is None) == (config is None):
            raise ServeError(400, "give one of lora_path (a PEFT adapter folder on the server) and lora_config (a "
                                  "LoraConfig as a dict)", "lora_path")
        if path is not None and not (isinstance(path, str) and os.path.isfile(os.path.join(path,
                                                                                           "adapter_config.json"))):
            raise ServeError(400, f"no PEFT adapter folder (adapter_config.json) at {path!r} on the server",
                             "lora_path")
        try:
            if path is not None:
                config = PeftConfig.from_pretrained(path)
            else:
                if not isinstance(config, dict):
                    raise TypeError(f"lora_config must be a JSON object, got {type(config).__name__}")
                fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
                ignored = sorted(set(config) - fields)
                if ignored:
                    logger.info("load_lora_adapter: ignoring lora_config keys this peft does not take: %s", ignored)
                config = LoraConfig(**{k: v for k, v in config.items() if k in fields})
        except (TypeError, ValueError) as err:
            raise ServeError(400, f"not a LoRA configuration: {err}", "lora_config") from None
        with self.lock:
            model = self._model()
            if name in self.names:
                if not body.get("load_inplace", False):
                    raise ServeError(400, f"adapter {name!r} is already loaded; unload it first or send "
                                          "\"load_inplace\": true", "lora_name")
                model.delete_adapter(name)
                self.names.remove(name)
            config.inference_mode = True
            if isinstance(model, PeftModel):
                model.add_adapter(name, config)
            else:
                model = get_peft_model(model, config, adapter_name=name)
            if path is not None:
                from peft.utils import set_peft_model_state_dict
                from safetensors.torch import load_file

                weights = os.path.join(path, "adapter_model.safetensors")
                if not os.path.isfile(weights):
                    raise ServeError(400, f"{path!r} has no adapter_model.safetensors (pickled adapters are not "
                                          "loaded)", "lora_path")
                set_peft_model_state_dict(model, load_file(weights), adapter_name=name)
            model.eval().requires_grad_(False)
            self.engine.model = model
            self.names.append(name)
            self.engine._bump_version()
            version = self.engine.weight_version
        logger.info("loaded LoRA adapter %r (r=%s); weight version %d", name, getattr(config, "r", "?"), version)
        return {"loaded": name, "weight_version": version}

    def unload(self, body: Any) -> dict:
        """Remove a loaded adapter (the base model is served again once none is left)."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        with self.lock:
            if name not in self.names:
                raise ServeError(404, f"no adapter {name!r} is loaded (loaded: {self.names})", "lora_name")
            model = self.engine.model
            model.delete_adapter(name)
            self.names.remove(name)
            if not self.names:
                self.engine.model = model.unload()  # the base model again, without LoRA layers
            self.engine._bump_version()
            version = self.engine.weight_version
        return {"unloaded": name, "weight_version": version}

    def context(self, adapter: str | None) -> contextlib.AbstractContextManager:
        """Around one generation (under the lock): `adapter` active, or every adapter off for the base model."""
        if not self.names:
            return contextlib.nullcontext()
        model = self.engine.model
        if adapter is None:
            return model.disable_adapter()
        model.set_adapter(adapter)
        return contextlib.nullcontext()
