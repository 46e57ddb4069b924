"""`VLLMArguments`: TRL's vLLM fields, shared by GRPOConfig and PPOConfig.

`use_vllm=True` generates with in-process vLLM (`vllm_mode="colocate"`, a
:class:`~hf_verl.rollout.vllm_engine.VLLMEngine`) or on an OpenAI-compatible server
(`vllm_mode="server"`, a :class:`~hf_verl.rollout.remote.RemoteEngine` on `vllm_server_*`). The
engine's log-probs are compared with the trainer's and, with
`vllm_importance_sampling_correction`, corrected by truncated or masked importance sampling (also
used for the stale samples of asynchronous rollout).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hf_verl.settings import setting_field

logger = logging.getLogger(__name__)


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class VLLMArguments:
    use_vllm: bool = field(default=False, metadata=_help("Generate with vLLM: in-process (colocate) or on a server."))
    vllm_mode: str = field(default="colocate", metadata=_help("'colocate' (in-process VLLMEngine) or 'server' (RemoteEngine)."))
    vllm_server_base_url: str | None = field(default=None, metadata=_help("Server URL; overrides host and port."))
    vllm_server_host: str = field(default="0.0.0.0", metadata=_help("Server host (TRL's default)."))
    vllm_server_port: int = field(default=8000, metadata=_help("Server port."))
    vllm_server_timeout: float = field(default=240.0, metadata=_help("Seconds per request before retrying."))
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_help("Colocate mode: passed to vLLM."))
    vllm_tensor_parallel_size: int = field(default=1, metadata=_help("Colocate mode: passed to vLLM."))
    vllm_max_model_length: int | None = field(default=None, metadata=_help("Colocate mode: passed to vLLM."))
    vllm_enable_sleep_mode: bool = field(default=False, metadata=_help("Colocate mode: passed to vLLM."))
    vllm_importance_sampling_correction: bool = setting_field("vllm_importance_sampling_correction", None, (
        "Correct the engine/trainer mismatch by importance sampling."))
    vllm_importance_sampling_mode: str = setting_field("vllm_importance_sampling_mode", None, (
        "token_truncate, token_mask, sequence_truncate or sequence_mask."))
    vllm_importance_sampling_clip_min: float | None = setting_field("vllm_importance_sampling_clip_min", None, (
        "Lower ratio bound."))
    vllm_importance_sampling_clip_max: float | None = setting_field("vllm_importance_sampling_clip_max", None, (
        "Upper ratio bound."))
    vllm_importance_sampling_cap: float | None = field(default=None, metadata=_help(
        "Deprecated alias (TRL) of vllm_importance_sampling_clip_max; overrides it when set."))
    vllm_model_impl: str = field(default="vllm", metadata=_help("Colocate mode: vLLM's model_impl ('vllm' or 'transformers')."))
    vllm_structured_outputs_regex: str | None = field(default=None, metadata=_help(
        "Colocate mode: constrain completions to this regular expression (vLLM structured outputs)."))
    vllm_group_port: int = field(default=51216, metadata=_help(
        "TRL's NCCL weight-update port of a trl vllm-serve server; hf-verl serve takes weights over HTTP, so only "
        "the default is accepted."))

    def _validate_vllm(self) -> None:
        if self.use_vllm and self.vllm_mode not in ("server", "colocate"):
            raise ValueError(f"vllm_mode must be 'server' or 'colocate', got {self.vllm_mode!r}.")
        if self.vllm_model_impl not in ("vllm", "transformers", "auto"):
            raise ValueError(f"vllm_model_impl must be 'vllm', 'transformers' or 'auto', got {self.vllm_model_impl!r}.")
        if self.vllm_group_port != 51216:
            raise ValueError("vllm_group_port configures trl vllm-serve's NCCL weight group; hf_verl's server "
                             "(hf-verl serve) receives weights over HTTP with a token, so there is no group port: "
                             "remove vllm_group_port.")
        if self.vllm_structured_outputs_regex is not None and not (self.use_vllm and self.vllm_mode == "colocate"):
            raise ValueError("vllm_structured_outputs_regex needs use_vllm=True with vllm_mode='colocate' (the "
                             "transformers engine and hf-verl serve have no constrained decoding).")
        from hf_verl.algorithms.importance import IS_MODES

        if self.vllm_importance_sampling_mode not in IS_MODES:
            raise ValueError(f"vllm_importance_sampling_mode must be one of {IS_MODES}, "
                             f"got {self.vllm_importance_sampling_mode!r}.")
